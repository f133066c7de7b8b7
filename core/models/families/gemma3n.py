"""Gemma 3n (transformers' ``Gemma3nForConditionalGeneration``): a MobileNetV5
(timm) vision tower whose fused 2048-channel map is pooled to a fixed ``g x g``
grid of soft tokens (``g**2 = vision_soft_tokens_per_image``, 256 real), each
embedded by ``embed_vision`` (soft norm, projection, a gain-free norm: unit RMS),
over a decoder that is not one additive residual stream:

* **AltUp.** The decoder carries 4 streams. Each layer mixes them with
  token-dependent coefficients (predict), runs its sublayers on the predicted
  stream 0 and corrects all 4 streams with a token-dependent gain of what the
  sublayers changed; per-layer inputs (an embedding per layer and token) are
  added to streams 1..3. The final norm reads the model's own combination of
  the 4 streams: stream ``i > 0`` through ``altup_unembed_projections[i - 1]``,
  magnitude-matched to stream 0, then the mean of the 4
  (:meth:`Gemma3nAdapter.read_stream`, the decoder's own end replayed op for op).
* **A layer.** ``a = pred_0``; ``x = input_layernorm(a)``; LAuReL
  ``x + norm(W_r W_l x)``; ``h1 = (a + post_attention_layernorm(o_proj(z)) +
  laurel) / sqrt(2)``; ``h2 = h1 + post_feedforward_layernorm(mlp(pre_ff(h1)))``.
  The MLP's first layers threshold their gate per token (mean + 1.645 std).
* **Attention.** q, k and v are RMS-normalised per head (v without a gain), the
  scores are not scaled (``scaling = 1``); sliding and full layers rotate with
  their own RoPE base; the mask is plain causal (+ the window), image tokens
  included. The last ``num_kv_shared_layers`` layers have no k / v projection:
  they reuse the keys and values of the last earlier layer of their type (its
  input, not theirs), in every forward.
* **Logits** are soft-capped: ``c tanh(W_U norm(x_L) / c)``,
  ``c = final_logit_softcapping`` (declared: the lens applies it); W_U is tied
  to the unscaled token embeddings.

What the trace holds (so what reads it means):

* ``resid_pre[l]``: the stream the unembedding would read at block ``l``'s
  input, i.e. :meth:`Gemma3nAdapter.read_stream` of the 4 streams entering the
  block (the model's own final combination); ``final_resid`` is the final
  norm's input (the same combination after the last layer). The **logit lens**
  reads these through the final norm, W_U and the soft-cap: row ``l`` is what
  the model would predict were the decoder cut before block ``l``; its last row
  is the model's logits.
* ``norm_inputs["L{l}.input_layernorm"]``: the predicted stream 0 each
  attention reads (normed); :meth:`Gemma3nAdapter.queries_keys` recomputes q
  from it and k from the key-producing layer's.
* ``z`` (o_proj's input), ``attn_out`` (o_proj's output), ``mlp_out`` (the MLP's
  write, after ``post_feedforward_layernorm``); edit sites ``z``, ``mlp`` and
  ``knockout`` act on exactly these.

Refused, in one line with the reason: the residual decomposition and every
read-out built on it (DLA, source contributions, component reconstruction:
x_L is no sum of sublayer writes); the linear value map ``W_V`` (the values pass
a per-head norm); ``W_K`` of a KV-sharing layer (it has none: its keys are its
producer's); the ``resid`` edit site (a layer's input is 4 streams, not
``resid_pre``); the ``vision_out`` / ``projector_out`` sites (``embed_vision``
runs twice per forward, for the vision vocabulary's hard tokens and for the
image). Ids of the vision and audio vocabularies (``<end_of_image>`` and the
like) are embedded by their embedders' hard-token path, not by ``W_E sqrt(d)``
(``input_embeddings`` holds the text rows' embedding).
"""

from __future__ import annotations

import math
from functools import cached_property

import torch

