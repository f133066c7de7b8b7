"""Regions of a counterfactual: an ``(H, W)`` bool mask on the ORIGINAL image
(``True`` = in the region), checked against the image's size and built from a
box, a polygon, a PNG (white = region), boxes, or a synthetic scene's object.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from core.errors import ReadoutError
from core.files.images import load_mask


class RegionError(ReadoutError):
    """A region or a fill that cannot be used (wrong size, empty, unknown fill)."""


# ---------------------------------------------------------------- regions


def _size_of(image) -> tuple[int, int]:
    """``(width, height)`` of a PIL image, an ``(H, W[, 3])`` array or a size tuple."""
    if isinstance(image, Image.Image):
        return image.size
    if isinstance(image, np.ndarray):
        return int(image.shape[1]), int(image.shape[0])
    w, h = image
    return int(w), int(h)


def check_mask(mask, image_size: tuple[int, int], *, allow_empty: bool = False) -> np.ndarray:
    """``mask`` as an ``(H, W)`` bool array matching ``image_size = (width, height)``.

    Raises:
        RegionError: wrong shape, or no pixel in the region (unless ``allow_empty``).
    """
    m = np.asarray(mask)
    w, h = image_size
    if m.ndim != 2 or m.shape != (h, w):
        raise RegionError(f"the mask is {_shape_text(m)} but the image is {w}x{h} (width x height); they must match")
    m = m.astype(bool)
    if not allow_empty and not m.any():
        raise RegionError("the mask selects no pixel")
    return m


def _shape_text(m: np.ndarray) -> str:
    return f"{m.shape[1]}x{m.shape[0]}" if m.ndim == 2 else f"an array of shape {tuple(m.shape)}"


def mask_from_box(image_size: tuple[int, int], box: Sequence[float]) -> np.ndarray:
    """``(H, W)`` bool: the pixels whose centre lies in ``box = [x0, y0, x1, y1]``
    (end-exclusive pixel coordinates of the original image; clipped to it)."""
    w, h = image_size
    x0, y0, x1, y1 = (float(v) for v in box)
    xs = np.arange(w) + 0.5
    ys = np.arange(h) + 0.5
    return ((ys >= y0) & (ys < y1))[:, None] & ((xs >= x0) & (xs < x1))[None, :]


def mask_from_polygon(image_size: tuple[int, int], points: Sequence[Sequence[float]]) -> np.ndarray:
    """``(H, W)`` bool: the polygon ``[(x, y), ...]`` (original-image pixels)
    filled as PIL draws it (outline included)."""
    from PIL import ImageDraw

    if len(points) < 3:
        raise RegionError(f"a polygon needs at least 3 points, got {len(points)}")
    canvas = Image.new("L", tuple(image_size), 0)
    ImageDraw.Draw(canvas).polygon([(float(x), float(y)) for x, y in points], fill=255, outline=255)
    return np.asarray(canvas) > 0


def mask_from_png(path: str | Path, image_size: tuple[int, int]) -> np.ndarray:
    """Read a painted mask: white (luminance >= 128) is the region; a mask
    with an alpha channel also needs alpha >= 128. It must have the image's size.

    Raises:
        RegionError: the size differs from ``image_size`` or the mask is empty.
        ImageLoadError: the file is not an image.
    """

    p = Path(path)
    mask = load_mask(p)
    size = (mask.shape[1], mask.shape[0])
    if tuple(size) != tuple(image_size):
        raise RegionError(
            f"{p}: the mask is {size[0]}x{size[1]} but the image is {image_size[0]}x{image_size[1]}; they must match"
        )
    return check_mask(mask, image_size)


def mask_from_scene_object(sample, index: int) -> np.ndarray:
    """The ground-truth ``(H, W)`` bool mask of object ``index`` of a synthetic
    scene (:class:`core.zoo.scenes.Sample`): every pixel its ink touches."""
    return np.array(sample.objects[index].mask, dtype=bool, copy=True)


def mask_from_boxes(image_size: tuple[int, int], boxes: Sequence[Sequence[float]]) -> np.ndarray:
    """Union of :func:`mask_from_box` over ``boxes``."""
    w, h = image_size
    out = np.zeros((h, w), dtype=bool)
    for b in boxes:
        out |= mask_from_box(image_size, b)
    return out
