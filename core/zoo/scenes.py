"""Synthetic shape scenes with exact ground truth.

A scene holds 1-4 objects, each a distinct (colour, shape) pair, drawn without
overlap on a grey background with noise. Every object records its centre, size,
rotation, pixel box and pixel mask, so a region counterfactual can remove
exactly the pixels an object's ink touches. Each sample pairs a scene with one
question from the templates in :data:`TEMPLATES`, its one-word answer and a
plausible foil.

Determinism: ``make_sample(split, index)`` draws everything from
``numpy.random.default_rng([SPLIT_SEEDS[split], index])``. Training uses the
``train`` split only; held-out evaluation uses ``heldout``, whose seeds the
training loop never reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

IMAGE_SIZE = 128
GRID = 8  # patch grid of the default models: 8 x 8 patches of 16 x 16 px
MAX_OBJECTS = 4

# The documented palette. Rendering jitters each channel by up to
# COLOR_JITTER so a model learns colour names, not exact values.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 90, 230),
    "yellow": (235, 215, 40),
    "purple": (150, 60, 200),
}
COLOR_JITTER = 20
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
SHAPE_PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles"}
# Object size as a fraction of the image side: circle diameter, square side,
# triangle side (equilateral, apex up before rotation).
SIZE_RANGE = (0.10, 0.35)
MAX_ROTATION_DEG = 15.0
BACKGROUND_RANGE = (20, 120)  # grey level; per-channel tint up to BACKGROUND_TINT
BACKGROUND_TINT = 8
NOISE_SIGMA_RANGE = (0.0, 6.0)
RELATION_MARGIN = 0.08  # centres must differ by this share of the side
RELATIONS = ("left of", "right of", "above", "below")
COUNT_WORDS = ("zero", "one", "two", "three", "four")

SPLIT_SEEDS = {"train": 1, "heldout": 2, "shifted": 3, "sample": 4, "val": 5}

QUESTION_KINDS = ("attribute", "relation", "count", "exist")

# Each template: its text with placeholders, the question kind it is scored
# under, and the kind of answer it expects.
TEMPLATES: dict[str, dict[str, str]] = {
    "color_of_shape": {
        "kind": "attribute",
        "text": "what color is the {shape}?",
        "answer": "color",
        "condition": "exactly one object of that shape",
    },
    "shape_of_color": {
        "kind": "attribute",
        "text": "what shape is the {color} object?",
        "answer": "shape",
        "condition": "exactly one object of that color",
    },
    "relation": {
        "kind": "relation",
        "text": "is the {color} {shape} {relation} the {color2} {shape2}?",
        "answer": "yes/no",
        "condition": "centres differ by at least 8% of the side along the axis",
    },
    "count_all": {
        "kind": "count",
        "text": "how many objects are there?",
        "answer": "count",
        "condition": "",
    },
    "count_shape": {
        "kind": "count",
        "text": "how many {shapes} are there?",
        "answer": "count",
        "condition": "",
    },
    "count_color": {
        "kind": "count",
        "text": "how many {color} objects are there?",
        "answer": "count",
        "condition": "",
    },
    "exist": {
        "kind": "exist",
        "text": "is there a {color} {shape}?",
        "answer": "yes/no",
        "condition": "",
    },
}
ANSWER_WORDS: tuple[str, ...] = (*COLORS, *SHAPES, "yes", "no", *COUNT_WORDS)


@dataclass
class SceneObject:
    """One drawn object. ``box`` is ``[x0, y0, x1, y1]`` in pixels, end-exclusive,
    the tight box of ``mask``; ``mask`` is ``(H, W)`` bool: every pixel the
    object's ink touches (coverage > 0)."""

    color: str
    shape: str
    center: tuple[float, float]
    size: float
    rotation_deg: float
    box: list[int]
    mask: np.ndarray = field(repr=False)
    coverage: np.ndarray = field(repr=False)  # (H, W) float32 in [0, 1]

    @property
    def name(self) -> str:
        return f"{self.color} {self.shape}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "color": self.color,
            "shape": self.shape,
            "center": [round(self.center[0], 3), round(self.center[1], 3)],
            "size": round(self.size, 3),
            "rotation_deg": round(self.rotation_deg, 3),
            "box": list(self.box),
        }


