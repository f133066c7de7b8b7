"""InternVL (transformers' ``InternVLForConditionalGeneration``, InternVL3-style):
an InternViT vision tower run on image tiles plus a thumbnail, a pixel shuffle
(one visual token per 2x2 block of patches), an MLP projector and a Qwen2
decoder (q/k/v biases, grouped-query K/V, RMSNorm, plain 1-D RoPE).

The processor (``GotOcr2ImageProcessor`` with ``crop_to_patches``) picks the
``cols x rows`` grid (``get_optimal_tiled_canvas``) whose aspect is nearest the
image's, stretches the whole image to ``(rows * T, cols * T)`` px (``T`` the
vision tower's ``image_size``), cuts it into ``T x T`` tiles (row-major) and,
when there is more than one tile, appends the whole image stretched to
``T x T`` (the thumbnail). Each frame gives ``g x g`` tokens (``g = T / patch
* downsample_ratio``), row-major, token ``(r, c)`` the patches ``2r .. 2r+1`` x
``2c .. 2c+1``. Markup: ``<img>`` + ``<IMG_CONTEXT>`` x (frames * g * g) +
``</img>``; ``<img>`` / ``</img>`` are delimiters, not patches.
"""

from __future__ import annotations

from core.errors import ModelLoadError
from core.forward.geometry import VisualToken
from core.models.adapter import config_value, size_value
from core.models.declaration import Family
from core.models.families.llava import LlavaAdapter
from core.models.family_adapter import FamilyAdapter


