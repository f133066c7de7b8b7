"""A second, independent renderer of the documented scene vocabulary.

It draws with PIL's ``ImageDraw`` (regular polygons and ellipses) at 3x the
size and downsamples with a Lanczos filter, uses exact palette colours, flat
backgrounds and uniform noise: different pixels from ``scenes.render_scene``
for the same vocabulary. Evaluating on it checks that a model reads shapes
and colours rather than one renderer's pixel statistics
(``vlm-readout evaluate-zoo --renderer alt``).
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

from core.zoo import scenes

SCALE = 3


def _draw_object(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, size: float, rot: float, fill):
    s = SCALE
    if shape == "circle":
        r = size / 2 * s
        draw.ellipse([cx * s - r, cy * s - r, cx * s + r, cy * s + r], fill=fill)
    elif shape == "square":
        draw.regular_polygon((cx * s, cy * s, size / math.sqrt(2) * s), 4, rotation=rot, fill=fill)
    else:  # equilateral triangle, apex up: PIL's n=3 polygon has a vertex at the top for rotation 0
        draw.regular_polygon((cx * s, cy * s, size / math.sqrt(3) * s), 3, rotation=rot, fill=fill)


def render_alt(rng: np.random.Generator, n_objects: int, image_size: int = scenes.IMAGE_SIZE):
    """(image (H, W, 3) uint8, objects) drawn by the alternative renderer."""
    big = image_size * SCALE
    bg = int(rng.integers(scenes.BACKGROUND_RANGE[0], scenes.BACKGROUND_RANGE[1] + 1))
    canvas = Image.new("RGB", (big, big), (bg, bg, bg))
    draw = ImageDraw.Draw(canvas)
    placed = scenes._place_objects(rng, n_objects, image_size)
    objects = []
    for color, shape, cx, cy, size, rot in placed:
        _draw_object(draw, shape, cx, cy, size, rot, scenes.COLORS[color])
        mask_big = Image.new("L", (big, big), 0)
        _draw_object(ImageDraw.Draw(mask_big), shape, cx, cy, size, rot, 255)
        cov = np.asarray(mask_big.resize((image_size, image_size), Image.BOX), np.float32) / 255.0
        mask = cov > 0
        ys, xs = np.nonzero(mask)
        box = [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]
        objects.append(scenes.SceneObject(color, shape, (cx, cy), size, rot, box, mask, cov))
    img = np.asarray(canvas.resize((image_size, image_size), Image.LANCZOS), np.float32)
    img = img + rng.uniform(-4, 4, size=img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8), objects


def make_alt_sample(index: int, *, kind: str | None = None) -> scenes.Sample:
    """Sample ``index`` of the alternative renderer (its own seeds)."""
    rng = np.random.default_rng([97, index])
    if kind is None:
        kind = scenes.QUESTION_KINDS[rng.integers(len(scenes.QUESTION_KINDS))]
    for _ in range(100):
        n = int(rng.integers(2 if kind == "relation" else 1, scenes.MAX_OBJECTS + 1))
        image, objects = render_alt(rng, n)
        asked = scenes._ask(rng, kind, objects, scenes.IMAGE_SIZE)
        if asked is not None:
            break
    template, fields, answer, foil, target, reference = asked
    question = scenes.TEMPLATES[template]["text"].format(**fields)
    return scenes.Sample(image, objects, question, answer, foil, kind, template, target, reference, "alt", index)
