"""Aya Vision (transformers' ``AyaVisionForConditionalGeneration``): a SigLIP
tower run on image tiles plus a thumbnail, a pixel shuffle (one visual token per
``d x d`` block of patches, ``d = downsample_factor``), a LayerNorm + SwiGLU
projector, and a Cohere 2 decoder.

The tiling is InternVL's (``GotOcr2ImageProcessor`` with ``crop_to_patches``,
:class:`InternVLAdapter`): ``T x T`` tiles of the image stretched to
``(rows * T, cols * T)`` px, row-major, then the whole image stretched to
``T x T`` when there is more than one tile. Each frame gives ``g x g`` tokens
(``g = T / (patch * d)``), row-major, token ``(r, c)`` the patches
``d r .. d r + d - 1`` x ``d c .. d c + d - 1``. Markup:
``<|START_OF_IMG|>`` (``TILE_k`` + ``<|IMG_PATCH|>`` x g*g per tile)
``TILE_GLOBAL`` + ``<|IMG_PATCH|>`` x g*g ``<|END_OF_IMG|>``: every token
of the markup but the patches is a delimiter.

What is Cohere 2's own:

* **Parallel block.** ``x_{l+1} = x_l + attn(LN(x_l)) + mlp(LN(x_l))``: one
  norm (Cohere's LayerNorm: mean-centred, no bias, gain applied in float32)
  read by both sublayers. The stack is still embed + heads + MLP per block.
* **logit_scale.** The model multiplies ``lm_head``'s output by
  ``text_config.logit_scale``; ``W_U`` includes it (declared), so lens and DLA
  read the model's logits.
* **Interleaved RoPE on sliding-window layers only.** Pairs ``(2i, 2i + 1)``
  rotate (not Llama's halves), in float32; full-attention layers have no
  position encoding (NoPE). Sliding layers drop keys ``sliding_window`` or
  more positions back.
"""

from __future__ import annotations

import torch

from core.errors import ModelLoadError, UnsupportedArchitectureError
from core.forward.geometry import VisualToken
from core.models.adapter import config_int, config_value, size_value
from core.models.declaration import Decoder, Family, Rotary
from core.models.families.internvl import InternVLAdapter