@dataclass
class Sample:
    """A scene, one question about it and the ground truth.

    ``image`` is ``(H, W, 3)`` uint8. ``target`` indexes the object the question
    is about (None for questions about the whole scene); ``reference`` the
    second object of a relation question.
    """

    image: np.ndarray = field(repr=False)
    objects: list[SceneObject]
    question: str
    answer: str
    foil: str
    kind: str
    template: str
    target: int | None = None
    reference: int | None = None
    split: str = ""
    index: int = -1

    @property
    def distractors(self) -> list[int]:
        used = {self.target, self.reference}
        return [i for i in range(len(self.objects)) if i not in used]

    def to_dict(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "index": self.index,
            "question": self.question,
            "answer": self.answer,
            "foil": self.foil,
            "kind": self.kind,
            "template": self.template,
            "target": self.target,
            "reference": self.reference,
            "objects": [o.to_dict() for o in self.objects],
        }


# ---------------------------------------------------------------- rendering


def _shape_vertices(shape: str, cx: float, cy: float, size: float, rot: float) -> np.ndarray:
    """Polygon vertices (n, 2) in pixel coordinates (x right, y down)."""
    if shape == "square":
        h = size / 2
        pts = np.array([[-h, -h], [h, -h], [h, h], [-h, h]])
    elif shape == "triangle":
        # Equilateral with side `size`, centroid at the origin, apex up.
        r = size / math.sqrt(3)
        angles = np.deg2rad([-90, 30, 150])
        pts = np.stack([r * np.cos(angles), r * np.sin(angles)], axis=1)
    else:
        raise ValueError(shape)
    t = math.radians(rot)
    rotm = np.array([[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]])
    return pts @ rotm.T + np.array([cx, cy])


def circumradius(shape: str, size: float) -> float:
    return {"circle": size / 2, "square": size / math.sqrt(2), "triangle": size / math.sqrt(3)}[shape]


def render_coverage(
    shape: str, cx: float, cy: float, size: float, rot: float, image_size: int, supersample: int
) -> np.ndarray:
    """Ink coverage of one object, ``(H, W)`` float32 in [0, 1].

    Pixels are sampled on a ``supersample x supersample`` sub-grid and averaged;
    ``supersample=1`` gives hard (aliased) edges.
    """
    cov = np.zeros((image_size, image_size), np.float32)
    rad = circumradius(shape, size) + 1
    x0, x1 = max(0, int(cx - rad)), min(image_size, int(math.ceil(cx + rad)) + 1)
    y0, y1 = max(0, int(cy - rad)), min(image_size, int(math.ceil(cy + rad)) + 1)
    s = supersample
    offs = (np.arange(s) + 0.5) / s
    xs = (np.arange(x0, x1)[:, None] + offs[None, :]).reshape(-1)
    ys = (np.arange(y0, y1)[:, None] + offs[None, :]).reshape(-1)
    gx, gy = np.meshgrid(xs, ys)
    if shape == "circle":
        inside = (gx - cx) ** 2 + (gy - cy) ** 2 <= (size / 2) ** 2
    else:
        verts = _shape_vertices(shape, cx, cy, size, rot)
        inside = np.ones_like(gx, dtype=bool)
        n = len(verts)
        for i in range(n):
            ax, ay = verts[i]
            bx, by = verts[(i + 1) % n]
            # Vertices run clockwise on screen (y down): inside is cross >= 0.
            inside &= (bx - ax) * (gy - ay) - (by - ay) * (gx - ax) >= 0
    block = inside.reshape(y1 - y0, s, x1 - x0, s).mean(axis=(1, 3))
    cov[y0:y1, x0:x1] = block
    return cov


