"""LFM2-VL (transformers' ``Lfm2VlForConditionalGeneration``): a SigLIP2 NaFlex
vision tower, a pixel-unshuffle projector (each 2 x 2 block of patches, row
offset major, concatenated; LayerNorm, linear, GELU, linear) and an LFM2 decoder
whose layers are of two kinds (``text_config.layer_types``):

* ``conv``: a gated short convolution (``conv``, ``Lfm2ShortConv``):
  ``B, C, x = in_proj(n)``; ``y = causal depthwise conv over positions of B * x``
  (kernel ``conv_L_cache``: the token and the ``K - 1`` before it);
  ``out_proj(C * y)``. No softmax over keys, so no attention pattern and no heads:
  the layer's write is one residual component ``L{l}.conv`` (docs/METHODS.md
  §4.15.1), editable as a whole (edit site ``mixer``); every per-head or pattern
  read-out of it is refused in one line (:meth:`core.models.adapter.Adapter.no_pattern`).
  Its ``nn.Conv1d`` is never called as a module (its weight goes to ``F.conv1d``),
  so the hooks sit on the ``Lfm2ShortConv`` module itself.
* ``full_attention``: grouped-query softmax attention, Llama's but for the names
  (``out_proj``; per-head RMSNorms ``q_layernorm`` / ``k_layernorm`` before a full
  RoPE), no biases.

Each block is sequential pre-norm (``operator_norm`` before the mixer, ``ffn_norm``
before the SwiGLU ``feed_forward``); every norm is an RMSNorm with statistics in
float32 and a gain ``w`` (declared ``norm="llama"``). The final norm is the decoder's
``embedding_norm`` (so named, applied after the last block); ``lm_head`` is tied to
the embeddings. Generation runs through the model's own cache (keys and values
for the attention layers, the last ``K`` conv inputs for the conv layers).

The image processor cuts an image of ``(W, H)`` px into crops (:meth:`layout`):

* an image that is not too large (or with splitting off) is stretched, per axis,
  to ``smart_resize``'s ``(rw, rh)`` (multiples of ``cell = encoder_patch_size *
  downsample_factor``, token count clamped to [min_image_tokens, max_image_tokens]):
  one crop of ``(rh / cell) x (rw / cell)`` tokens, row-major;
* a too large image is stretched to ``(cols * tile, rows * tile)`` (the grid closest
  to its aspect ratio, ``min_tiles .. max_tiles`` tiles) and cut row-major into
  ``tile x tile`` crops of ``(tile / cell)^2`` tokens each, then (``use_thumbnail``)
  the whole image at its ``smart_resize`` size follows as one more crop.

A visual token is one ``cell x cell`` block of its crop; its box is that block
scaled back to the original image, each axis by its own factor, so a thumbnail
token's box overlaps the tile tokens' boxes (the image is seen twice). ``image``
of a :class:`core.forward.geometry.VisualToken` is the crop: tiles ``0 ..
rows*cols-1`` row-major, then the thumbnail. The markers the processor writes
(``<|image_start|>``, ``<|img_row_R_col_C|>`` before each tile, ``<|img_thumbnail|>``,
``<|image_end|>``) are text tokens with their own embeddings: delimiters, never
visual tokens.

The projector runs once over every crop's token slots side by side (padding slots
included, dropped after): no ``(batch, n_visual, width)`` layout, so the
visual-feature edit sites are refused; patching reaches the image-token positions
through ``resid`` / ``z``.
"""

from __future__ import annotations

import re
from functools import cached_property

from core.errors import UnsupportedArchitectureError
from core.forward.geometry import VisualToken, stretched_grid_tokens
from core.models.adapter import config_int
from core.models.declaration import Decoder, Family, Mixer, Rotary
from core.models.family_adapter import FamilyAdapter

SHORT_CONV = Mixer("conv", "conv", "conv", "LFM2 gated short convolution")
LAYER_TYPES = ("conv", "full_attention")
_TILE_MARKER = re.compile(r"^<\|img_row_\d+_col_\d+\|>$")


