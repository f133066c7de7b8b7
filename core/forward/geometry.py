"""Visual token  <->  image patch  <->  pixel box in the ORIGINAL image.

A processor resizes, crops or pads the image before the vision tower cuts it
into patches. :class:`VisualToken` undoes that: its ``box`` is in the pixel
coordinates of the image the user opened, so a heatmap or a region mask
lines up with what the user sees.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VisualToken:
    """One visual token.

    Attributes:
        index: 0-based ordinal among the visual tokens.
        position: sequence position (None for cross-attention keys).
        image: which image (or tile) it comes from.
        row, col: patch row and column in that image's grid.
        box: ``[x0, y0, x1, y1]`` in original-image pixels (floats; may reach
            past the image edge when the processor padded); None in a stored
            JSON of a token that covers no patch (a resampler's latent).
    """

    index: int
    position: int | None
    image: int
    row: int
    col: int
    box: list[float] | None

    def to_dict(self) -> dict:
        # explicit rather than dataclasses.asdict, whose deep copy costs ~0.1 ms a token (576+ per run)
        return {
            "index": self.index,
            "position": self.position,
            "image": self.image,
            "row": self.row,
            "col": self.col,
            "box": list(self.box) if self.box is not None else None,
        }

    @classmethod
    def from_dict(cls, d: dict) -> VisualToken:
        """The token a :meth:`to_dict` (an analyze JSON's ``input.visual_tokens`` entry) describes."""
        return cls(d["index"], d["position"], d["image"], d["row"], d["col"], d["box"])


def stretched_grid_tokens(
    image_size: tuple[int, int],
    resized: tuple[int, int],
    grid: tuple[int, int],
    cell: float,
    positions: list[int] | None = None,
) -> list[VisualToken]:
    """The tokens of a processor that stretches the whole image to ``resized =
    (width, height)`` px (no crop, no pad) and gives one token per ``cell x cell``
    px block of it (a patch, or a merged / pooled block of patches), row-major
    over ``grid = (rows, cols)``; boxes scaled back by original / resized size.

    Raises:
        ValueError: ``positions`` given and not one per token.
    """
    rows, cols = grid
    if positions is not None and len(positions) != rows * cols:
        raise ValueError(f"{len(positions)} visual positions for a {rows}x{cols} token grid")
    sx, sy = image_size[0] / resized[0], image_size[1] / resized[1]
    out = []
    for i in range(rows * cols):
        r, c = divmod(i, cols)
        box = [c * cell * sx, r * cell * sy, (c + 1) * cell * sx, (r + 1) * cell * sy]
        out.append(VisualToken(i, None if positions is None else int(positions[i]), 0, r, c, box))
    return out


def resize_crop_boxes(
    image_size: tuple[int, int], shortest_edge: int, crop: tuple[int, int], patch: int
) -> list[tuple[int, int, list[float]]]:
    """Patch boxes for a CLIP-style processor: resize the short side to
    ``shortest_edge`` (aspect kept), centre-crop ``crop = (height, width)``,
    cut ``patch`` px squares. Returns ``(row, col, box)`` in row-major order.

    Args:
        image_size: the original ``(width, height)``.
    """
    w, h = image_size
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(shortest_edge * long / short)
    new_w, new_h = (shortest_edge, new_long) if w <= h else (new_long, shortest_edge)
    sx, sy = w / new_w, h / new_h
    crop_h, crop_w = crop
    # torchvision's centre crop rounds the offset (transformers' fast processors use it).
    top = int(round((new_h - crop_h) / 2.0))
    left = int(round((new_w - crop_w) / 2.0))
    out = []
    for r in range(crop_h // patch):
        for c in range(crop_w // patch):
            x0, y0 = left + c * patch, top + r * patch
            out.append((r, c, [x0 * sx, y0 * sy, (x0 + patch) * sx, (y0 + patch) * sy]))
    return out


def region_tokens(tokens: list[VisualToken], mask, min_cover: float = 0.25) -> list[int]:
    """Indices (into ``tokens``) of the visual tokens whose box is covered by
    ``mask`` ``(H, W)`` bool (original-image pixels) for at least ``min_cover``
    of its in-image area; tokens without a patch (``col < 0``: newline, CLS) never count."""
    import numpy as np

    mask = np.asarray(mask, dtype=bool)
    h, w = mask.shape
    out = []
    for i, t in enumerate(tokens):
        if t.col < 0:  # no patch of its own (newline, CLS)
            continue
        x0, y0, x1, y1 = t.box
        xa, ya = max(0, int(np.floor(x0))), max(0, int(np.floor(y0)))
        xb, yb = min(w, int(np.ceil(x1))), min(h, int(np.ceil(y1)))
        if xb <= xa or yb <= ya:
            continue
        if mask[ya:yb, xa:xb].mean() >= min_cover:
            out.append(i)
    return out


def painted_tokens(tokens: list[VisualToken], mask) -> list[int]:
    """The visual tokens a painted ``mask`` ``(H, W)`` touches at all (any covered pixel):
    the token set of an ablation or a patch at the painted region, where a token the user
    painted over only in part still counts."""
    return region_tokens(tokens, mask, min_cover=1e-6)