def _place_objects(rng: np.random.Generator, n: int, image_size: int) -> list[tuple]:
    """Non-overlapping placements: (shape, colour, cx, cy, size, rot)."""
    combos = [(c, s) for c in COLORS for s in SHAPES]
    picks = rng.choice(len(combos), size=n, replace=False)
    placed: list[tuple] = []
    for k in picks:
        color, shape = combos[k]
        lo, hi = SIZE_RANGE
        for attempt in range(200):
            # Shrink the range when space runs out so every scene can be built.
            top = hi - (hi - lo) * min(1.0, attempt / 100)
            size = rng.uniform(lo, top) * image_size
            rot = rng.uniform(-MAX_ROTATION_DEG, MAX_ROTATION_DEG) if shape != "circle" else 0.0
            rad = circumradius(shape, size)
            cx = rng.uniform(rad + 1, image_size - rad - 1)
            cy = rng.uniform(rad + 1, image_size - rad - 1)
            if all(math.hypot(cx - p[2], cy - p[3]) > rad + circumradius(p[1], p[4]) + 2 for p in placed):
                placed.append((color, shape, cx, cy, size, rot))
                break
        else:  # pragma: no cover - the shrinking loop always finds room for 4
            raise RuntimeError("could not place objects")
    return placed


def render_scene(
    rng: np.random.Generator,
    n_objects: int,
    image_size: int = IMAGE_SIZE,
    override: tuple[int, str, str] | None = None,
) -> tuple[np.ndarray, list[SceneObject]]:
    """Draw a scene: background, objects composited by coverage, then noise.

    ``override``: object ``override[0]`` is drawn in colour ``override[1]`` and
    shape ``override[2]``; every random draw (background, placement, rotation,
    colour jitter, noise) is made exactly as without it, so everything else in
    the picture is identical (the counterfactual scenes)."""
    level = rng.uniform(*BACKGROUND_RANGE)
    tint = rng.uniform(-BACKGROUND_TINT, BACKGROUND_TINT, size=3)
    yy, xx = np.mgrid[0:image_size, 0:image_size].astype(np.float32) / image_size - 0.5
    gx, gy = rng.uniform(-12, 12, size=2)
    img = (level + tint)[None, None, :] + (gx * xx + gy * yy)[:, :, None]
    supersample = int(rng.choice([1, 2, 4, 4]))
    objects = []
    for k, (color, shape, cx, cy, size, rot) in enumerate(_place_objects(rng, n_objects, image_size)):
        if override is not None and k == override[0]:
            color, shape = override[1], override[2]
        cov = render_coverage(shape, cx, cy, size, rot, image_size, supersample)
        rgb = np.clip(np.array(COLORS[color]) + rng.integers(-COLOR_JITTER, COLOR_JITTER + 1, 3), 0, 255)
        img = img * (1 - cov[:, :, None]) + rgb[None, None, :] * cov[:, :, None]
        mask = cov > 0
        ys, xs = np.nonzero(mask)
        box = [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]
        objects.append(SceneObject(color, shape, (cx, cy), size, rot, box, mask, cov))
    sigma = rng.uniform(*NOISE_SIGMA_RANGE)
    img = img + rng.normal(0, sigma, size=img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8), objects


# ---------------------------------------------------------------- questions


def relation_offset(dx: float, dy: float, relation: str) -> float:
    """How far "a <relation> b" holds, from a's centre minus b's ``(dx, dy)``
    (image axes: y grows downwards): positive when it holds."""
    return {"left of": -dx, "right of": dx, "above": -dy, "below": dy}[relation]


def _relation_holds(a: SceneObject, b: SceneObject, relation: str, margin: float) -> bool | None:
    """True/False when the relation is unambiguous, None when too close to call."""
    d = relation_offset(a.center[0] - b.center[0], a.center[1] - b.center[1], relation)
    if abs(d) < margin:
        return None
    return d > 0


