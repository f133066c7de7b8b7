"""Qwen3-VL (transformers' ``Qwen3VLForConditionalGeneration``): Qwen2-VL's
processor, token geometry and M-RoPE position ids (16 px patches, 2x2 merged
into one visual token), with three differences on the language side:

* **q/k norms.** Each head's query and key pass an RMSNorm over ``d_head``
  (``q_norm`` / ``k_norm``, one gain shared by the heads) after the projection
  and before the rotation (declared: the generic ``queries_keys`` applies them).
* **Interleaved M-RoPE.** Rotary frequency ``j`` turns with the height id when
  ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, with the width id when
  ``j % 3 == 2`` and ``j < 3 * mrope_section[2]``, else with the temporal id
  (Qwen2-VL gives each axis one contiguous block). The decoder's own rotary
  module does the interleaving, so Qwen2-VL's declared rotation applies as is.
* **DeepStack.** The vision tower also merges the hidden states of its layers
  ``deepstack_visual_indexes[k]`` (each through its own merger); after decoder
  layer ``k`` the model *adds* feature ``k`` to the stream at the visual
  positions. Those writes are residual components of their own,
  ``deepstack.L{k}`` right after ``L{k}.mlp`` (stream order), at the visual
  positions (nothing is written at a text position); ``resid_pre`` of block
  ``k + 1`` and x_L include them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from core.forward.capture import on_device_of
from core.models.declaration import Decoder
from core.models.families.qwen2_vl import Qwen2VLAdapter

# Qwen3-VL's chat template for one user turn holding an image then the question
# (no default system turn), with the generation prompt.
QWEN3_PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
)


class Qwen3VLAdapter(Qwen2VLAdapter):
    """Qwen2-VL's batches, positions and geometry; Qwen3's q/k norms (declared) and DeepStack writes."""

    declaration = replace(
        Qwen2VLAdapter.declaration,
        name="qwen3_vl",
        architectures=("Qwen3VLForConditionalGeneration",),
        prompt=QWEN3_PROMPT,
        decoder=Decoder(qk_norms=("q_norm", "k_norm")),
    )

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
        block ``k``'s MLP (its experts, in the MoE variant) at a visual position (where the model adds it)."""
        names, C = super().component_stack(trace, position, batch)
        for layer, (mask, embeds) in enumerate(getattr(trace, "deepstack", [])):
            mask = mask.cpu()
            if bool(mask[batch, position]):
                row = int(mask[:batch].sum() + mask[batch, :position].sum())  # the model's mask order
                at = max(i for i, n in enumerate(names) if n.startswith(f"L{layer}.")) + 1  # after its MLP's parts
                names.insert(at, f"deepstack.L{layer}")
                write = embeds[row].to(trace.final_resid.dtype).to(C)
                C = torch.cat([C[:at], write[None], C[at:]])
        return names, C
