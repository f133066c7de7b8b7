"""Gemma 3 (transformers' ``Gemma3ForConditionalGeneration``): a SigLIP tower
whose ``P x P`` patch grid is average-pooled to a ``g x g`` grid
(``g**2 = mm_tokens_per_image``), RMS-normed and projected, and a Gemma 3
decoder over ``<bos> ... \\n\\n<start_of_image>[g*g image tokens]<end_of_image>\\n\\n ...``.

PaliGemma's conventions carry over (:class:`PaliGemmaAdapter`): the ``(1 + w)``
RMSNorm in float32 (:class:`core.models.norms.GemmaNorm`), embeddings scaled by ``sqrt(d_model)``
(image features scattered in unscaled), the unembedding tied to the unscaled
table, and the mask each layer was called with recorded and used as it is.
What is Gemma 3's own:

* **Sandwich norms.** A layer adds ``post_attention_layernorm(o_proj(z))`` and
  ``post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))``. The RMSNorm
  couples the heads, so a head's component is its write under the block norm's
  scale frozen at the block's own o_proj output ``a``: ``(1 + w) W_O^h z^h /
  sigma(a)``. RMSNorm does not centre, so at that frozen scale it is linear and
  the heads sum to ``norm(a)`` exactly in real arithmetic; the float32 norm's
  rounding of the write is its own component ``L{l}.attn_norm_residue`` (zero
  but for rounding), so the stack sums to x_L to float64 rounding. ``mlp_out``
  (and the "mlp" edit site) is the MLP's *write*, after its post-norm.
* **Masks.** Image tokens attend bidirectionally within their image
  (``token_type_ids == 1``), the rest is causal; sliding-window layers also
  drop keys ``sliding_window`` or more positions back. Both are in the recorded
  masks; :func:`core.models.family_adapter.allowed_by_rule` rebuilds them
  for a trace without (mask rule ``image_block``).
* **q/k norms and two RoPE bases.** Queries and keys pass a per-head ``(1 + w)``
  RMSNorm before RoPE, whose base depends on the layer type: ``rotate``
  takes the block (declared: ``per_layer="layer_type"``). Scores are scaled by ``query_pre_attn_scalar ** -0.5``.

Refused, with the reason: pan-and-scan crops (not mapped yet: each crop would be
another view), attention or final-logit soft-capping set in the config
(transformers' Gemma 3 ignores both fields, so the read-outs would follow the
library, not the checkpoint's intent) and a bidirectional text decoder.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from core.errors import ModelLoadError, QuestionError, UnsupportedArchitectureError
from core.forward.geometry import stretched_grid_tokens
from core.models.adapter import config_int
from core.models.declaration import Decoder, Mask, Rotary
from core.models.families.paligemma import PaliGemmaAdapter


class Gemma3Adapter(PaliGemmaAdapter):
    """The canonical view of a Gemma 3 model (see the module docstring)."""

    declaration = replace(
        PaliGemmaAdapter.declaration,
        name="gemma3",
        architectures=("Gemma3ForConditionalGeneration",),
        prompt="<bos><start_of_turn>user\n<start_of_image>{question}<end_of_turn>\n<start_of_turn>model\n",
        decoder=Decoder(
            norm="gemma",
            scaled_embeddings=True,
            qk_norms=("q_norm", "k_norm"),
            form="sandwich",
            sandwich=("post_attention_layernorm", "post_feedforward_layernorm"),
        ),
        rotary=Rotary(rotate_half="transformers.models.gemma3.modeling_gemma3.rotate_half", per_layer="layer_type"),
        mask=Mask("image_block", types="token_type_ids", recorded=True),
        delimiters=("config.boi_token_index", "config.eoi_token_index"),
    )
    # The processor's "image token" is <start_of_image>, which it expands; the model looks up
    # image_token_index (the soft token): range checks only here, the pairing in __init__.
    token_id_fields = (("image_token_index", True), ("boi_token_index", False), ("eoi_token_index", False))
    images_per_prompt = True
    appended_token_types = {"token_type_ids": 0}  # an appended token is text: causal

    @classmethod
    def check_config(cls, config) -> None:
        super(PaliGemmaAdapter, cls).check_config(config)  # not PaliGemma's Gemma-1-only refusal
        patch = config_int(config, "vision_config.patch_size", minimum=1, required=True)
        side = config_int(config, "vision_config.image_size", minimum=1, required=True) // patch
        tokens = config_int(config, "mm_tokens_per_image", minimum=1, required=True)
        g = round(tokens**0.5)
        if g * g != tokens or side % g:
            raise ModelLoadError(f"config.json mm_tokens_per_image {tokens}: not a square grid pooling {side}x{side}")
        text = config.get_text_config()
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(text, field, None) is not None:
                raise UnsupportedArchitectureError(
                    f"this Gemma 3 config sets {field}, which transformers' Gemma 3 does not apply: the read-outs "
                    "would reproduce the library's uncapped computation, not the checkpoint's"
                )
        if getattr(text, "use_bidirectional_attention", False):
            raise UnsupportedArchitectureError("a bidirectional Gemma 3 text decoder is not supported")

    def __init__(self, model, processor, tokenizer, config=None):
        super().__init__(model, processor, tokenizer, config)
        want = int(model.config.image_token_id)
        if getattr(processor.tokenizer, "image_token_id", want) != want:
            raise ModelLoadError(f"the processor's image soft token is not config.json image_token_index {want}")
        if int(getattr(processor, "image_seq_length", self.n_image_tokens)) != self.n_image_tokens:
            raise ModelLoadError(f"processor image_seq_length is not mm_tokens_per_image {self.n_image_tokens}")
        if getattr(processor.image_processor, "do_pan_and_scan", False):
            raise UnsupportedArchitectureError("Gemma 3 pan-and-scan crops are not mapped yet (views of crops)")

    @property
    def n_image_tokens(self) -> int:
        return int(self.model.config.mm_tokens_per_image)

    def check_fits(self, question: str, ids: list[int]) -> None:
        """The prompt with its ``<start_of_image>`` expanded as the processor does."""
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        total = len(encode(self.prompt(question))) - 1 + len(encode(self.processor.full_image_sequence))
        if total > self.max_positions():
            raise QuestionError(
                f"the question is too long: {total} tokens with the image, the model takes {self.max_positions()}"
            )

    # ---- geometry
    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """One token per pooled ``k x k`` block of ``patch`` px patches of the
        ``S x S`` stretched image (row-major), boxes in the original image."""
        side = self.resized_size()
        g = round(self.n_image_tokens**0.5)
        return stretched_grid_tokens(image_size, (side, side), (g, g), side / g, positions)