def _ask(rng: np.random.Generator, kind: str, objects: list[SceneObject], image_size: int):
    """Pick a question of ``kind`` about the scene, or None if none applies."""
    shapes = [o.shape for o in objects]
    colors = [o.color for o in objects]
    if kind == "attribute":
        options = []
        for i, o in enumerate(objects):
            if shapes.count(o.shape) == 1:
                options.append(("color_of_shape", i))
            if colors.count(o.color) == 1:
                options.append(("shape_of_color", i))
        if not options:
            return None
        template, i = options[rng.integers(len(options))]
        o = objects[i]
        if template == "color_of_shape":
            others = [c for c in colors if c != o.color] or [c for c in COLORS if c != o.color]
            return template, dict(shape=o.shape), o.color, str(rng.choice(others)), i, None
        others = [s for s in shapes if s != o.shape] or [s for s in SHAPES if s != o.shape]
        return template, dict(color=o.color), o.shape, str(rng.choice(others)), i, None
    if kind == "relation":
        margin = RELATION_MARGIN * image_size
        want = bool(rng.integers(2))
        options = []
        for i, a in enumerate(objects):
            for j, b in enumerate(objects):
                if i != j:
                    for rel in RELATIONS:
                        if _relation_holds(a, b, rel, margin) is want:
                            options.append((i, j, rel))
        if not options:
            return None
        i, j, rel = options[rng.integers(len(options))]
        a, b = objects[i], objects[j]
        fields = dict(color=a.color, shape=a.shape, relation=rel, color2=b.color, shape2=b.shape)
        ans = "yes" if want else "no"
        return "relation", fields, ans, "no" if want else "yes", i, j
    if kind == "count":
        template = ("count_all", "count_shape", "count_color")[rng.integers(3)]
        if template == "count_all":
            n, fields = len(objects), {}
        elif template == "count_shape":
            s = str(rng.choice(SHAPES))
            n, fields = shapes.count(s), dict(shapes=SHAPE_PLURALS[s])
        else:
            c = str(rng.choice(list(COLORS)))
            n, fields = colors.count(c), dict(color=c)
        foils = [k for k in (n - 1, n + 1) if 0 <= k < len(COUNT_WORDS)]
        return template, fields, COUNT_WORDS[n], COUNT_WORDS[int(rng.choice(foils))], None, None
    if kind == "exist":
        if rng.integers(2):
            i = int(rng.integers(len(objects)))
            o = objects[i]
            return "exist", dict(color=o.color, shape=o.shape), "yes", "no", i, None
        present = {(o.color, o.shape) for o in objects}
        # Hard negatives: an absent pair sharing the colour or the shape of a
        # present object, so neither word alone answers the question.
        near = [(c, s) for c in COLORS for s in SHAPES if (c, s) not in present and (c in colors or s in shapes)]
        c, s = near[rng.integers(len(near))]
        return "exist", dict(color=c, shape=s), "no", "yes", None, None
    raise ValueError(f"unknown question kind {kind!r}; expected one of {QUESTION_KINDS}")


def make_sample(
    split: str,
    index: int,
    *,
    kind: str | None = None,
    n_objects: int | None = None,
    image_size: int = IMAGE_SIZE,
) -> Sample:
    """Deterministic sample ``index`` of ``split``.

    Args:
        split: one of :data:`SPLIT_SEEDS`.
        index: sample number; (split, index) fixes everything drawn.
        kind: question kind; drawn uniformly from :data:`QUESTION_KINDS` if None.
        n_objects: 1-4; drawn uniformly if None (relation needs at least 2).
    """
    rng = np.random.default_rng([SPLIT_SEEDS[split], index])
    if kind is None:
        kind = QUESTION_KINDS[rng.integers(len(QUESTION_KINDS))]
    for _ in range(100):
        n = n_objects or int(rng.integers(2 if kind == "relation" else 1, MAX_OBJECTS + 1))
        image, objects = render_scene(rng, n, image_size)
        asked = _ask(rng, kind, objects, image_size)
        if asked is not None:
            break
    else:  # pragma: no cover
        raise RuntimeError(f"no {kind} question fits after 100 scenes")
    template, fields, answer, foil, target, reference = asked
    question = TEMPLATES[template]["text"].format(**fields)
    return Sample(image, objects, question, answer, foil, kind, template, target, reference, split, index)


