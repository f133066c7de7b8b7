"""LLaVA-NeXT / LLaVA-1.6 (transformers' ``LlavaNextForConditionalGeneration``):
LLaVA's CLIP tower, projector and Llama-style decoder, fed "any-resolution"
images.

How the processor and the model turn one image into visual tokens:

1. The processor picks the best grid resolution ``(best_h, best_w)`` among
   ``image_grid_pinpoints`` (``select_best_resolution``), resizes the image
   into it keeping the aspect ratio (``get_patch_output_size``), pads it
   centred with zeros, and cuts the canvas into ``tile x tile`` tiles
   (``tile`` = the vision tower's ``image_size``), row-major. In front of the
   tiles it puts the *base* image: the whole image squashed (aspect NOT kept)
   to ``tile x tile``. ``pixel_values[b]`` is ``(1 + n_tiles, C, tile, tile)``.
2. The tower turns every tile and the base image into a ``g x g`` grid of
   patch features (``g = image_size // patch_size``, CLS dropped).
3. ``pack_image_features``: the tile grids are laid side by side into one
   ``(tile_rows * g, tile_cols * g)`` feature map of the padded canvas;
   ``unpad_image`` drops the feature rows (or columns) that the padding
   produced (computed on the feature grid, so a partly padded row may stay or
   go); an ``image_newline`` embedding is appended at the end of every
   remaining row; the base image's ``g * g`` features come first.

So the image's ``<image>`` tokens are, in sequence order::

    g*g base tokens (row-major) | for each unpadded row: cols patch tokens, 1 newline

The processor inserts exactly that many ``<image>`` tokens (it depends on the
image size, so a batch of differently sized images has ragged visual
positions).

Conventions of this adapter (see :meth:`LlavaNextAdapter.visual_tokens`):

* :meth:`visual_positions` returns every ``<image>`` token position (what the
  model fills with image features), newline tokens included.
* :class:`AnyResVisualToken` ``image`` is 0 for the base image and 1 for the
  high-resolution (tiled, unpadded) view; ``row``/``col`` index that view's
  grid (base: ``g x g``; high-res: the unpadded feature map, ``rows x cols``),
  ``tile`` is the index in ``pixel_values`` (0 base, 1.. tiles row-major).
* Newline tokens carry no patch: ``col = -1``, ``tile = None`` and a
  zero-width box on the right edge of their row (on a whole pixel);
  :meth:`token_roles` labels them "visual_delimiter" and
  :meth:`visual_delimiter_positions` lists them. Per-patch heatmaps must skip
  ``col < 0`` tokens and lay out image 0 and image 1 as two grids.
* Pixels in a partly covered edge row/column that unpad_image drops are seen
  by the base image only: no high-res token's box holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from core.errors import ModelLoadError, QuestionError
from core.forward.geometry import VisualToken
from core.models.adapter import ModelInputs, config_int, size_value
from core.models.families.llava import LlavaAdapter


@dataclass
class AnyResVisualToken(VisualToken):
    """A :class:`core.forward.geometry.VisualToken` with the tile it was read from.

    Attributes:
        tile: index into the image's ``pixel_values`` (0: the base image,
            1..: the tiles of the padded canvas, row-major); None for a
            newline token (no patch).
    """

    tile: int | None = None


@dataclass
class AnyResLayout:
    """Where an image of ``image_size = (width, height)`` goes, in pixels and tokens.

    Attributes:
        tile: tile side in pixels (the vision tower's ``image_size``).
        patch: the tower's patch side in pixels; ``grid = tile // patch``.
        best: ``(height, width)`` the chosen pinpoint resolution (the canvas).
        resized: ``(height, width)`` of the image inside the canvas.
        pad: ``(top, left)`` zero padding in front of it.
            (``best``, ``resized``, ``pad``: None for a token-only layout.)
        tiles: ``(tile_rows, tile_cols)``.
        keep: ``(row0, col0)`` first full-grid row/column kept by unpad_image.
        rows, cols: the unpadded high-res feature map (newlines not counted).
    """

    image_size: tuple[int, int]
    tile: int
    patch: int
    grid: int
    best: tuple[int, int] | None
    resized: tuple[int, int] | None
    pad: tuple[int, int] | None
    tiles: tuple[int, int]
    keep: tuple[int, int]
    rows: int
    cols: int

    @property
    def n_base(self) -> int:
        return self.grid * self.grid

    @property
    def n_tokens(self) -> int:
        """All ``<image>`` tokens: base, high-res patches and one newline per row."""
        return self.n_base + self.rows * (self.cols + 1)

    def newline_indices(self) -> list[int]:
        """Ordinals (among the image's tokens) of the newline tokens."""
        return [self.n_base + (r + 1) * (self.cols + 1) - 1 for r in range(self.rows)]

    def canvas_to_original(self, x: float, y: float) -> tuple[float, float]:
        """A canvas pixel coordinate in original-image pixels (undo pad, then resize)."""
        w, h = self.image_size
        (rh, rw), (top, left) = self.resized, self.pad
        return (x - left) * w / rw, (y - top) * h / rh


class LlavaNextAdapter(LlavaAdapter):
    """The canonical view of a LLaVA-NeXT model (see the module docstring).

    Same decoder, weights, norms, hooks and RoPE as :class:`LlavaAdapter`;
    what differs is the image: the number of visual tokens follows the image
    size, newline tokens sit among them, and the geometry undoes the
    any-resolution tiling.
    """

    # The projector runs per tile, before unpadding and the newlines: a visual token is
    # no row of its input or output, so those sites are refused, not offered.
    declaration = replace(
        LlavaAdapter.declaration,
        name="llava_next",
        architectures=("LlavaNextForConditionalGeneration",),
        visual_sites=False,
        no_visual_sites="the projector runs per tile, before unpadding and the row newlines (a visual token "
        "is no row of its input or output); patch 'resid' at block 0 (the visual positions)",
    )

    # ---- any-resolution geometry
    def _model_grid(self) -> tuple[int, int, list]:
        """``(tile, patch, pinpoints)`` as the model packs features (its config)."""
        vision = self.model.config.vision_config
        pinpoints = [list(map(int, p)) for p in self.model.config.image_grid_pinpoints]
        return int(vision.image_size), int(vision.patch_size), pinpoints

    def _check_processor(self) -> None:
        """Check that the processor and the model agree and that the processor
        does nothing the pixel geometry does not undo."""
        ip = self.processor.image_processor
        tile, _, pinpoints = self._model_grid()
        if [list(map(int, p)) for p in ip.image_grid_pinpoints] != pinpoints:
            raise ValueError(
                f"processor image_grid_pinpoints {ip.image_grid_pinpoints} differ from the model's {pinpoints}"
            )
        size, crop = ip.size, getattr(ip, "crop_size", None)
        h, w, short = size_value(size, "height"), size_value(size, "width"), size_value(size, "shortest_edge")
        base = (h, w) if h and w else (short, short)
        tile_px = size_value(crop, "height") or h or short
        crop_hw = (size_value(crop, "height"), size_value(crop, "width"))
        # The base image and every tile must leave the processor as they were cut:
        # tile x tile, untouched by the second resize and the centre crop.
        supported = (
            base == (tile, tile)
            and tile_px == tile
            and (not getattr(ip, "do_center_crop", False) or crop_hw == (tile, tile))
            and all(p[0] % tile == 0 and p[1] % tile == 0 for p in pinpoints)
        )
        if not supported:
            raise NotImplementedError(
                "LLaVA-NeXT geometry is mapped for processors whose size, crop size and grid pinpoints are "
                f"the vision tower's image size {tile} (or multiples of it): size {size}, crop {crop}, "
                f"pinpoints {pinpoints}"
            )

    def anyres_layout(self, image_size: tuple[int, int], pixels: bool = True) -> AnyResLayout:
        """The :class:`AnyResLayout` of an image of ``image_size = (width, height)``,
        computed with transformers' own helpers (select_best_resolution,
        get_patch_output_size, get_anyres_image_grid_shape, unpad_image).

        Args:
            pixels: also compute the processor's canvas (``best``, ``resized``,
                ``pad``; checked with the processor). ``False``: the token
                layout only, from the model's config (``best``, ``resized``
                and ``pad`` are None), which is all the newline positions need.
        """
        from transformers.image_processing_utils import get_patch_output_size, select_best_resolution
        from transformers.image_utils import ChannelDimension
        from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

        tile, patch, pinpoints = self._model_grid()
        grid = tile // patch
        w, h = int(image_size[0]), int(image_size[1])
        best = resized = pad = None
        if pixels:
            self._check_processor()
            best = tuple(select_best_resolution((h, w), pinpoints))
            dummy = np.broadcast_to(np.uint8(0), (1, h, w))  # only its shape is read
            resized = tuple(get_patch_output_size(dummy, best, ChannelDimension.FIRST))
            # the processor pads centred, the odd pixel after (its _get_padding_size)
            pad = ((best[0] - resized[0]) // 2, (best[1] - resized[1]) // 2)
        tiles = tuple(get_anyres_image_grid_shape([h, w], pinpoints, tile))  # what the model uses
        n_r, n_c = tiles[0] * grid, tiles[1] * grid
        # the model unpads on the feature grid: run its unpad_image on the grid's indices
        kept = unpad_image(torch.arange(n_r * n_c).view(1, n_r, n_c), [h, w])
        first = int(kept[0, 0, 0])
        return AnyResLayout(
            (w, h), tile, patch, grid, best, resized, pad, tiles, divmod(first, n_c), kept.shape[1], kept.shape[2]
        )

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """The :class:`AnyResVisualToken` of every ``<image>`` token, in sequence
        order, boxes in original-image pixels (``image_size = (width, height)``).

        * Base tokens (``image = 0``, ``tile = 0``): the image was squashed to
          ``tile x tile``; patch ``(row, col)`` covers ``[col * patch * W / tile,
          row * patch * H / tile, ...]``.
        * High-res tokens (``image = 1``, ``tile`` 1..): ``(row, col)`` on the
          unpadded map; the full-grid index ``(row + row0, col + col0)`` gives
          the tile and the patch inside it, hence a canvas box, which the pad
          offset and the resize scale take back to the original image. Boxes of
          rows or columns that unpad_image kept although partly padded reach
          past the image edge.
        * Newline tokens (``image = 1``, ``col = -1``, ``tile = None``): no
          patch; a zero-width box ``[x, y0, x, y1]`` at the right edge of their
          row (``x`` rounded to a whole pixel, so no pixel mask covers it).

        Args:
            positions: the sequence positions of the tokens (every ``<image>``
                token, as :meth:`visual_positions` returns them), or None.
        """
        lay = self.anyres_layout(image_size)
        if positions is not None and len(positions) != lay.n_tokens:
            raise ValueError(f"{len(positions)} visual positions for an image that makes {lay.n_tokens} tokens")
        w, h = lay.image_size
        sx, sy = w / lay.tile, h / lay.tile
        boxes: list[tuple[int, int, int, int | None, list[float]]] = []  # (image, row, col, tile, box)
        p = lay.patch
        for r in range(lay.grid):
            for c in range(lay.grid):
                boxes.append((0, r, c, 0, [c * p * sx, r * p * sy, (c + 1) * p * sx, (r + 1) * p * sy]))
        r0, c0 = lay.keep
        for r in range(lay.rows):
            for c in range(lay.cols):
                fr, fc = r + r0, c + c0  # full-grid row and column
                (tr, ir), (tc, ic) = divmod(fr, lay.grid), divmod(fc, lay.grid)
                x0, y0 = tc * lay.tile + ic * p, tr * lay.tile + ir * p  # canvas pixels
                ox0, oy0 = lay.canvas_to_original(x0, y0)
                ox1, oy1 = lay.canvas_to_original(x0 + p, y0 + p)
                boxes.append((1, r, c, 1 + tr * lay.tiles[1] + tc, [ox0, oy0, ox1, oy1]))
            # no patch: zero width, on a whole pixel so that no pixel mask covers it
            _, y0, x1, y1 = boxes[-1][4]
            edge = float(round(x1))
            boxes.append((1, r, -1, None, [edge, y0, edge, y1]))
        return [
            AnyResVisualToken(i, None if positions is None else int(positions[i]), image, r, c, box, tile)
            for i, (image, r, c, tile, box) in enumerate(boxes)
        ]

    def view_names(self, image_size: tuple[int, int]) -> dict[int, str]:
        """``{image: name}`` of the two views (see :mod:`core.views`): both span the
        image, so only the family can tell the base image from the tiled one."""
        rows, cols = self.anyres_layout(image_size, pixels=False).tiles
        return {0: "base", 1: f"high-res ({rows}x{cols} tiles)"}

    # ---- text
    def resized_pixels(self, image_size: tuple[int, int]) -> tuple[int, str] | None:
        """The larger of the base view's resize and the high-resolution canvas:
        the image is resized into the best of ``image_grid_pinpoints``."""
        from transformers.image_processing_utils import select_best_resolution

        _, _, pinpoints = self._model_grid()
        best = select_best_resolution((int(image_size[1]), int(image_size[0])), pinpoints)
        grid = (int(best[0]) * int(best[1]), f"image_grid_pinpoints {list(best)}")
        base = super().resized_pixels(image_size)
        return max(grid, base) if base is not None else grid

    @classmethod
    def check_config(cls, config) -> None:
        """Also the fields the any-resolution layout reads: ``image_grid_pinpoints``
        (``[height, width]`` pairs of positive integers) and the tower's sizes."""
        super().check_config(config)
        pinpoints = getattr(config, "image_grid_pinpoints", None)
        ok = isinstance(pinpoints, (list, tuple)) and len(pinpoints) > 0
        for p in pinpoints if ok else ():
            ok = ok and isinstance(p, (list, tuple)) and len(p) == 2
            ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in p)
        if not ok:
            raise ModelLoadError(
                f"config.json image_grid_pinpoints: expected a list of [height, width] pairs of positive "
                f"integers, got {pinpoints!r}"[:300]
            )
        for field in ("vision_config.image_size", "vision_config.patch_size"):
            config_int(config, field, minimum=1, required=True)

    def check_fits(self, question: str, ids: list[int]) -> None:
        """QuestionError for a prompt that cannot fit even with the fewest visual
        tokens (the base image's); the real total, which follows the image
        size, is checked by :meth:`prepare`."""
        tile, patch, _ = self._model_grid()
        # the prompt's one <image> placeholder becomes at least the base image's tokens
        total = len(self.tokenizer.encode(self.prompt(question))) - 1 + (tile // patch) ** 2
        if total > self.max_positions():
            raise QuestionError(
                f"the question is too long: at least {total} tokens with the image, "
                f"the model takes {self.max_positions()}"
            )

    # ---- running: prepare (the base's) gives ``input_ids``, ``attention_mask``
    # ``(batch, pos)``, ``pixel_values`` ``(batch, 1 + max_tiles, C, tile, tile)`` in
    # the model's dtype (rows with fewer tiles zero-padded) and ``image_sizes``
    # ``(batch, 2)`` as (height, width) of the original images. visual_positions
    # (the base's) returns every ``<image>`` token, newline tokens included, and
    # refuses a batch whose rows hold different numbers of them.
    def run_capture(self, inputs: ModelInputs, trace, keep: set[int]) -> None:
        """The default hooked forward; also records ``trace.image_sizes``
        ``(batch, 2)`` (height, width), which places the newline tokens."""
        trace.image_sizes = inputs.tensors.get("image_sizes")
        super().run_capture(inputs, trace, keep)

    def _layout_of(self, trace, batch: int) -> AnyResLayout:
        sizes = getattr(trace, "image_sizes", None)
        if sizes is None:
            raise ValueError("this trace has no image_sizes: capture it with core.forward.capture.capture")
        h, w = (int(v) for v in sizes[batch].tolist())
        return self.anyres_layout((w, h), pixels=False)

    def visual_delimiter_positions(self, trace, batch: int = 0) -> list[int]:
        """Sequence positions of the ``image_newline`` tokens (one per unpadded high-res row)."""
        vis = trace.visual_positions[batch].tolist()
        if not vis:
            return []
        lay = self._layout_of(trace, batch)
        if len(vis) != lay.n_tokens:
            raise ValueError(f"{len(vis)} visual positions for an image that makes {lay.n_tokens} tokens")
        return [vis[i] for i in lay.newline_indices()]

    def token_roles(self, trace, batch: int = 0) -> list[str]:
        """As :meth:`Adapter.token_roles`, with the newline tokens labelled
        "visual_delimiter" although they are ``<image>`` positions: they carry
        a learned embedding, no patch."""
        roles = super().token_roles(trace, batch)
        for i in self.visual_delimiter_positions(trace, batch):
            if roles[i] != "padding":
                roles[i] = "visual_delimiter"
        return roles