class InternVLAdapter(LlavaAdapter):
    """LLaVA's module paths and Llama-style decoder (Qwen2 here); what is
    InternVL's own: the tiles-plus-thumbnail geometry, the pixel shuffle
    before the projector and the ``<img>`` / ``</img>`` delimiters."""

    # projector_out equals resid at block 0 on the visual positions; the projector's sites are
    # (frames, g*g, width) tensors, not the (batch, n_visual, width) the visual edits index.
    declaration = Family(
        name="internvl",
        architectures=("InternVLForConditionalGeneration",),
        # What InternVL3's chat template renders for one user turn holding an image then the question.
        prompt="<|im_start|>user\n<IMG_CONTEXT>\n{question}<|im_end|>\n<|im_start|>assistant\n",
        delimiters=("processor.start_image_token_id", "processor.end_image_token_id"),
        no_visual_sites="the projector runs per frame, (frames, g*g, width), not per prompt; "
        "patch 'resid' at block 0 (the projector's output at the visual positions)",
    )

    @classmethod
    def check_config(cls, config) -> None:
        """Also what the geometry reads: square tower images of whole 2x2 patch
        blocks, a 0.5 pixel shuffle, CLS dropped."""
        super().check_config(config)
        size, patch = (config_value(config, f"vision_config.{key}") for key in ("image_size", "patch_size"))
        ratio, strategy = (
            config_value(config, "downsample_ratio"),
            config_value(config, "vision_feature_select_strategy"),
        )
        square = all(isinstance(v, (list, tuple)) and len(set(v)) == 1 for v in (size, patch))
        if not (square and size[0] % (2 * patch[0]) == 0 and ratio == 0.5 and strategy == "default"):
            raise ModelLoadError(
                "config.json: InternVL geometry is mapped for square vision_config image_size / patch_size "
                "(image_size a multiple of 2 patches), downsample_ratio 0.5 and vision_feature_select_strategy "
                f"'default'; got {size}, {patch}, {ratio}, {strategy!r}"
            )

    def processor_options(self, prompts: list[str]) -> dict:
        # InternVLProcessor pads on the left by default, over the tokenizer's side where its init set none.
        return {"padding_side": "right"}

    # The image's token count follows its size: the prompt's own tokens first, prepare() the real total.
    check_fits = FamilyAdapter.check_fits

    # ---- the vision side: pixel-shuffled tower features, then the projector (LLaVA's project_visual)
    def vision_features(self, pixels):
        """``(frames, 3, T, T)`` -> ``(frames, g*g, 4 * vision width)``: the tower's
        hidden state at ``vision_feature_layer``, CLS dropped, pixel-shuffled
        (one row per visual token, what the projector reads)."""
        inner = self.model.model
        layer = int(inner.config.vision_feature_layer)
        out = inner.vision_tower(pixel_values=pixels, output_hidden_states=layer != -1)
        x = (out.last_hidden_state if layer == -1 else out.hidden_states[layer])[:, 1:]
        n = int(round(x.shape[1] ** 0.5))
        return inner.pixel_shuffle(x.reshape(x.shape[0], n, n, -1), inner.config.downsample_ratio).flatten(1, 2)

    # ---- geometry
    def tile_side(self) -> int:
        """``T``: the frame side in px, the processor's and the tower's (else NotImplementedError)."""
        ip = self.processor.image_processor
        vision = self.model.config.vision_config
        tile = int(vision.image_size[0])
        g = tile // int(vision.patch_size[0]) // 2
        size = (size_value(ip.size, "height"), size_value(ip.size, "width"))
        if size != (tile, tile) or self.processor.image_seq_length != g * g:
            raise NotImplementedError(
                f"InternVL geometry is mapped for frames of the tower's {tile} px giving {g * g} tokens: the "
                f"processor's size is {dict(ip.size)}, image_seq_length {self.processor.image_seq_length}"
            )
        return tile

    def tiling(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """``(rows, cols)`` of tiles the processor cuts an image of ``image_size =
        (width, height)`` into; ``(0, 0)`` when it is one frame (no thumbnail)."""
        from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

        tile = self.tile_side()
        # the options a processor call uses (its own defaults: InternVLProcessor crops to patches)
        options = self.processor._merge_kwargs(tokenizer_init_kwargs=self.tokenizer.init_kwargs)["images_kwargs"]
        kw = self.processor.image_processor._merge_and_standardize_kwargs(**options)
        if not kw["crop_to_patches"]:
            return 0, 0
        w, h = image_size
        cols, rows = get_optimal_tiled_canvas((h, w), (tile, tile), kw["min_patches"], kw["max_patches"])
        return (rows, cols) if rows * cols > 1 else (0, 0)

    def resized_pixels(self, image_size: tuple[int, int]) -> tuple[int, str]:
        """The stretched canvas the tiles are cut from (``T x T`` when untiled)."""
        rows, cols = self.tiling(image_size)
        return max(1, rows * cols) * self.tile_side() ** 2, f"{max(1, rows * cols)} tiles of size.height x size.width"

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """The :class:`core.forward.geometry.VisualToken` of every ``<IMG_CONTEXT>`` token,
        in sequence order, boxes in the original image (``image_size = (width, height)``).

        ``image`` is the frame: tiles ``0 .. rows*cols-1`` row-major, then the
        thumbnail (``rows*cols``); an untiled image is the single frame 0.
        ``row``/``col`` index the frame's ``g x g`` grid; a token's box is its
        ``2 x 2``-patch cell, scaled back through the stretch to ``(rows * T,
        cols * T)`` (tiles) or to ``T x T`` (thumbnail, single frame)."""
        rows, cols = self.tiling(image_size)
        tile = self.tile_side()
        cell = 2 * int(self.model.config.vision_config.patch_size[0])
        g = tile // cell
        w, h = image_size
        frames = [(c * tile, r * tile, w / (cols * tile), h / (rows * tile)) for r in range(rows) for c in range(cols)]
        frames.append((0, 0, w / tile, h / tile))  # the thumbnail, or the only frame
        n = len(frames) * g * g
        if positions is not None and len(positions) != n:
            raise ValueError(f"{len(positions)} visual positions for {len(frames)} frames of {g}x{g} tokens")
        out = []
        for f, (ox, oy, sx, sy) in enumerate(frames):
            for k in range(g * g):
                r, c = divmod(k, g)
                x0, y0, i = ox + c * cell, oy + r * cell, len(out)
                box = [x0 * sx, y0 * sy, (x0 + cell) * sx, (y0 + cell) * sy]
                out.append(VisualToken(i, None if positions is None else int(positions[i]), f, r, c, box))
        return out