class AyaVisionAdapter(InternVLAdapter):
    """InternVL's tiles, right padding and refused projector sites; Cohere 2's
    norm, unembedding scale, RoPE and masks (see the module docstring)."""

    declaration = Family(
        name="aya_vision",
        architectures=("AyaVisionForConditionalGeneration",),
        prompt="<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|><image>{question}<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
        decoder=Decoder(form="parallel", norm="cohere", logit_scale="logit_scale"),
        rotary=Rotary(
            rotate_half="transformers.models.cohere2.modeling_cohere2.rotate_half",
            per_layer="sliding_only",
            float32=True,
        ),
        no_visual_sites="the projector runs per frame, (frames, g, g, width), not per prompt; "
        "patch 'resid' at block 0 (the projector's output at the visual positions)",
    )
    # The processor's "image token" (<image>) is the placeholder it expands; the model
    # looks up <|IMG_PATCH|> (image_token_index): range check here, the pairing in __init__.
    token_id_fields = (("image_token_index", True),)

    @classmethod
    def check_config(cls, config) -> None:
        """A Cohere 2 decoder, and what the geometry reads: no CLS to drop (SigLIP),
        square tower images of whole ``d x d`` patch blocks."""
        super(InternVLAdapter, cls).check_config(config)  # not InternVL's geometry fields
        text_type = config_value(config, "text_config.model_type")
        if text_type != "cohere2":
            raise UnsupportedArchitectureError(f"config.json text_config.model_type: {text_type!r} (only 'cohere2')")
        size = config_int(config, "vision_config.image_size", minimum=1, required=True)
        patch = config_int(config, "vision_config.patch_size", minimum=1, required=True)
        d = config_int(config, "downsample_factor", minimum=1, required=True)
        strategy = config_value(config, "vision_feature_select_strategy")
        if size % (patch * d) or strategy != "full":
            raise ModelLoadError(
                "config.json: Aya Vision geometry is mapped for vision_config image_size a multiple of patch_size * "
                f"downsample_factor and vision_feature_select_strategy 'full'; got {size}, {patch}, {d}, {strategy!r}"
            )

    def __init__(self, model, processor, tokenizer, config=None):
        super().__init__(model, processor, tokenizer, config)
        want = int(model.config.image_token_id)
        if getattr(processor, "image_token_id", want) != want:
            raise ModelLoadError(f"the processor's image patch token is not config.json image_token_index {want}")

    # ---- the vision side: the projector shuffles, so its input is the tower's patches
    def vision_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """``(frames, 3, T, T)`` -> ``(frames, (T / patch)**2, vision width)``: what the
        projector reads (the tower's selected hidden state), taken at its input."""
        seen = {}
        handle = self.projector.register_forward_pre_hook(lambda module, args: seen.setdefault("x", args[0]))
        try:
            self.model.model.get_image_features(pixels, return_dict=True)
        finally:
            handle.remove()
        return seen["x"]

    def project_visual(self, features: torch.Tensor) -> torch.Tensor:
        """``(frames, patches, vision width)`` -> ``(frames, g*g, d_model)``: the projector
        returns the ``g x g`` grid; the model reads it row-major."""
        return self.projector(features).flatten(1, 2)

    # ---- markup and geometry
    def visual_delimiter_positions(self, trace, batch: int = 0) -> list[int]:
        """Every token from ``<|START_OF_IMG|>`` to ``<|END_OF_IMG|>`` but the patches (tile markers)."""
        p, patch = self.processor, int(self.model.config.image_token_id)
        start, end = self.vocab_id(p.start_of_img_token), self.vocab_id(p.end_of_img_token)
        out, inside = [], False
        for i, t in enumerate(trace.input_ids[batch].tolist()):
            inside = inside or t == start
            if inside and t != patch:
                out.append(i)
            inside = inside and t != end
        return out

    def token_cell(self) -> int:
        """The side in px of the patch block one visual token covers (``patch * d``)."""
        return int(self.model.config.vision_config.patch_size) * int(self.model.config.downsample_factor)

    def tile_side(self) -> int:
        """``T``: the frame side in px, the processor's and the tower's (else NotImplementedError)."""
        ip, p = self.processor.image_processor, self.processor
        tile = int(self.model.config.vision_config.image_size)
        size = (size_value(ip.size, "height"), size_value(ip.size, "width"))
        if size != (tile, tile) or (p.img_size, p.patch_size) != (tile, self.token_cell()):
            raise NotImplementedError(
                f"Aya Vision geometry is mapped for frames of the tower's {tile} px and {self.token_cell()} px "
                f"tokens: the image processor's size is {dict(ip.size)}, the processor's img_size {p.img_size}, "
                f"patch_size {p.patch_size}"
            )
        return tile

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """InternVL's frames (tiles row-major, then the thumbnail), each a ``g x g``
        grid of ``patch * d`` px cells, boxes in the original image."""
        rows, cols = self.tiling(image_size)
        tile, cell = self.tile_side(), self.token_cell()
        g = tile // cell
        w, h = image_size
        frames = [(c * tile, r * tile, w / (cols * tile), h / (rows * tile)) for r in range(rows) for c in range(cols)]
        frames.append((0, 0, w / tile, h / tile))  # the thumbnail, or the only frame
        if positions is not None and len(positions) != len(frames) * g * g:
            raise ValueError(f"{len(positions)} visual positions for {len(frames)} frames of {g}x{g} tokens")
        out = []
        for f, (ox, oy, sx, sy) in enumerate(frames):
            for k in range(g * g):
                r, c = divmod(k, g)
                x0, y0, i = ox + c * cell, oy + r * cell, len(out)
                box = [x0 * sx, y0 * sy, (x0 + cell) * sx, (y0 + cell) * sy]
                out.append(VisualToken(i, None if positions is None else int(positions[i]), f, r, c, box))
        return out