class Lfm2VlAdapter(FamilyAdapter):
    """The canonical view of an LFM2-VL model (see the module docstring): the
    hybrid decoder as declared; its own crop layout and geometry."""

    declaration = Family(
        name="lfm2_vl",
        architectures=("Lfm2VlForConditionalGeneration",),
        # LFM2-VL's chat template for one user turn holding the image then the question.
        prompt="<|startoftext|><|im_start|>user\n<image>{question}<|im_end|>\n<|im_start|>assistant\n",
        decoder=Decoder(
            o="out_proj",
            attn_norm="operator_norm",
            mlp="feed_forward",
            final_norm="embedding_norm",
            qk_norms=("q_layernorm", "k_layernorm"),
            mixers=(SHORT_CONV,),
        ),
        rotary=Rotary(rotate_half="transformers.models.lfm2.modeling_lfm2.rotate_half"),
        delimiters=("processor.image_start_token", "processor.image_end_token", "processor.image_thumbnail_token"),
        no_visual_sites="the projector runs once over every crop's token slots side by side, padding slots "
        "included (no per-token batch layout to edit)",
    )

    @classmethod
    def check_config(cls, config) -> None:
        """Layer types the adapter maps (short convolution, full attention); the sizes
        the geometry reads."""
        super().check_config(config)
        config_int(config, "downsample_factor", minimum=1, required=True)
        config_int(config, "vision_config.patch_size", minimum=1, required=True)
        config_int(config, "text_config.conv_L_cache", minimum=1, required=True)
        types = getattr(config.text_config, "layer_types", None)
        unknown = sorted({str(t) for t in types or ()} - set(LAYER_TYPES))
        if not types or unknown:
            raise UnsupportedArchitectureError(
                f"config.json text_config.layer_types: {unknown or types!r} not mapped for LFM2-VL "
                f"(only {', '.join(LAYER_TYPES)})"
            )
        if "full_attention" not in types:
            raise UnsupportedArchitectureError(
                "config.json text_config.layer_types: no full_attention layer (nothing to read patterns of)"
            )

    # The processor reads a flat list of images as one sample holding every image: one list per prompt.
    images_per_prompt = True

    # ---- the tokens around the image
    @cached_property
    def _tile_markers(self) -> list[str]:
        """The tile markers ``<|img_row_R_col_C|>`` the tokenizer holds."""
        vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
        return sorted(t for t in vocab if _TILE_MARKER.match(t))

    def extra_markup(self) -> list[str]:
        """The tile markers the processor writes, whether or not the tokenizer marks them special."""
        return list(self._tile_markers)

    def delimiter_ids(self) -> set[int]:
        """``<|image_start|>``, ``<|image_end|>``, ``<|img_thumbnail|>`` and every tile marker."""
        markers = {self.vocab_id(t) for t in self._tile_markers} - {None}
        return super().delimiter_ids() | markers

    # ---- geometry
    def _processor_settings(self) -> dict:
        """The image processor's layout settings (as its processor reads them), checked
        against the model's patch size and unshuffle factor."""
        ip = self.processor.image_processor
        names = (
            "downsample_factor",
            "min_tiles",
            "max_tiles",
            "min_image_tokens",
            "max_image_tokens",
            "encoder_patch_size",
            "tile_size",
            "max_pixels_tolerance",
        )
        s = {name: getattr(ip, name) for name in names}
        if not getattr(ip, "do_image_splitting", True):
            s["min_tiles"] = s["max_tiles"] = 1
        config = self.model.config
        patch, factor = int(config.vision_config.patch_size), int(config.downsample_factor)
        if (int(s["encoder_patch_size"]), int(s["downsample_factor"])) != (patch, factor):
            raise ValueError(
                f"processor (patch {s['encoder_patch_size']}, downsample {s['downsample_factor']}) and model "
                f"(patch {patch}, downsample {factor}) disagree"
            )
        if int(s["tile_size"]) % (patch * factor):
            raise ValueError(f"tile_size {s['tile_size']} is not a whole number of {patch * factor} px cells")
        return s

    def layout(self, image_size: tuple[int, int]) -> tuple[int, int, int, int, bool]:
        """``(rows, cols, rh, rw, thumbnail)`` of an image of ``image_size = (width,
        height)``: its tile grid (``1, 1``: one crop), the size of the single crop or the
        thumbnail (``smart_resize``'s; ``tile x tile`` where ``min_tiles`` 1 lets a too large
        image be one tile) and whether a thumbnail follows the tiles; the image
        processor's own ``_get_split_layout``."""
        s = self._processor_settings()
        w, h = image_size
        split, rows, cols, rh, rw = self.processor.image_processor._get_split_layout(int(h), int(w), **s)
        tiled = split and rows * cols > 1
        if split and not tiled:  # min_tiles 1: one crop, the image stretched to tile x tile px
            tile, cell = int(s["tile_size"]), self._cell()
            if (rh // cell) * (rw // cell) != (tile // cell) ** 2:
                raise ValueError(
                    f"the {w}x{h} image is cut into one {tile} px tile of {(tile // cell) ** 2} tokens, but the "
                    f"processor writes the {(rh // cell) * (rw // cell)} of its {rw}x{rh} resize (min_tiles = 1)"
                )
            rh = rw = tile
        thumbnail = tiled and bool(getattr(self.processor.image_processor, "use_thumbnail", True))
        return rows, cols, rh, rw, thumbnail

    def _cell(self) -> int:
        return int(self.model.config.vision_config.patch_size) * int(self.model.config.downsample_factor)

    def resized_pixels(self, image_size: tuple[int, int]) -> tuple[int, str]:
        """The larger of the tile grid's resize and ``smart_resize``'s."""
        rows, cols, rh, rw, _ = self.layout(image_size)
        tile = int(self.processor.image_processor.tile_size)
        if rows * cols > 1 and rows * cols * tile * tile > rh * rw:
            return rows * cols * tile * tile, f"tile_size = {tile}, {rows}x{cols} tiles"
        return rh * rw, f"smart_resize with max_image_tokens = {self.processor.image_processor.max_image_tokens}"

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """The :class:`core.forward.geometry.VisualToken` of every image token, in
        sequence order, boxes in the original image (``image_size = (width, height)``).

        Not split: one crop, ``image`` 0, the ``smart_resize`` grid. Split: tile ``(R, C)``
        is crop ``R * cols + C``, its token ``(r, c)`` the box ``[(C*tile + c*cell) * W /
        (cols*tile), (R*tile + r*cell) * H / (rows*tile), ...]``, one cell further for the
        far corner; then the thumbnail (crop ``rows * cols``) on the ``smart_resize`` grid."""
        rows, cols, rh, rw, thumbnail = self.layout(image_size)
        cell = self._cell()
        grid = (rh // cell, rw // cell)
        if rows * cols == 1:
            return stretched_grid_tokens(image_size, (rw, rh), grid, cell, positions)
        tile = int(self.processor.image_processor.tile_size)
        g = tile // cell
        n = rows * cols * g * g + (grid[0] * grid[1] if thumbnail else 0)
        if positions is not None and len(positions) != n:
            raise ValueError(f"{len(positions)} visual positions for {n} visual tokens ({rows}x{cols} tiles)")
        w, h = image_size
        sx, sy = w / (cols * tile), h / (rows * tile)
        out = []
        for crop in range(rows * cols):
            tile_row, tile_col = divmod(crop, cols)
            for k in range(g * g):
                r, c = divmod(k, g)
                x0, y0 = tile_col * tile + c * cell, tile_row * tile + r * cell
                box = [x0 * sx, y0 * sy, (x0 + cell) * sx, (y0 + cell) * sy]
                i = len(out)
                out.append(VisualToken(i, None if positions is None else int(positions[i]), crop, r, c, box))
        if thumbnail:
            rest = None if positions is None else positions[len(out) :]
            for t in stretched_grid_tokens(image_size, (rw, rh), grid, cell, rest):
                out.append(VisualToken(len(out), t.position, rows * cols, t.row, t.col, t.box))
        return out

    def view_names(self, image_size: tuple[int, int]) -> dict[int, str]:
        """The thumbnail of a tiled image by its name (the tiles are named by where they lie)."""
        rows, cols, _, _, thumbnail = self.layout(image_size)
        return {rows * cols: "thumbnail"} if thumbnail else {}
