"""Molmo 2 (transformers' ``Molmo2ForConditionalGeneration``): a ViT over a
global (low-res) view and overlapping high-res crops, an attention-pooling
adapter, and a Qwen3-style decoder (q/k RMSNorm per head) over::

    <low_res_im_start> ([<im_patch>]*cols <im_col>)*rows <im_end>   (the global view)
    <im_start> ([<im_patch>]*cols <im_col>)*rows <im_end>           (the crops' canvas)

* **Visual tokens.** One ``<im_patch>`` per pooled ``pool_h x pool_w`` window of
  ViT patches: first the global view's grid (the image stretched to ``S x S``),
  then the high-res grid over the *canvas* the crops tile (the image stretched
  to ``canvas_h x canvas_w``; the crops overlap, each canvas patch is read from
  one crop). An odd patch grid is padded half before, half after, so an edge
  window covers fewer patches. ``VisualToken.image`` is 0 (global) or 1 (canvas).
* **Added, not scattered.** The pooled feature is *added* to the ``<im_patch>``
  embedding: x_0 at a visual position is ``E[<im_patch>] + feature`` (the ``embed``
  component).
* **Mask.** Every token the processor marks ``mm_token_type_ids == 1`` (patches,
  columns, starts, ends: of all images of the row) attends to every other one of
  them, the rest is causal (mask rule ``image_tokens``).
* **Not mapped:** the ``olmo`` q/k norm (over all heads at once), ``norm_after``
  (post-norm blocks), the per-token ``vision_out`` / ``projector_out`` sites (the
  adapter pools patches gathered across crops by index, no per-token layout).
"""

from __future__ import annotations

import math

from core.errors import ModelLoadError, UnsupportedArchitectureError
from core.forward.geometry import VisualToken
from core.models.adapter import size_value
from core.models.declaration import Decoder, Family, Mask, Rotary
from core.models.family_adapter import FamilyAdapter


class Molmo2Adapter(FamilyAdapter):
    """A Qwen3-style decoder as declared (q/k norms, the image tokens' bidirectional
    mask); Molmo 2's own: the per-layer RoPE table and the two-view geometry."""

    declaration = Family(
        name="molmo2",
        architectures=("Molmo2ForConditionalGeneration",),
        prompt="<|im_start|>user\n<|image|>{question}<|im_end|>\n<|im_start|>assistant\n",
        decoder=Decoder(qk_norms=("q_norm", "k_norm")),
        rotary=Rotary(rotate_half="transformers.models.molmo2.modeling_molmo2.rotate_half"),
        mask=Mask("image_tokens", types="mm_token_type_ids"),
        delimiters=("<im_col>", "<im_start>", "<low_res_im_start>", "<im_end>"),
        no_visual_sites="the adapter pools ViT patches gathered by index across crops "
        "(no per-token batch layout to edit)",
    )
    # the processor's image token is the <|image|> placeholder it expands; the model finds <im_patch>
    token_id_fields = (("image_patch_id", True),)

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        text = config.get_text_config()
        if text.qk_norm_type != "qwen3":
            raise UnsupportedArchitectureError(
                f"Molmo2 qk_norm_type {text.qk_norm_type!r} is not mapped (only 'qwen3', per head): the 'olmo' "
                "norm takes its statistics over every head's query at once, so no head's q is its own"
            )
        if text.norm_after:
            raise UnsupportedArchitectureError(
                "Molmo2 with norm_after (post-norm blocks) is not mapped: a norm between each write and the "
                "stream, so heads do not sum to what the block adds"
            )

    def __init__(self, model, processor, tokenizer, config=None):
        super().__init__(model, processor, tokenizer, config)
        want = int(model.config.image_patch_id)
        if self.vocab_id("<im_patch>") != want:
            raise ModelLoadError(f"the processor's <im_patch> is not config.json image_patch_id {want}")

    def _rotary(self, block: int | None):
        """The scaled RoPE table on ``rope_scaling_layers``, else the unscaled one
        (the same where the config's rope type is the default)."""
        lm = self.language_model
        kinds = set(lm.rope_types)
        if block is None and len(kinds) > 1:
            raise ValueError("molmo2: rotate needs the block (scaled and unscaled RoPE layers differ)")
        kind = lm.rope_types[block] if block is not None else kinds.pop()
        return (lm.rotary_emb if kind == "scaled" else lm.rotary_emb_unscaled), ()

    # ---- geometry
    def view_grids(self, image_size: tuple[int, int]) -> list[tuple[int, int]]:
        """``[(height, width)]`` in pixels of the global view (the image stretched to a
        square) and of the canvas the crops tile, as the image processor computes them."""
        from transformers.models.molmo2.image_processing_molmo2 import compute_crop_geometry

        ip = self.processor.image_processor
        side = size_value(ip.size, "height")
        if side is None or side != size_value(ip.size, "width") or not getattr(ip, "do_resize", True):
            raise NotImplementedError("Molmo2 geometry is mapped for a square resize (size.height == size.width)")
        w, h = image_size
        _, _, canvas_h, canvas_w = compute_crop_geometry(h, w, ip.max_crops, ip.overlap_margins, side, ip.patch_size)
        return [(side, side), (canvas_h, canvas_w)]

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """Per view (global, then canvas), one token per pooling window row-major;
        its box the union of its (unpadded) patches, stretched back to the original."""
        ip = self.processor.image_processor
        patch, (ph, pw) = int(ip.patch_size), ip.pooling_size
        cells = []  # (view, row, col, box)
        for view, (vh, vw) in enumerate(self.view_grids(image_size)):
            sx, sy = patch * image_size[0] / vw, patch * image_size[1] / vh
            rows, cols = _pooled_spans(vh // patch, ph), _pooled_spans(vw // patch, pw)
            cells += [
                (view, r, c, [x0 * sx, y0 * sy, x1 * sx, y1 * sy])
                for r, (y0, y1) in enumerate(rows)
                for c, (x0, x1) in enumerate(cols)
            ]
        if positions is not None and len(positions) != len(cells):
            raise ValueError(f"{len(positions)} visual positions for {len(cells)} pooled tokens")
        return [VisualToken(i, None if positions is None else int(positions[i]), *cell) for i, cell in enumerate(cells)]


def _pooled_spans(n: int, k: int) -> list[tuple[int, int]]:
    """``[(first, end)]`` patch spans of the windows of ``k`` over ``n`` patches,
    padded ``(k * ceil(n / k) - n) // 2`` before (transformers' ``arange_for_pooling``)."""
    before = (k * math.ceil(n / k) - n) // 2
    return [(max(0, i * k - before), min(n, (i + 1) * k - before)) for i in range(math.ceil(n / k))]
