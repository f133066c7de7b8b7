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
  them, the rest is causal; :meth:`Molmo2Adapter.allowed_keys` rebuilds it.
* **Not mapped:** the ``olmo`` q/k norm (over all heads at once), ``norm_after``
  (post-norm blocks), the per-token ``vision_out`` / ``projector_out`` sites (the
  adapter pools patches gathered across crops by index, no per-token layout).
"""

from __future__ import annotations

import math

import torch

from core.capture import run_with_hooks
from core.errors import InterventionError, ModelLoadError, UnsupportedArchitectureError
from core.geometry import VisualToken
from core.models.adapter import Adapter, ModelInputs, size_value
from core.models.families._decoder import LlamaStyleWeights
from core.models.families.qwen3_vl import Qwen3VLAdapter

DELIMITERS = ("<im_col>", "<im_start>", "<low_res_im_start>", "<im_end>")


class Molmo2Adapter(LlamaStyleWeights, Adapter):
    """LlamaStyleWeights' weights, norms and hooks; Qwen3's q/k norms; the image
    block's bidirectional mask, the per-layer RoPE and the two-view geometry."""

    hf_architectures = ("Molmo2ForConditionalGeneration",)

    family = "molmo2"
    final_norm = "rmsnorm"
    attention_kind = "self"
    position_scheme = "rope"

    fallback_prompt = "<|im_start|>user\n<|image|>{question}<|im_end|>\n<|im_start|>assistant\n"
    edit_sites = ("z", "mlp", "resid", "knockout")
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

    @property
    def d_head(self) -> int:
        return int(self._attn(0).head_dim)

    def visual_site_module(self, site: str):
        raise InterventionError(
            f"{self.family}: no {site!r} site: the adapter pools ViT patches gathered by index across "
            "crops (no per-token batch layout to edit)"
        )

    # ---- attention: q/k norms (Qwen3's), each layer's RoPE, the image block's mask
    q_norm = Qwen3VLAdapter.q_norm
    k_norm = Qwen3VLAdapter.k_norm
    qk_gain = Qwen3VLAdapter.qk_gain

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, block: int | None = None) -> torch.Tensor:
        """RoPE of block ``block``: the scaled table on ``rope_scaling_layers``, else
        the unscaled one (the same where the config's rope type is the default)."""
        from transformers.models.molmo2.modeling_molmo2 import rotate_half

        lm = self.language_model
        kinds = set(lm.rope_types)
        if block is None and len(kinds) > 1:
            raise ValueError("molmo2: rotate needs the block (scaled and unscaled RoPE layers differ)")
        kind = lm.rope_types[block] if block is not None else kinds.pop()
        rotary = lm.rotary_emb if kind == "scaled" else lm.rotary_emb_unscaled
        cos, sin = rotary(x, positions.to(x.device).view(1, -1))
        cos, sin = cos[0].to(x).unsqueeze(-2), sin[0].to(x).unsqueeze(-2)
        return x * cos + rotate_half(x) * sin

    def queries_keys(self, trace, block: int, batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm, W_Q / W_K (+ bias), q_norm / k_norm per head, then the layer's RoPE."""
        x = self.attn_norm(block)(trace.resid_pre[block][batch])
        q = torch.einsum("pm,hmd->phd", x, self.W_Q(block).to(x.dtype)) + self.b_Q(block).to(x.dtype)
        k = torch.einsum("pm,hmd->phd", x, self.W_K(block).to(x.dtype)) + self.b_K(block).to(x.dtype)
        q, k, positions = self.q_norm(block)(q), self.k_norm(block)(k), self.rope_positions(trace, batch)
        return self.rotate(q, positions, block), self.rotate(k, positions, block)

    def run_capture(self, inputs: ModelInputs, trace, keep: set[int]) -> None:
        """The hooked forward; keeps ``trace.token_type_ids`` (``mm_token_type_ids``) for :meth:`allowed_keys`."""
        trace.token_type_ids = inputs.tensors.get("mm_token_type_ids")
        run_with_hooks(self, inputs, trace, keep)

    def allowed_keys(self, trace, block: int, batch: int = 0) -> torch.Tensor:
        """Causal OR (query and key both image-block tokens), padding keys excluded."""
        allowed = super().allowed_keys(trace, block, batch)
        types = getattr(trace, "token_type_ids", None)
        if types is not None:  # padding is never in the image block: no padding key comes back
            image = types[batch].cpu() == 1
            allowed = allowed | (image[:, None] & image[None, :])
        return allowed

    def visual_delimiter_positions(self, trace, batch: int = 0) -> list[int]:
        """Positions of the image starts, row ends (``<im_col>``) and image ends."""
        marks = {self.vocab_id(t) for t in DELIMITERS}
        return [i for i, t in enumerate(trace.input_ids[batch].tolist()) if t in marks]

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
