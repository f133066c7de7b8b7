"""Gemma 3 (transformers' ``Gemma3ForConditionalGeneration``): a SigLIP tower
whose ``P x P`` patch grid is average-pooled to a ``g x g`` grid
(``g**2 = mm_tokens_per_image``), RMS-normed and projected, and a Gemma 3
decoder over ``<bos> ... \\n\\n<start_of_image>[g*g image tokens]<end_of_image>\\n\\n ...``.

PaliGemma's conventions carry over (:class:`PaliGemmaAdapter`): the ``(1 + w)``
RMSNorm in float32 (:class:`GemmaNorm`), embeddings scaled by ``sqrt(d_model)``
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
  masks; :func:`gemma3_allowed` rebuilds them for a trace without.
* **q/k norms and two RoPE bases.** Queries and keys pass a per-head ``(1 + w)``
  RMSNorm before RoPE, whose base depends on the layer type: :meth:`rotate`
  takes the block. Scores are scaled by ``query_pre_attn_scalar ** -0.5``.

Refused, with the reason: pan-and-scan crops (not mapped yet: each crop would be
another view), attention or final-logit soft-capping set in the config
(transformers' Gemma 3 ignores both fields, so the read-outs would follow the
library, not the checkpoint's intent) and a bidirectional text decoder.
"""

from __future__ import annotations

import functools

import torch

from core.errors import ModelLoadError, QuestionError, UnsupportedArchitectureError
from core.geometry import VisualToken
from core.models.adapter import Adapter, config_int
from core.models.families.paligemma import PaliGemmaAdapter
from core.precision import accumulating


