"""The views of the image: which visual tokens see it once, on what grid, over which pixels.

A tiled or multi-view family feeds the model the image several times: LLaVA-NeXT
a base image and a high-resolution grid, Idefics3 / SmolVLM tiles and a global
image, Mllama tiles. A :class:`core.forward.geometry.VisualToken`'s ``image`` says which
view it belongs to and its ``box`` is in original-image pixels, so each view's
grid and the region of the image it actually covers follow from the boxes the
family computes; nothing here knows a family. A family whose views need names
the geometry cannot give (LLaVA-NeXT's base and high-resolution views both span
the image) has a ``view_names(image_size)`` method (:func:`family_view_names`).

Tokens here are anything with ``image``, ``row``, ``col`` and ``box`` attributes
(``VisualToken``, ``app.canvas.CanvasToken``); tokens without a patch
(``col < 0``: newline, CLS, a padding tile's keys) belong to no view.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Box = tuple[float, float, float, float]
# Geometry from scaled float boxes: edges that agree to this share of the image's size are the same edge.
EDGE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class ImageView:
    """One view of the image.

    Attributes:
        image: the ``image`` value of its tokens.
        name: e.g. ``"image"``, ``"base"``, ``"tile 1 (row 0, col 1)"``, ``"global"``, ``"image 2"``.
        items: positions in the token list of its patch tokens, in token order.
        grid: ``(rows, cols)`` of its patch grid.
        extent: ``(x0, y0, x1, y1)`` bounds of its boxes in original-image pixels
            (past the image edge where the processor padded).
        region: ``extent`` clipped to the image: the pixels the view covers
            (narrower than the image for LLaVA-1.5's centre crop).
        cell_area: the mean area of its boxes in original-image pixels (the
            smaller, the finer the view).
    """

    image: int
    name: str
    items: tuple[int, ...]
    grid: tuple[int, int]
    extent: Box
    region: Box
    cell_area: float

    @property
    def title(self) -> str:
        """``name`` and grid, as a selector lists it: ``"base: 24x24"``."""
        return f"{self.name}: {self.grid[0]}x{self.grid[1]}"

    def to_dict(self) -> dict:
        return {
            "image": self.image,
            "name": self.name,
            "items": list(self.items),
            "grid": list(self.grid),
            "extent": list(self.extent),
            "region": list(self.region),
        }


def image_views(
    tokens: Sequence, image_size: tuple[int, int] | None = None, names: Mapping[int, str] | None = None
) -> list[ImageView]:
    """The views of ``tokens`` (one run's visual tokens), sorted by ``image``.

    Args:
        image_size: the original ``(width, height)``; regions are clipped to it
            (None: not clipped).
        names: ``{image: name}`` from the family (:func:`family_view_names`);
            views it does not name get :func:`geometric_names`.
    """
    by_image: dict[int, list[int]] = {}
    for i, t in enumerate(tokens):
        if t.col >= 0:
            by_image.setdefault(int(t.image), []).append(i)
    views = []
    for im, items in sorted(by_image.items()):
        boxes = np.array([[float(v) for v in tokens[i].box] for i in items]).reshape(-1, 4)
        extent = (boxes[:, 0].min(), boxes[:, 1].min(), boxes[:, 2].max(), boxes[:, 3].max())
        region = extent if image_size is None else _clip(extent, image_size)
        area = float(np.mean((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])))
        grid = (max(tokens[i].row for i in items) + 1, max(tokens[i].col for i in items) + 1)
        views.append(ImageView(im, "", tuple(items), grid, tuple(map(float, extent)), tuple(map(float, region)), area))
    default = geometric_names(views, image_size)
    given = dict(names or {})
    return [_named(v, given.get(v.image) or default[v.image]) for v in views]


def geometric_names(views: Sequence[ImageView], image_size: tuple[int, int] | None = None) -> dict[int, str]:
    """``{image: name}`` from the regions alone: one view is ``"image"``; two or
    more views that each cover part of the image and do not overlap are tiles,
    ``"tile k (row r, col c)"`` numbered row-major by where they lie, and a single
    view over the whole image beside them is ``"global"``; anything else is ``"image k"``."""
    if len(views) == 1:
        return {views[0].image: "image"}
    if image_size is not None:
        whole: Box = (0.0, 0.0, float(image_size[0]), float(image_size[1]))
    else:
        whole = _bounds([v.region for v in views])
    tol = EDGE_TOLERANCE * max(whole[2] - whole[0], whole[3] - whole[1], 1.0)
    partial = [v for v in views if not _covers(v.region, whole, tol)]
    names = {v.image: f"image {v.image}" for v in views}
    if len(partial) < 2 or not disjoint([v.region for v in partial], tol):
        return names
    rows = _ranks([v.region[1] for v in partial], tol)
    cols = _ranks([v.region[0] for v in partial], tol)
    order = sorted(range(len(partial)), key=lambda k: (rows[k], cols[k]))
    for n, k in enumerate(order):
        names[partial[k].image] = f"tile {n} (row {rows[k]}, col {cols[k]})"
    others = [v for v in views if v not in partial]
    if len(others) == 1:
        names[others[0].image] = "global"
    return names


def family_view_names(adapter, image_size: tuple[int, int]) -> dict[int, str]:
    """``{image: name}`` from the family's ``view_names(image_size)`` where it has
    one (``{}`` otherwise: the geometry names the views)."""
    method = getattr(adapter, "view_names", None)
    return dict(method(tuple(image_size))) if callable(method) else {}


def overlay_order(views: Sequence[ImageView]) -> list[ImageView]:
    """The views finest first (smallest mean box, then lowest ``image``): laid
    out on the image together, each pixel shows the first view that covers it."""
    return sorted(views, key=lambda v: (v.cell_area, v.image))


def covered_area(regions: Sequence[Box]) -> float:
    """The area of the union of axis-aligned boxes (exact: the boxes' edges cut
    the plane into cells, each counted once if any box holds it)."""
    if not regions:
        return 0.0
    b = np.asarray(regions, dtype=np.float64).reshape(-1, 4)
    xs, ys = np.unique(b[:, [0, 2]]), np.unique(b[:, [1, 3]])
    cx, cy = (xs[:-1] + xs[1:]) / 2, (ys[:-1] + ys[1:]) / 2
    inside = np.zeros((len(cy), len(cx)), dtype=bool)
    for x0, y0, x1, y1 in b:
        inside |= ((cy >= y0) & (cy < y1))[:, None] & ((cx >= x0) & (cx < x1))[None, :]
    return float((np.diff(ys)[:, None] * np.diff(xs)[None, :] * inside).sum())


def disjoint(regions: Sequence[Box], tol: float = 0.0) -> bool:
    """No two boxes overlap by more than ``tol`` pixels on both axes (touching edges do not count)."""
    for i, a in enumerate(regions):
        for b in regions[i + 1 :]:
            if min(a[2], b[2]) - max(a[0], b[0]) > tol and min(a[3], b[3]) - max(a[1], b[1]) > tol:
                return False
    return True


def patch_values(tokens: Sequence, grid, by_image: Sequence[Mapping] | None = None) -> np.ndarray:
    """``(n_tokens,)`` float values of a read-out's patch grids, one per token.

    Args:
        grid: the section's ``visual_patch_mass`` ``(rows, cols)``: the primary
            image's grid (see ``core.methods.patterns.patch_grids``).
        by_image: its ``visual_patch_mass_by_image`` (``[{"image", "grid"}]``,
            every image's grid; present when the model sees several views).

    Tokens without a patch, and tokens of views that have no grid, are NaN
    (without ``by_image`` only the primary image's tokens get values).
    """
    from core.methods.patterns import primary_image  # function-local: torch is heavy for a geometry module

    out = np.full(len(tokens), np.nan)
    if not any(t.col >= 0 for t in tokens):
        return out
    if by_image:
        grids = {int(g["image"]): np.asarray(g["grid"], dtype=np.float64) for g in by_image}
    else:
        grids = {primary_image(tokens): np.asarray(grid, dtype=np.float64)}
    for i, t in enumerate(tokens):
        g = grids.get(int(t.image))
        if t.col >= 0 and g is not None and g.ndim == 2 and t.row < g.shape[0] and t.col < g.shape[1]:
            out[i] = g[t.row, t.col]
    return out


def _named(view: ImageView, name: str) -> ImageView:
    return ImageView(view.image, name, view.items, view.grid, view.extent, view.region, view.cell_area)


def _clip(box: Box, image_size: tuple[int, int]) -> Box:
    w, h = float(image_size[0]), float(image_size[1])
    x0, y0 = min(max(box[0], 0.0), w), min(max(box[1], 0.0), h)
    return (x0, y0, max(x0, min(box[2], w)), max(y0, min(box[3], h)))


def _bounds(boxes: Sequence[Box]) -> Box:
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    return (float(b[:, 0].min()), float(b[:, 1].min()), float(b[:, 2].max()), float(b[:, 3].max()))


def _covers(region: Box, whole: Box, tol: float) -> bool:
    return (
        region[0] <= whole[0] + tol
        and region[1] <= whole[1] + tol
        and region[2] >= whole[2] - tol
        and region[3] >= whole[3] - tol
    )


def _ranks(values: Sequence[float], tol: float) -> list[int]:
    """Each value's rank among the distinct values (values within ``tol`` are one)."""
    distinct: list[float] = []
    for v in sorted(values):
        if not distinct or v - distinct[-1] > tol:
            distinct.append(v)
    return [next(k for k, d in enumerate(distinct) if abs(v - d) <= tol) for v in values]