def scene_vocabulary() -> dict[str, Any]:
    """The machine-readable vocabulary (written to scene_vocabulary.json)."""
    return {
        "schema_version": 1,
        "image_size": [IMAGE_SIZE, IMAGE_SIZE],
        "patch_grid": [GRID, GRID],
        "background": {
            "grey_level_range": list(BACKGROUND_RANGE),
            "per_channel_tint": BACKGROUND_TINT,
            "linear_gradient_max": 12,
            "gaussian_noise_sigma_range": list(NOISE_SIGMA_RANGE),
        },
        "colors": {k: list(v) for k, v in COLORS.items()},
        "color_jitter_per_channel": COLOR_JITTER,
        "shapes": list(SHAPES),
        "shape_plurals": SHAPE_PLURALS,
        "object_size_range": list(SIZE_RANGE),
        "object_size_means": "fraction of the image side: circle diameter, square side, equilateral triangle side",
        "max_rotation_deg": MAX_ROTATION_DEG,
        "objects_per_scene": [1, MAX_OBJECTS],
        "objects_distinct": "every object in a scene is a distinct (color, shape) pair; objects do not overlap",
        "relation_margin": RELATION_MARGIN,
        "relations": list(RELATIONS),
        "count_words": list(COUNT_WORDS),
        "answers": list(ANSWER_WORDS),
        "templates": {name: {**t, "placeholders": _placeholders(t["text"])} for name, t in TEMPLATES.items()},
    }


def _placeholders(text: str) -> list[str]:
    import string

    return [f for _, f, _, _ in string.Formatter().parse(text) if f]


def make_scene_questions(
    split: str,
    index: int,
    k: int,
    *,
    max_objects: int = MAX_OBJECTS,
    image_size: int = IMAGE_SIZE,
    kind_weights: dict[str, float] | None = None,
) -> tuple[np.ndarray, list[SceneObject], list[Sample]]:
    """One scene and ``k`` questions about it (used for training, where one
    image serves several questions). Kinds cycle through
    :data:`QUESTION_KINDS` from a random start, or are drawn with
    ``kind_weights`` when given."""
    rng = np.random.default_rng([SPLIT_SEEDS[split], 1_000_003, index])
    n = int(rng.integers(1, max_objects + 1))
    image, objects = render_scene(rng, n, image_size)
    start = int(rng.integers(len(QUESTION_KINDS)))
    if kind_weights is not None:
        p = np.array([kind_weights.get(kd, 0.0) for kd in QUESTION_KINDS], float)
        drawn = rng.choice(len(QUESTION_KINDS), size=k, p=p / p.sum())
    samples = []
    for q in range(k):
        kind = QUESTION_KINDS[(start + q) % len(QUESTION_KINDS) if kind_weights is None else drawn[q]]
        for attempt in range(4):  # avoid asking the same question twice
            asked = _ask(rng, kind, objects, image_size)
            if asked is None:  # e.g. a relation in a one-object scene
                asked = _ask(rng, ("count", "exist")[(q + attempt) % 2], objects, image_size)
            template, fields, answer, foil, target, reference = asked
            question = TEMPLATES[template]["text"].format(**fields)
            if question not in {s.question for s in samples}:
                break
        kind = TEMPLATES[template]["kind"]
        samples.append(Sample(image, objects, question, answer, foil, kind, template, target, reference, split, index))
    return image, objects, samples