def gemma3_allowed(attention_mask, token_type_ids, n_pos: int, sliding_window: int | None) -> torch.Tensor:
    """``(batch, pos, keys)`` bool, as transformers builds Gemma 3's masks:
    (causal OR both in the same image) AND the key not padding, AND on a
    sliding-window layer ``key > query - sliding_window``."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    allowed = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()[None]
    if token_type_ids is not None:
        block = get_block_sequence_ids_for_mask(token_type_ids.cpu())
        allowed = allowed | ((block[:, :, None] == block[:, None, :]) & (block[:, :, None] >= 0))
    if sliding_window is not None:
        q, k = torch.arange(n_pos).view(-1, 1), torch.arange(n_pos).view(1, -1)
        allowed = allowed & (k > q - sliding_window)
    if attention_mask is not None:
        allowed = allowed & attention_mask.cpu().bool()[:, None, :]
    return allowed


class Gemma3Adapter(PaliGemmaAdapter):
    """The canonical view of a Gemma 3 model (see the module docstring)."""

    hf_architectures = ("Gemma3ForConditionalGeneration",)

    family = "gemma3"
    frozen_convention = "final norm scale frozen at x_L; a head's write under its block's post-attention norm scale"
    fallback_prompt = "<bos><start_of_turn>user\n<start_of_image>{question}<end_of_turn>\n<start_of_turn>model\n"
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

    # ---- attention: q/k norms, per-layer RoPE, the recorded masks
    def _layer_type(self, block: int) -> str:
        return self.text_config.layer_types[block]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, block: int | None = None) -> torch.Tensor:
        """RoPE of block ``block`` (sliding-window and global layers use different bases)."""
        from transformers.models.gemma3.modeling_gemma3 import rotate_half

        if block is None:
            raise ValueError("gemma3: rotate needs the block (sliding and global layers rotate differently)")
        cos, sin = self.language_model.rotary_emb(x, positions.to(x.device).view(1, -1), self._layer_type(block))
        cos, sin = cos[0].to(x).unsqueeze(-2), sin[0].to(x).unsqueeze(-2)
        return x * cos + rotate_half(x) * sin

    def qk_gain(self, block: int) -> torch.Tensor:
        """``(d_head,)`` the product of the q and k norms' ``(1 + w)`` gains."""
        attn = self._attn(block)
        return (1 + attn.q_norm.weight) * (1 + attn.k_norm.weight)

    def queries_keys(self, trace, block: int, batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm, W_Q / W_K, the q / k norms (per head), then the layer's RoPE."""
        x = self.attn_norm(block)(trace.resid_pre[block][batch])
        attn = self._attn(block)
        q = self._norm(attn.q_norm)(torch.einsum("pm,hmd->phd", x, self.W_Q(block).to(x.dtype)))
        k = self._norm(attn.k_norm)(torch.einsum("pm,hmd->phd", x, self.W_K(block).to(x.dtype)))
        positions = self.rope_positions(trace, batch)
        return self.rotate(q, positions, block), self.rotate(k, positions, block)

    def rope_positions(self, trace, batch: int = 0) -> torch.Tensor:
        return Adapter.rope_positions(self, trace, batch)  # the recorded ids, else 0-indexed

    def allowed_keys(self, trace, block: int, batch: int = 0) -> torch.Tensor:
        """The mask block ``block`` ran with, else :func:`gemma3_allowed`."""
        if getattr(trace, "decoder_masks", {}).get(block) is not None:
            return super().allowed_keys(trace, block, batch)
        rows = slice(batch, batch + 1)
        mask = trace.attention_mask[rows] if trace.attention_mask is not None else None
        types = trace.token_type_ids[rows] if getattr(trace, "token_type_ids", None) is not None else None
        return gemma3_allowed(mask, types, trace.input_ids.shape[1], self.sliding_window(block))[0]

    def visual_delimiter_positions(self, trace, batch: int = 0) -> list[int]:
        marks = {config_int(self.model.config, f) for f in ("boi_token_index", "eoi_token_index")}
        return [i for i, t in enumerate(trace.input_ids[batch].tolist()) if t in marks]

    # ---- the sandwich norms
    def post_attention_norm(self, block: int):
        return self._norm(self.language_model.layers[block].post_attention_layernorm)

    def stream_norms(self) -> list:
        """The norm each write passes before the stream: per layer its two post-norms."""
        layers = self.language_model.layers
        return [
            (f"L{i}.{name}", self._norm(getattr(layer, name)))
            for i, layer in enumerate(layers)
            for name in ("post_attention_layernorm", "post_feedforward_layernorm")
        ]

    def describe(self) -> dict:
        return {**super().describe(), "norm_placement": "sandwich"}

    def mlp_module(self, block: int):
        """The MLP sublayer's last module: its output is the write (``mlp_out``)."""
        return self.language_model.layers[block].post_feedforward_layernorm

    def capture_hooks(self, layer: int, trace, keep_pattern: bool) -> list:
        """PaliGemma's (masks, positions), with ``mlp_out`` the post-normed MLP write
        and ``trace.norm_inputs["L{l}.post_attention_layernorm"]`` (``a``, the o_proj output)."""
        block = self.language_model.layers[layer]
        regs = [r for r in super().capture_hooks(layer, trace, keep_pattern) if r[0] is not block.mlp]

        def attn_in(module, args):
            trace.norm_inputs[f"L{layer}.post_attention_layernorm"] = args[0]

        def mlp_write(module, args, out):
            trace.mlp_out[layer] = out

        return regs + [(block.post_attention_layernorm, "pre", attn_in), (self.mlp_module(layer), "fwd", mlp_write)]

    def _attn_input(self, trace, block: int, batch: int, position: int) -> torch.Tensor:
        return trace.norm_inputs[f"L{block}.post_attention_layernorm"][batch, position]

    @torch.no_grad()
    def component_stack(self, trace, position: int, batch: int = 0) -> tuple[list[str], torch.Tensor]:
        """``embed``; per block ``L{l}.H{h}`` (the head's write at the block norm's
        frozen scale), ``bias.L{l}.attn_out`` (o_proj's bias, likewise, if any),
        ``L{l}.attn_norm_residue`` (the write minus those: the norm's float32
        rounding) and ``L{l}.mlp`` (the MLP's write). They sum to x_L."""
        names, vecs = ["embed"], [accumulating(trace.resid_pre[0][batch, position])]
        for block, name in enumerate(trace.block_names):
            a, post = self._attn_input(trace, block, batch, position), self.post_attention_norm(block)
            parts = post.frozen(a, trace.head_output(self, block, position, batch))  # (heads, d_model)
            names += [f"{name}.H{h}" for h in range(parts.shape[0])]
            b_O = self.b_O(block)
            if torch.any(b_O != 0):
                names.append(f"bias.{name}.attn_out")
                parts = torch.cat([parts, post.frozen(a, b_O.to(a.dtype))[None]])
            write = accumulating(post(a))
            names += [f"{name}.attn_norm_residue", f"{name}.mlp"]
            vecs += [*parts, write - parts.sum(0), accumulating(trace.mlp_out[block][batch, position])]
        device, dtype = trace.final_resid.device, vecs[0].dtype
        return names, torch.stack([v.to(device, dtype) for v in vecs])

    def readout_pullback(self, trace, block: int, position: int, g: torch.Tensor, batch: int = 0) -> torch.Tensor:
        """``g`` on x_L read in o_proj's output space: through the block's frozen post-norm."""
        return self.post_attention_norm(block).frozen_readout(self._attn_input(trace, block, batch, position), g)

    # ---- geometry
    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """One token per pooled ``k x k`` block of ``patch`` px patches of the
        ``S x S`` stretched image (row-major), boxes in the original image."""
        side = self.resized_size()
        g = round(self.n_image_tokens**0.5)
        cell = side / g
        sx, sy = image_size[0] / side, image_size[1] / side
        if positions is not None and len(positions) != g * g:
            raise ValueError(f"{len(positions)} visual positions for a {g}x{g} token grid")
        out = []
        for i in range(g * g):
            r, c = divmod(i, g)
            box = [c * cell * sx, r * cell * sy, (c + 1) * cell * sx, (r + 1) * cell * sy]
            out.append(VisualToken(i, None if positions is None else int(positions[i]), 0, r, c, box))
        return out
