"""Qwen3-VL (transformers' ``Qwen3VLForConditionalGeneration``): Qwen2-VL's
processor, token geometry and M-RoPE position ids (16 px patches, 2x2 merged
into one visual token), with three differences on the language side:

* **q/k norms.** Each head's query and key pass an RMSNorm over ``d_head``
  (``q_norm`` / ``k_norm``, one gain shared by the heads) after the projection
  and before the rotation; :meth:`Qwen3VLAdapter.queries_keys` applies them.
* **Interleaved M-RoPE.** Rotary frequency ``j`` turns with the height id when
  ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, with the width id when
  ``j % 3 == 2`` and ``j < 3 * mrope_section[2]``, else with the temporal id
  (Qwen2-VL gives each axis one contiguous block). The decoder's own rotary
  module does the interleaving, so :meth:`Qwen2VLAdapter.rotate` applies as is.
* **DeepStack.** The vision tower also merges the hidden states of its layers
  ``deepstack_visual_indexes[k]`` (each through its own merger); after decoder
  layer ``k`` the model *adds* feature ``k`` to the stream at the visual
  positions. Those writes are residual components of their own,
  ``deepstack.L{k}`` right after ``L{k}.mlp`` (stream order), at the visual
  positions (nothing is written at a text position); ``resid_pre`` of block
  ``k + 1`` and x_L include them.
"""

from __future__ import annotations

import torch

from core.capture import on_device_of
from core.models.families.qwen2_vl import Qwen2VLAdapter

# Qwen3-VL's chat template for one user turn holding an image then the question
# (no default system turn), with the generation prompt.
QWEN3_PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
)


class Qwen3VLAdapter(Qwen2VLAdapter):
    """Qwen2-VL's batches, positions and geometry; Qwen3's q/k norms and DeepStack writes."""

    hf_architectures = ("Qwen3VLForConditionalGeneration",)

    family = "qwen3_vl"
    final_norm = "rmsnorm"
    attention_kind = "self"
    position_scheme = "mrope"

    fallback_prompt = QWEN3_PROMPT

    # ---- q/k norms
    def q_norm(self, block: int):
        """The per-head RMSNorm over ``d_head`` applied to queries after ``q_proj``, before M-RoPE."""
        return self._norm(self._attn(block).q_norm)

    def k_norm(self, block: int):
        """The per-head RMSNorm over ``d_head`` applied to keys after ``k_proj``, before M-RoPE."""
        return self._norm(self._attn(block).k_norm)

    def qk_gain(self, block: int) -> torch.Tensor:
        """``(d_head,)`` ``g_q * g_k``: position-free, the score is
        ``q^T diag(qk_gain) k / (rms(q) rms(k) sqrt(d_head))`` with ``q``, ``k`` the
        raw projections; the rotation between norm and score mixes coordinate
        pairs, so with positions this is the form only where the gains agree on each pair."""
        attn = self._attn(block)
        return attn.q_norm.weight * attn.k_norm.weight

    def queries_keys(self, trace, block: int, batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``(pos, heads, d_head)`` and keys (groups expanded) as the model
        scores them: norm, W_Q / W_K (+ bias), q_norm / k_norm, then M-RoPE."""
        x = self.attn_norm(block)(trace.resid_pre[block][batch])
        q = torch.einsum("pm,hmd->phd", x, self.W_Q(block).to(x.dtype)) + self.b_Q(block).to(x.dtype)
        k = torch.einsum("pm,hmd->phd", x, self.W_K(block).to(x.dtype)) + self.b_K(block).to(x.dtype)
        positions = self.rope_positions(trace, batch)
        return self.rotate(self.q_norm(block)(q), positions), self.rotate(self.k_norm(block)(k), positions)

    # ---- DeepStack: what the capture records and where the writes enter the residual graph
    def final_hooks(self, trace) -> list:
        """Qwen2-VL's (x_L, the M-RoPE positions) and ``trace.deepstack``: per
        DeepStack layer ``k``, ``(visual_pos_masks (batch, pos), features (n_visual, d_model))``
        as the decoder received them (empty without an image)."""

        def deepstack(module, args, kwargs):
            embeds, mask = kwargs.get("deepstack_visual_embeds"), kwargs.get("visual_pos_masks")
            trace.deepstack = [] if embeds is None else [(mask, on_device_of(module, e)) for e in embeds]

        return [*super().final_hooks(trace), (self.language_model, "pre_kw", deepstack)]

    def stream_writes(self, trace) -> list[tuple[str, torch.Tensor]]:
        """``[(name, (batch, pos, d_model))]``: what the model adds to the stream
        beside its blocks' attention and MLP: ``deepstack.L{k}`` after block ``k``,
        the feature at each visual position (zero elsewhere), in the stream's dtype."""
        out = []
        for layer, (mask, embeds) in enumerate(getattr(trace, "deepstack", [])):
            dense = trace.final_resid.new_zeros(*mask.shape, embeds.shape[-1])
            dense[mask.to(dense.device)] = embeds.to(dense)
            out.append((f"deepstack.L{layer}", dense))
        return out

    def component_stack(self, trace, position: int, batch: int = 0) -> tuple[list[str], torch.Tensor]:
        """The pre-norm stack, with each DeepStack write ``deepstack.L{k}`` after
        ``L{k}.mlp`` at a visual position (where the model adds it)."""
        names, C = super().component_stack(trace, position, batch)
        for layer, (mask, embeds) in enumerate(getattr(trace, "deepstack", [])):
            mask = mask.cpu()
            if bool(mask[batch, position]):
                row = int(mask[:batch].sum() + mask[batch, :position].sum())  # the model's mask order
                at = names.index(f"L{layer}.mlp") + 1
                names.insert(at, f"deepstack.L{layer}")
                write = embeds[row].to(trace.final_resid.dtype).to(C)
                C = torch.cat([C[:at], write[None], C[at:]])
        return names, C