def patch_labels(objects: list[SceneObject], image_size: int = IMAGE_SIZE, grid: int = GRID):
    """Dense per-patch targets for vision pre-training.

    Returns three ``(grid * grid,)`` int arrays in row-major patch order:
    colour class (0 = background, else 1 + palette index), shape class
    (0 = background, else 1 + shape index) of the object covering most of the
    patch (at least 1/16 of it, or the patch holding the object's centre), and
    a 0/1 flag for the patch holding an object's centre.
    """
    p = image_size // grid
    color = np.zeros(grid * grid, np.int64)
    shape = np.zeros(grid * grid, np.int64)
    centre = np.zeros(grid * grid, np.int64)
    best = np.full(grid * grid, p * p / 16.0)
    names = list(COLORS)
    for o in objects:
        per_patch = o.coverage[: grid * p, : grid * p].reshape(grid, p, grid, p).sum(axis=(1, 3)).reshape(-1)
        win = per_patch > best
        best = np.where(win, per_patch, best)
        color[win] = 1 + names.index(o.color)
        shape[win] = 1 + SHAPES.index(o.shape)
    for o in objects:
        c = int(min(o.center[1] // p, grid - 1)) * grid + int(min(o.center[0] // p, grid - 1))
        centre[c] = 1
        color[c] = 1 + names.index(o.color)
        shape[c] = 1 + SHAPES.index(o.shape)
    return color, shape, centre


# ---------------------------------------------------------------- counterfactual scenes


def _replay_scene(sample: Sample, override: tuple[int, str, str] | None):
    """Re-draw ``sample``'s scene from its (split, index) seed, with ``override``
    applied to the scene the sample was asked about. The way the sample was made
    (``make_sample`` with or without ``kind`` / ``n_objects``, or
    ``make_scene_questions``) is found by re-drawing the unedited scene and
    requiring it to equal ``sample.image`` bit for bit."""
    if sample.split not in SPLIT_SEEDS or sample.index < 0:
        raise ValueError("the sample was not drawn by make_sample or make_scene_questions (no split/index)")
    size = sample.image.shape[0]
    seed = SPLIT_SEEDS[sample.split]

    def by_make_sample(kind_arg, n_arg, edit):
        rng = np.random.default_rng([seed, sample.index])
        kind = kind_arg if kind_arg is not None else QUESTION_KINDS[rng.integers(len(QUESTION_KINDS))]
        if kind != sample.kind:
            return None
        for _ in range(100):
            n = n_arg or int(rng.integers(2 if kind == "relation" else 1, MAX_OBJECTS + 1))
            state = rng.bit_generator.state
            image, objects = render_scene(rng, n, size)
            if _ask(rng, kind, objects, size) is not None:
                if not np.array_equal(image, sample.image):
                    return None
                if edit is None:
                    return image, objects
                rng.bit_generator.state = state  # the same draws again, with the edit
                return render_scene(rng, n, size, edit)
        return None

    def by_scene_questions(max_objects, edit):
        rng = np.random.default_rng([seed, 1_000_003, sample.index])
        n = int(rng.integers(1, max_objects + 1))
        state = rng.bit_generator.state
        image, objects = render_scene(rng, n, size)
        if not np.array_equal(image, sample.image):
            return None
        if edit is None:
            return image, objects
        rng.bit_generator.state = state
        return render_scene(rng, n, size, edit)

    n_objects = len(sample.objects)
    tries = [lambda e, k=k, n=n: by_make_sample(k, n, e) for k in (None, sample.kind) for n in (None, n_objects)]
    tries += [lambda e, m=m: by_scene_questions(m, e) for m in range(MAX_OBJECTS, 0, -1)]
    for attempt in tries:
        if attempt(None) is not None:
            return attempt(override)
    raise ValueError(f"cannot re-draw sample {sample.split}/{sample.index}: no generator call reproduces its image")


def question_fields(template: str, question: str) -> dict[str, str]:
    """The values a question filled into its template's placeholders (``{"relation": "left of", ...}``)."""
    import re

    text = TEMPLATES[template]["text"]
    pattern = re.escape(text)
    for name in _placeholders(text):
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>.+?)")
    m = re.fullmatch(pattern, question)
    if m is None:
        raise ValueError(f"{question!r} does not match template {template!r}")
    return m.groupdict()


def _find_one(objects: list[SceneObject], **want) -> SceneObject:
    found = [o for o in objects if all(getattr(o, k) == v for k, v in want.items())]
    if len(found) != 1:
        raise ValueError(f"the edited scene has {len(found)} objects with {want}: the question no longer applies")
    return found[0]


def answer_question(template: str, question: str, objects: list[SceneObject], image_size: int = IMAGE_SIZE) -> str:
    """The ground-truth answer of ``question`` (made from ``template``) for
    ``objects``; ValueError when the question no longer applies (the object it
    names is missing or not unique, a relation too close to call)."""
    f = question_fields(template, question)
    if template == "color_of_shape":
        return _find_one(objects, shape=f["shape"]).color
    if template == "shape_of_color":
        return _find_one(objects, color=f["color"]).shape
    if template == "count_all":
        return COUNT_WORDS[len(objects)]
    if template == "count_shape":
        shape = {v: k for k, v in SHAPE_PLURALS.items()}[f["shapes"]]
        return COUNT_WORDS[sum(o.shape == shape for o in objects)]
    if template == "count_color":
        return COUNT_WORDS[sum(o.color == f["color"] for o in objects)]
    if template == "exist":
        return "yes" if any(o.color == f["color"] and o.shape == f["shape"] for o in objects) else "no"
    if template == "relation":
        a = _find_one(objects, color=f["color"], shape=f["shape"])
        b = _find_one(objects, color=f["color2"], shape=f["shape2"])
        holds = _relation_holds(a, b, f["relation"], RELATION_MARGIN * image_size)
        if holds is None:
            raise ValueError("the relation is too close to call")
        return "yes" if holds else "no"
    raise ValueError(f"unknown template {template!r}")


def counterfactual_sample(
    sample: Sample, obj: int | None = None, *, color: str | None = None, shape: str | None = None
) -> Sample:
    """``sample`` re-rendered with one object's colour (and/or shape) changed
    and everything else identical: the same positions, sizes, rotations,
    background, colour jitter and noise (the scene is re-drawn from the
    sample's seed with the same random draws; only the edited object's base
    colour, or its outline, differs). Pairs of this kind are what visual-feature
    patching and region counterfactuals need.

    Args:
        sample: made by :func:`make_sample` or :func:`make_scene_questions`.
        obj: index into ``sample.objects`` (default: the sample's target).
        color, shape: the new colour / shape; at least one, and different from the object's.

    Returns:
        A :class:`Sample` with the same question, ``answer`` recomputed on the
        edited scene and ``foil`` the original answer when the answer changed
        (else the original foil). Raises ValueError when the edit breaks the
        scene's rules (two objects with the same colour and shape, a new outline
        that touches another object or leaves the image) or the question no
        longer applies to the edited scene.
    """
    obj = sample.target if obj is None else obj
    if obj is None or not 0 <= obj < len(sample.objects):
        raise ValueError("name the object to edit (the sample has no target object)")
    old = sample.objects[obj]
    new_color, new_shape = color or old.color, shape or old.shape
    if new_color not in COLORS or new_shape not in SHAPES:
        raise ValueError(f"unknown colour or shape: {new_color!r}, {new_shape!r}")
    if (new_color, new_shape) == (old.color, old.shape):
        raise ValueError("the edit changes nothing: give a different colour or shape")
    if any((o.color, o.shape) == (new_color, new_shape) for i, o in enumerate(sample.objects) if i != obj):
        raise ValueError(f"the scene already holds a {new_color} {new_shape}: objects must stay distinct")
    image, objects = _replay_scene(sample, (obj, new_color, new_shape))
    size = image.shape[0]
    edited = objects[obj]
    if new_shape != old.shape:
        r = circumradius(new_shape, edited.size)
        cx, cy = edited.center
        if cx - r < 0 or cy - r < 0 or cx + r > size or cy + r > size:
            raise ValueError(f"a {new_shape} of this size leaves the image at this position")
        if any((edited.mask & o.mask).any() for i, o in enumerate(objects) if i != obj):
            raise ValueError(f"a {new_shape} of this size touches another object at this position")
    answer = answer_question(sample.template, sample.question, objects, size)
    foil = sample.answer if answer != sample.answer else sample.foil
    return Sample(
        image,
        objects,
        sample.question,
        answer,
        foil,
        sample.kind,
        sample.template,
        sample.target,
        sample.reference,
        sample.split,
        sample.index,
    )