from core.errors import InterventionError, ModelLoadError, QuestionError, UndefinedReadoutError
from core.forward.capture import on_device_of
from core.forward.geometry import stretched_grid_tokens
from core.models.adapter import config_int, size_value
from core.models.declaration import Decoder, Family, Mask, Rotary
from core.models.family_adapter import FamilyAdapter, pattern_hook
from core.models.norms import Norm

NO_DECOMPOSITION = (
    "the final norm reads a magnitude-matched average of {n} AltUp streams mixed by input-dependent "
    "coefficients, not a sum of sublayer writes: x_L has no additive decomposition (residual decomposition, "
    "DLA, source contributions, component reconstruction)"
)
NO_VALUE_MAP = (
    "no linear value map W_V: each value is v_proj's output RMS-normalised per head (v_norm, no gain), so the "
    "value path, source contributions and OV circuits are not linear in the stream"
)


class Gemma3nNorm(Norm):
    """``Gemma3nRMSNorm`` as the model computes it: ``x * pow(mean(x^2) + eps, -0.5)``
    and the gain ``w`` (not ``1 + w``; none where the module has no weight) in
    float32, then cast back to the input's dtype."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            y = y * self.weight.to(x.device).float()
        return y.type_as(x)


class Gemma3nAdapter(FamilyAdapter):
    """The canonical view of a Gemma 3n model (see the module docstring)."""

    declaration = Family(
        name="gemma3n",
        architectures=("Gemma3nForConditionalGeneration",),
        prompt="<bos><start_of_turn>user\n<image_soft_token>{question}<end_of_turn>\n<start_of_turn>model\n",
        decoder=Decoder(
            scaled_embeddings=True,
            qk_norms=("q_norm", "k_norm"),
            form="sandwich",
            sandwich=("post_attention_layernorm", "post_feedforward_layernorm"),
            logit_softcap="final_logit_softcapping",
        ),
        rotary=Rotary(rotate_half="transformers.models.gemma3n.modeling_gemma3n.rotate_half", per_layer="layer_type"),
        mask=Mask("causal"),
        delimiters=("config.boi_token_id", "config.eoi_token_id"),
        edit_sites=("z", "mlp", "knockout"),
        projector="model.embed_vision",
        no_visual_sites="embed_vision runs twice per forward (the vision vocabulary's hard tokens, then the image)",
        frozen_convention="none: no frozen-scale DLA (AltUp streams)",
    )
    token_id_fields = (("image_token_id", True), ("boi_token_id", False), ("eoi_token_id", False))
    images_per_prompt = True
    appended_token_types = {"token_type_ids": 0}  # ignored by the model; kept the processor's length

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        tokens = config_int(config, "vision_soft_tokens_per_image", minimum=1, required=True)
        g = round(tokens**0.5)
        if g * g != tokens:
            raise ModelLoadError(f"config.json vision_soft_tokens_per_image {tokens}: not a square grid")
        text = config.get_text_config()
        config_int(text, "altup_num_inputs", minimum=1, required=True)

    def __init__(self, model, processor, tokenizer, config=None):
        super().__init__(model, processor, tokenizer, config)
        if int(getattr(processor, "image_seq_length", self.n_image_tokens)) != self.n_image_tokens:
            raise ModelLoadError(
                f"processor image_seq_length is not config.json vision_soft_tokens_per_image {self.n_image_tokens}"
            )

    @property
    def n_image_tokens(self) -> int:
        return int(self.model.config.vision_soft_tokens_per_image)

    def check_fits(self, question: str, ids: list[int]) -> None:
        """The prompt with its image placeholder expanded as the processor does."""
        encode = self.tokenizer.encode
        total = len(encode(self.prompt(question), add_special_tokens=False)) - 1
        total += len(encode(self.processor.full_image_sequence, add_special_tokens=False))
        if total > self.max_positions():
            raise QuestionError(
                f"the question is too long: {total} tokens with the image, the model takes {self.max_positions()}"
            )

    # ---- norms: Gemma3nRMSNorm (gain w, pow(-0.5), float32)
    def _norm(self, module) -> Norm:
        return Gemma3nNorm("rmsnorm", getattr(module, "weight", None), None, module.variance_epsilon)

    # ---- AltUp: the stream the unembedding reads
    @property
    def n_streams(self) -> int:
        return int(self.text_config.altup_num_inputs)

    def read_stream(self, streams: torch.Tensor) -> torch.Tensor:
        """``(n_streams, ..., d_model) -> (..., d_model)``: what the final norm would
        read of these streams, the decoder's own end op for op: stream ``i > 0``
        through ``altup_unembed_projections[i - 1]``, rescaled to stream 0's RMS
        (the projection's mean square clamped at 1e-5), then the mean of all."""
        lm = self.language_model
        first = streams[0]
        target = torch.mean(first**2, dim=-1, keepdim=True) ** 0.5
        parts = [first]
        for i in range(1, self.n_streams):
            projected = lm.altup_unembed_projections[i - 1](streams[i]).to(dtype=first.dtype, device=target.device)
            magnitude = torch.sqrt(torch.mean(projected**2, dim=-1, keepdim=True).clamp(min=1e-5))
            parts.append(projected * target / magnitude)
        return torch.mean(torch.stack(parts), dim=0)

    # ---- KV sharing
    @cached_property
    def _kv_producers(self) -> list[int]:
        """Per layer, the layer whose keys and values it attends with (itself, or
        for a KV-sharing layer the last earlier non-sharing layer of its type)."""
        modes = list(self.text_config.kv_sharing_modes)
        types = self.text_config.layer_types
        own = [i for i, mode in enumerate(modes) if mode != "reuse"]
        out = []
        for i, mode in enumerate(modes):
            producer = i if mode != "reuse" else max(j for j in own if types[j] == types[i])
            if producer != i and modes[producer] != "store":
                raise ModelLoadError(f"layer {i} reuses the keys of layer {producer}, which does not store them")
            out.append(producer)
        return out

    def kv_producer(self, block: int) -> int:
        """The layer whose keys and values block ``block`` attends with."""
        return self._kv_producers[block]

    def W_K(self, layer: int) -> torch.Tensor:
        producer = self.kv_producer(layer)
        if producer != layer:
            raise UndefinedReadoutError(
                f"{self.family}: L{layer} has no k_proj: it attends with L{producer}'s keys (KV sharing), which "
                f"L{producer} computed from its own input; read W_K({producer})"
            )
        return super().W_K(layer)

    def b_K(self, layer: int) -> torch.Tensor:
        self.W_K(layer)
        return super().b_K(layer)

    def W_V(self, layer: int) -> torch.Tensor:
        raise UndefinedReadoutError(f"{self.family}: {NO_VALUE_MAP}")

    def b_V(self, layer: int) -> torch.Tensor:
        raise UndefinedReadoutError(f"{self.family}: {NO_VALUE_MAP}")

    def k_norm(self, block: int) -> Norm:
        """The per-head norm block ``block``'s keys passed (its producer's)."""
        return self._norm(self._part(self.kv_producer(block), "k_norm"))

    def kv_norm(self, block: int):
        raise UndefinedReadoutError(
            f"{self.family}: keys and values read the AltUp-predicted stream 0 "
            f"(trace.norm_inputs['L{block}.input_layernorm']), not resid_pre; {NO_VALUE_MAP}"
        )

    # ---- capture
    def capture_hooks(self, layer: int, trace, keep_pattern: bool) -> list:
        """``resid_pre``: :meth:`read_stream` of the 4 streams entering the layer;
        ``norm_inputs["L{l}.input_layernorm"]``: the predicted stream 0 attention
        reads; ``norm_inputs["L{l}.post_attention_layernorm"]``: o_proj's output;
        ``z`` (o_proj's input), ``attn_out`` on request, ``mlp_out`` (the MLP's
        write after its post-norm), the eager pattern on request."""
        block = self._layer(layer)
        attn = self._attn(layer)

        def resid_pre(module, args, kwargs):
            streams = args[0] if args else kwargs["hidden_states"]
            trace.resid_pre[layer] = on_device_of(block, self.read_stream(streams))

        def attention_input(module, args):
            trace.norm_inputs[f"L{layer}.input_layernorm"] = args[0]

        def post_attention_input(module, args):
            trace.norm_inputs[f"L{layer}.post_attention_layernorm"] = args[0]

        def z_in(module, args):
            x = args[0]
            trace.z[layer] = x.view(*x.shape[:-1], self.n_heads, self.d_head)

        def attn_out(module, args, out):
            trace.attn_out[layer] = out

        def mlp_out(module, args, out):
            trace.mlp_out[layer] = out

        regs = [
            (block, "pre_kw", resid_pre),
            (block.input_layernorm, "pre", attention_input),
            (block.post_attention_layernorm, "pre", post_attention_input),
            (attn.o_proj, "pre", z_in),
            (self.mlp_module(layer), "fwd", mlp_out),
        ]
        if trace.keep_attn_out:
            regs.append((attn.o_proj, "fwd", attn_out))
        if keep_pattern:
            regs.append((attn, "fwd", pattern_hook(trace, layer)))
        return regs

    def attention_input(self, trace, block: int, batch: int = 0) -> torch.Tensor:
        """``(pos, d_model)``: what block ``block``'s attention read, ``input_layernorm(pred_0)``."""
        return self.attn_norm(block)(trace.norm_inputs[f"L{block}.input_layernorm"][batch])

    def queries_keys(self, trace, block: int, batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries from this block's input (the normed predicted stream 0: W_Q, q
        norm, the block's rotation); keys from its key producer's input (W_K, k
        norm, the same rotation: the producer is of the block's type)."""
        producer = self.kv_producer(block)
        x = self.attention_input(trace, block, batch)
        xk = x if producer == block else self.attention_input(trace, producer, batch)
        q = self.q_norm(block)(torch.einsum("pm,hmd->phd", x, self.W_Q(block).to(x.dtype)))
        k = self.k_norm(block)(torch.einsum("pm,hmd->phd", xk, super().W_K(producer).to(x.dtype)))
        positions = self.rope_positions(trace, batch)
        return self.rotate(q, positions, block), self.rotate(k, positions, block)

    def query_extras(self, block: int) -> str | None:
        return "q/k norms; a KV-sharing layer's keys are its producer's"

    # ---- what is refused
    def component_stack(self, trace, position: int, batch: int = 0):
        raise UndefinedReadoutError(f"{self.family}: {NO_DECOMPOSITION.format(n=self.n_streams)}")

    def readout_pullback(self, trace, block: int, position: int, g: torch.Tensor, batch: int = 0) -> torch.Tensor:
        raise UndefinedReadoutError(f"{self.family}: {NO_DECOMPOSITION.format(n=self.n_streams)}")

    def check_edits(self, edits) -> None:
        for e in edits:
            if e.site == "resid":
                raise InterventionError(
                    f"{self.family}: no 'resid' edit site: a layer's input is {self.n_streams} AltUp streams, and "
                    "resid_pre (the stream the unembedding would read) is no layer's input"
                )
        super().check_edits(edits)

    def describe(self) -> dict:
        return {**super().describe(), "altup_streams": self.n_streams}

    # ---- geometry
    def resized_size(self) -> int:
        """``S``: the square side the processor stretches every image to (no crop, no pad)."""
        ip = self.processor.image_processor
        h, w = size_value(ip.size, "height"), size_value(ip.size, "width")
        if not getattr(ip, "do_resize", True) or h is None or h != w:
            raise ValueError(f"Gemma 3n geometry is mapped for a resize to a square, not processor size {ip.size}")
        if getattr(ip, "do_center_crop", False) or getattr(ip, "do_pad", False):
            raise ValueError("Gemma 3n geometry is mapped for a plain resize (no crop, no pad)")
        return int(h)

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """One token per cell of the ``g x g`` pooled map over the ``S x S``
        stretched image (row-major), boxes in the original image. Nominal cells:
        the tower's stride-2 "same" convolutions pad bottom / right, so a token
        also reads about a cell up / left and far down / right, and its
        attention blocks mix globally."""
        side = self.resized_size()
        g = math.isqrt(self.n_image_tokens)
        return stretched_grid_tokens(image_size, (side, side), (g, g), side / g, positions)
