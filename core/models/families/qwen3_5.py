"""Qwen3.5 (transformers' ``Qwen3_5ForConditionalGeneration``): Qwen3-VL's
processor, visual-token geometry and interleaved M-RoPE position ids (without
DeepStack), over a *hybrid* decoder. ``text_config.layer_types`` names each
layer's token mixer:

* ``linear_attention``: a Gated DeltaNet (``linear_attn``): a causal short
  convolution, then a delta-rule recurrence over a matrix state per value head,
  a gated RMSNorm and ``out_proj``. No softmax over keys, so no attention
  pattern and no heads in the sense of the read-outs: the layer's write is one
  residual component ``L{l}.linear_attn`` (docs/METHODS.md §4.15.1), editable as a
  whole (edit site ``mixer``); every per-head or pattern read-out of the layer is
  refused with that reason (:meth:`core.models.adapter.Adapter.no_pattern`).
* ``full_attention``: softmax attention (``self_attn``) with three differences
  from Qwen3-VL's: ``q_proj`` yields each head's query *and* an output gate
  (``d_head`` each, interleaved per head), the head's output is multiplied by
  ``sigmoid(gate)`` before ``o_proj`` (so ``z`` as recorded, o_proj's input, is
  gated: the heads still sum to the attention output exactly; a head's value
  path is ``sigmoid(g_q) * sum_j A_qj v_j``: :meth:`Qwen3_5Adapter.output_gate`);
  only the first ``partial_rotary_factor * d_head`` dims of q and k rotate; and
  the q / k norms are ``(1 + w)`` RMSNorms.

Every RMSNorm of the decoder is ``x / rms(x) * (1 + w)`` computed in float32
(declared ``norm="gemma"``). Generation runs through the model's own hybrid
cache (key / value for the attention layers, conv and recurrent states for the
linear ones).

Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``, :class:`Qwen3_5MoeAdapter`):
the same decoder whose every MLP is a mixture of experts: Qwen3-VL-MoE's router and
fused experts (:mod:`core.models.families.qwen3_vl_moe`) plus a shared expert scaled
by ``sigmoid(shared_expert_gate(x))``, its own component ``L{l}.shared_expert``
(docs/METHODS.md §4.15.2).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from core.models.declaration import Decoder, Mixer, Rotary
from core.models.families.qwen2_vl import Qwen2VLAdapter
from core.models.families.qwen3_vl import QWEN3_PROMPT
from core.models.families.qwen3_vl_moe import FusedExperts

GATED_DELTANET = Mixer("linear_attention", "linear_attn", "linear", "Gated DeltaNet linear attention")


class Qwen3_5Adapter(Qwen2VLAdapter):
    """Qwen2-VL's batches and geometry; a hybrid decoder with gated full-attention heads."""

    declaration = replace(
        Qwen2VLAdapter.declaration,
        name="qwen3_5",
        architectures=("Qwen3_5ForConditionalGeneration",),
        prompt=QWEN3_PROMPT,
        decoder=Decoder(qk_norms=("q_norm", "k_norm"), norm="gemma", mixers=(GATED_DELTANET,)),
        rotary=Rotary("mrope", rotate_half="transformers.models.qwen3_5.modeling_qwen3_5.rotate_half", partial=True),
        edit_sites=("z", "mlp", "resid", "knockout"),
    )

    head_output_gate = "sigmoid of the gate half of q_proj at the query, per head and d_head coordinate"

    # ---- the gated query projection: per head [query (d_head), gate (d_head)]
    def _query_and_gate(self, layer: int, bias: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        linear = self._part(layer, self.declaration.decoder.q)
        t = linear.bias if bias else linear.weight
        if t is None:
            return None, None
        t = t.view(self.n_heads, 2, self.d_head, *t.shape[1:])
        return t[:, 0], t[:, 1]

    def W_Q(self, layer: int) -> torch.Tensor:
        """``(heads, d_model, d_head)``: the query half of each head's rows of ``q_proj``."""
        return self._query_and_gate(layer)[0].transpose(1, 2)

    def b_Q(self, layer: int) -> torch.Tensor:
        query = self._query_and_gate(layer, bias=True)[0]
        w = self._part(layer, self.declaration.decoder.q).weight
        return torch.zeros(self.n_heads, self.d_head, dtype=w.dtype, device=w.device) if query is None else query

    def output_gate(self, trace, block: int, batch: int = 0) -> torch.Tensor:
        """``(pos, heads, d_head)``: ``sigmoid(gate)``, what each query position
        multiplies its heads' attention output by before ``o_proj`` (the gate half
        of ``q_proj`` applied to the block's normed input)."""
        x = self.attn_norm(block)(trace.resid_pre[block][batch])
        _, w = self._query_and_gate(block)
        _, b = self._query_and_gate(block, bias=True)
        g = torch.einsum("pm,hdm->phd", x, w.to(x.dtype))
        return torch.sigmoid(g if b is None else g + b.to(x.dtype))


class Qwen3_5MoeAdapter(FusedExperts, Qwen3_5Adapter):
    """Qwen3.5 with mixture-of-experts MLPs and a gated shared expert (see the module docstring)."""

    declaration = replace(
        Qwen3_5Adapter.declaration,
        name="qwen3_5_moe",
        architectures=("Qwen3_5MoeForConditionalGeneration",),
        edit_sites=(*Qwen3_5Adapter.declaration.edit_sites, "expert"),
    )
