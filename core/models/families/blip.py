"""BLIP captioning (transformers' ``BlipForConditionalGeneration``): a ViT
vision tower whose tokens (CLS first, then the patches in row-major order,
after ``post_layernorm``) are the keys and values of every cross-attention
layer of a BERT-style text decoder (``BlipTextLMHeadModel``).

The decoder is POST-LayerNorm. Layer ``l`` computes, per position::

    s = LN_self_l (h + Attn_l(h))          # self-attention, causal
    t = LN_cross_l(s + XAttn_l(s, image))  # cross-attention over the visual tokens
    h' = LN_ffn_l (t + FFN_l(t))

after ``h_0 = LN_embed(word + position)``, and the logits are
``W_U^T Transform(h_L) + b_U`` with ``Transform = LN_head(gelu(Dense(.)))``.

So x_L is not x_0 plus the block outputs (the pre-LN identity that
:func:`core.methods.residual.component_stack` assumes). This adapter makes the
read-outs exact anyway with a *frozen-scale linear bookkeeping*: with every
LayerNorm's ``1/sigma`` frozen at the value it had in the run, each LayerNorm
is the affine map ``LN(v) = F v + beta`` with ``F v = gain * center(v) / sigma``.
Propagating every addend through the frozen maps that follow it gives

    x_L = sum_i P_i c_i   (exactly, to float rounding)

over the components ``c_i``: the embedding, every self-attention head
``W_O^h z^h``, every cross-attention head, each output-projection bias, every
FFN output, and each LayerNorm's bias ``beta`` as its own ``bias.*`` component
(``P_i`` is the product of the frozen ``F`` of the LayerNorms after ``c_i``
enters the stream). :meth:`BlipAdapter.component_stack` returns the
``P_i c_i``; :meth:`BlipAdapter.readout_pullback` maps a readout direction
``g`` on x_L back to a block's output space (``P^T g``), so per-source
contributions computed from the raw head outputs read out in the same
convention.

Blocks: ``"L{l}"`` (kind "self": the self-attention sublayer) and
``"L{l}.xattn"`` (kind "cross": the cross-attention sublayer AND the FFN after
it; the FFN is reported as component ``"L{l}.mlp"``, recorded in
``trace.mlp_out`` of the cross block; the self block's ``mlp_out`` is a zero
view, since no FFN sits between self- and cross-attention). ``resid_pre`` of a
block is the stream it reads (a LayerNorm output), ``attn_out`` the output
projection's output before the residual add and its LayerNorm, and
``final_resid`` is the last layer's output h_L.

The unembedding's "final norm" is the LM head transform, not a norm: see
:class:`HeadTransform` for the frozen (linearised) and Jacobian conventions.
"""

from __future__ import annotations

import torch
from PIL import Image

from core.errors import QuestionError
from core.forward.attention_rows import WeightsRows
from core.forward.capture import on_device_of, record_pattern, run_with_hooks
from core.forward.geometry import VisualToken
from core.models.adapter import Adapter, ModelInputs, config_int, size_value
from core.models.declaration import Decoder, Family, Rotary
from core.models.family_adapter import TextConfigSizes
from core.models.norms import IdentityNorm, Norm
from core.shell.precision import accumulating, is_half


class HeadTransform:
    """BLIP's LM head transform ``T(x) = LN_h(act(D x + b_D))`` (dense, GELU,
    LayerNorm) in place of a final norm, with the interface of
    :class:`core.models.norms.Norm` that the read-outs use.

    Conventions (``x_ref = x_L``; ``y = D x_ref + b_D``; ``a = act(y)``):

    * ``__call__``: the model's own transform (the lens and the logits).
    * ``frozen`` (the head *linearised with frozen gates and scale*): the
      activation is written as a data-dependent diagonal gain,
      ``act(y) = phi * y`` with ``phi = act(y) / y`` frozen at ``y`` (for
      ``y == 0``, where any gain gives 0, ``phi = act'(0)``), and LN_h's
      ``1/sigma`` is frozen at ``a``. Then
      ``T(x_ref) = M x_ref + frozen_bias(x_ref)`` EXACTLY, with the linear map
      ``M c = gain_h * center(phi * (D c)) / sigma(a)`` and the bias
      ``frozen_bias = gain_h * center(phi * b_D) / sigma(a) + beta_h``, so
      ``sum_i u . M c_i`` over an additive split of x_ref equals
      ``u . (T(x_ref) - frozen_bias(x_ref))``. Unlike a norm's bias,
      ``frozen_bias`` depends on x_ref (the dense bias passes through the
      frozen gates and scale).
    * ``jvp`` / ``vjp``: the true Jacobian of ``T`` at x_ref,
      ``J = J_LN(a) diag(act'(y)) D``.

    Attributes:
        bias: ``(d_model,)`` LN_h's bias: the part of ``frozen_bias`` that does
            not depend on x_ref (what a norm-only read-out subtracts).
    """

    kind = "head_transform"
    weight_offset = 0.0
    compute_dtype = None

    def __init__(self, transform):
        self.transform = transform  # BlipTextPredictionHeadTransform
        self.dense = transform.dense
        self.act = transform.transform_act_fn
        ln = transform.LayerNorm
        self.ln = Norm("layernorm", ln.weight, ln.bias, ln.eps)
        self.weight = ln.weight
        self.bias = ln.bias
        self.eps = ln.eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., d_model) -> (..., d_model)``, the model's own transform; in a
        half-precision model (or on a half ``x``) the same transform in float32,
        as :class:`Norm` does: a read-out upcasts x_L and must not meet half weights."""
        if is_half(x.dtype) or is_half(self.dense.weight.dtype):
            return self.ln(self.act(self._pre(accumulating(x))))
        return self.transform(x)

    def _pre(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dense.weight.to(x.dtype), self.dense.bias.to(x.dtype))

    def _linear(self, c: torch.Tensor) -> torch.Tensor:
        return c @ self.dense.weight.to(c.dtype).T

    def act_derivative(self, y: torch.Tensor) -> torch.Tensor:
        """``act'(y)`` elementwise (autograd through the model's own activation)."""
        with torch.enable_grad():
            y = y.detach().requires_grad_(True)
            (d,) = torch.autograd.grad(self.act(y).sum(), y)
        return d

    def gate(self, x_ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(phi, a)``: the frozen activation gain ``act(y) / y`` and ``a = act(y)`` at ``x_ref``."""
        y = self._pre(accumulating(x_ref))
        a = self.act(y)
        zero = y == 0
        phi = a / torch.where(zero, torch.ones_like(y), y)
        if bool(zero.any()):
            phi = torch.where(zero, self.act_derivative(torch.zeros_like(y)), phi)
        return phi, a

    def frozen(self, x_ref: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """``M c`` ``(..., d_model)``: the head linearised at ``x_ref (d_model,)``
        with the activation gain and LN_h's scale frozen (no bias)."""
        phi, a = self.gate(x_ref)
        return self.ln.frozen(a, phi * self._linear(accumulating(c)))

    def frozen_bias(self, x_ref: torch.Tensor) -> torch.Tensor:
        """``(d_model,)``: ``T(x_ref) - M x_ref``, the dense and LayerNorm biases
        through the frozen gain and scale."""
        phi, a = self.gate(x_ref)
        return self.ln.frozen(a, phi * self.dense.bias.to(a.dtype)) + self.ln.bias.to(a.dtype)

    def frozen_readout(self, x_ref: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``M^T u``: the vector ``g`` with ``g . c == u . frozen(x_ref, c)``. ``u (..., d_model)``."""
        phi, a = self.gate(x_ref)
        return (phi * self.ln.frozen_readout(a, u)) @ self.dense.weight.to(a.dtype)

    def jvp(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``J_T(x) v`` for ``x (d_model,)``, ``v (..., d_model)``."""
        y = self._pre(accumulating(x))
        return self.ln.jvp(self.act(y), self.act_derivative(y) * self._linear(accumulating(v)))

    def vjp(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``J_T(x)^T u`` for ``x (d_model,)``, ``u (d_model,)``."""
        y = self._pre(accumulating(x))
        return (self.act_derivative(y) * self.ln.vjp(self.act(y), u)) @ self.dense.weight.to(y.dtype)


class BlipAdapter(TextConfigSizes, Adapter):
    """The canonical view of a BLIP captioning model (see the module docstring).

    Prompt: BLIP captions continue a text prefix ("a picture of"), so the
    question is used as the prefix (``config["prompt"]``, default
    ``"{question}"``, may wrap it). Tokens: the processor's BERT tokenizer
    writes ``[CLS] prefix [SEP]``; ``BlipForConditionalGeneration.generate``
    replaces the first token by the decoder's BOS (``[DEC]``) and drops the
    last one ([SEP]) before decoding. :meth:`prepare` mirrors that per row
    (dropping [SEP] where it is, so right-padded rows keep all their prefix),
    and the answer position is the last prefix token.
    """

    # Post-norm BERT blocks: the decomposition, the capture and the weights are this
    # file's own (the final norm is the head transform's LayerNorm; see HeadTransform).
    declaration = Family(
        name="blip",
        architectures=("BlipForConditionalGeneration",),
        attention="cross",
        decoder=Decoder(path=None, form="post_norm", norm="layernorm"),
        rotary=Rotary("absolute"),
        edit_sites=("z", "mlp", "knockout"),
        frozen_convention="every LayerNorm scale frozen at its value in this run; "
        "LM-head transform linearised (GELU gain frozen)",
    )
    attention_functions = False  # BLIP's text attention computes its softmax inline and returns it

    # ---- sizes (n_layers, n_heads, d_model: TextConfigSizes)
    @property
    def decoder(self):
        """``BlipTextLMHeadModel``."""
        return self.model.text_decoder

    @property
    def layers(self):
        return self.decoder.bert.encoder.layer

    def describe(self) -> dict:
        return {**super().describe(), "final_transform": "dense+gelu+layernorm", "norm_placement": "post"}

    # ---- text (the prompt: the adapter config's template, see Adapter.prompt)
    token_id_fields = (
        ("text_config.bos_token_id", True),
        ("text_config.pad_token_id", False),
        ("text_config.sep_token_id", False),
    )

    @classmethod
    def check_config(cls, config) -> None:
        """The decoder's BOS / pad / [SEP] ids and length limit, which :meth:`prepare` reads."""
        super().check_config(config)
        config_int(config, "text_config.max_position_embeddings", minimum=1, required=True)

    @property
    def _sep_id(self) -> int | None:
        sep = getattr(self.tokenizer, "sep_token_id", None)
        return sep if sep is not None else self.text_config.sep_token_id

    def check_fits(self, question: str, ids: list[int]) -> None:
        prompt_ids = self.tokenizer.encode(self.prompt(question))  # [CLS] ... [SEP]; [CLS] becomes BOS
        n = len(prompt_ids) - (1 if prompt_ids and prompt_ids[-1] == self._sep_id else 0)
        limit = int(self.text_config.max_position_embeddings)
        if n > limit:
            raise QuestionError(f"the question is too long: {n} tokens, the model takes {limit}")

    # ---- running
    def prompt_inputs(self, images: list[Image.Image], questions: list[str], raw_prompt: bool = False) -> ModelInputs:
        """One right-padded batch: ``pixel_values (batch, 3, H, W)``,
        ``input_ids`` / ``attention_mask (batch, pos)`` as ``generate`` feeds
        the decoder (BOS first, no [SEP])."""
        batch, prompts = self.processed_batch(images, questions, raw_prompt)
        ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
        ids[:, 0] = self.text_config.bos_token_id  # generate(): input_ids[:, 0] = bos_token_id
        pad = self.text_config.pad_token_id if self.text_config.pad_token_id is not None else 0
        for row, n in enumerate(mask.sum(1).tolist()):
            if n > 1 and int(ids[row, n - 1]) == self._sep_id:  # generate() drops the trailing [SEP]
                ids[row, n - 1], mask[row, n - 1] = pad, 0
        width = int(mask.sum(1).max())
        ids, mask = ids[:, :width], mask[:, :width]
        tensors = {"pixel_values": batch["pixel_values"], "input_ids": ids, "attention_mask": mask}
        last = tensors["attention_mask"].sum(dim=1) - 1
        return ModelInputs(tensors, last, tensors["input_ids"], prompts)

    # forward_logits (the base's): ``(batch, pos, vocab)``; padding is after each
    # row's last real token, so causal attention keeps it out of every real position.
    def append_token(self, inputs: ModelInputs, token_id: int) -> ModelInputs:
        if inputs.tensors["input_ids"].shape[1] + 1 > int(self.text_config.max_position_embeddings):
            raise QuestionError("the text reached the model's maximum length")
        return super().append_token(inputs, token_id)

    # ---- decoding with the cache: the text decoder itself (BlipForConditionalGeneration's
    # forward keeps no cache), reading the image tokens the prefill computed, as generate() does
    def max_positions(self) -> int:
        return int(self.text_config.max_position_embeddings)

    def end_token_ids(self) -> set[int]:
        """Also [SEP]: ``BlipForConditionalGeneration.generate`` ends a caption there."""
        sep = self._sep_id
        return super().end_token_ids() | ({int(sep)} if sep is not None else set())

    def cached_prefill(self, inputs: ModelInputs):
        t = inputs.tensors
        image = self.model.vision_model(pixel_values=t["pixel_values"]).last_hidden_state
        out = self.decoder(
            input_ids=t["input_ids"],
            attention_mask=t["attention_mask"],
            encoder_hidden_states=image,
            use_cache=True,
            return_dict=True,
        )
        return out.logits[:, -1], out.cache, image

    def cached_step(self, inputs: ModelInputs, cache, image):
        t = inputs.tensors
        step = self.decoder.prepare_inputs_for_generation(
            t["input_ids"],
            next_sequence_length=1,
            cache=cache,
            attention_mask=t["attention_mask"],
            encoder_hidden_states=image,
            use_cache=True,
        )
        out = self.decoder(**step, return_dict=True)
        return out.logits[:, -1], out.cache

    # ---- blocks: "L{l}" (self-attention) and "L{l}.xattn" (cross-attention + FFN)
    @property
    def blocks(self) -> list[tuple[str, str]]:
        out = []
        for layer in range(self.n_layers):
            out += [(f"L{layer}", "self"), (f"L{layer}.xattn", "cross")]
        return out

    def _attention(self, block: int):
        """``BlipTextAttention`` (``.self`` q/k/v, ``.output`` dense + LayerNorm) of a block."""
        layer, cross = divmod(block, 2)
        return self.layers[layer].crossattention if cross else self.layers[layer].attention

    def qk_record_hooks(self, trace, blocks: set[int]) -> list:
        """BLIP's text attention is computed inline, with no position scheme:
        the query and key projections' outputs are the q and k its scores use."""
        regs = []
        for block in blocks:
            attn = self._attention(block).self

            def q_out(module, args, out, block=block):
                trace.q[block] = out.view(*out.shape[:-1], self.n_heads, self.d_head)
                trace.score_scale[block] = self.score_scale(block)

            def k_out(module, args, out, block=block):
                trace.k[block] = out.view(*out.shape[:-1], self.n_heads, self.d_head)

            regs += [(attn.query, "fwd", q_out), (attn.key, "fwd", k_out)]
        return regs

    def _split_in(self, linear) -> torch.Tensor:
        """``(heads * d_head, d_in)`` -> ``(heads, d_in, d_head)`` (d_in: the vision width for cross k/v)."""
        return linear.weight.view(self.n_heads, self.d_head, -1).transpose(1, 2)

    def _split_bias(self, linear) -> torch.Tensor:
        return linear.bias.view(self.n_heads, self.d_head)

    def W_Q(self, block: int) -> torch.Tensor:
        return self._split_in(self._attention(block).self.query)

    def b_Q(self, block: int) -> torch.Tensor:
        return self._split_bias(self._attention(block).self.query)

    def W_K(self, block: int) -> torch.Tensor:
        """``(heads, d_in, d_head)``; cross blocks read the vision width (``encoder_hidden_size``)."""
        return self._split_in(self._attention(block).self.key)

    def b_K(self, block: int) -> torch.Tensor:
        return self._split_bias(self._attention(block).self.key)

    def W_V(self, block: int) -> torch.Tensor:
        return self._split_in(self._attention(block).self.value)

    def b_V(self, block: int) -> torch.Tensor:
        return self._split_bias(self._attention(block).self.value)

    def W_O(self, block: int) -> torch.Tensor:
        dense = self._attention(block).output.dense
        return dense.weight.view(self.d_model, self.n_heads, self.d_head).permute(1, 2, 0)

    def b_O(self, block: int) -> torch.Tensor:
        return self._attention(block).output.dense.bias

    def z_module(self, block: int):
        """The output projection ``BlipTextSelfOutput.dense``: its input is the heads' concatenated z."""
        return self._attention(block).output.dense

    def attention_module(self, block: int):
        """``BlipTextSelfAttention``: the scores, their mask and the softmax (its parent adds the
        output projection and the post-norm)."""
        return self._attention(block).self

    def _knockout_hook(self, e):
        """A self-attention block: the generic hook (its additive mask ``attention_mask``). A
        cross-attention block reads ``encoder_attention_mask`` (None: every image key, a zero
        mask made explicit ``(batch, 1, queries, keys)``), which the knockout edits instead."""
        if self.blocks[e.block][1] != "cross":
            return super()._knockout_hook(e)

        def knock(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            keys = kwargs["encoder_hidden_states"].shape[1]
            b, q = hidden.shape[0], hidden.shape[1]
            mask = kwargs.get("encoder_attention_mask")
            if mask is None:
                mask = torch.zeros(b, 1, q, keys, dtype=hidden.dtype, device=hidden.device)
            mask = e.knock(mask.expand(b, self.n_heads, q, keys))
            return args, {**kwargs, "encoder_attention_mask": mask}

        return knock

    def attn_norm(self, block: int):
        """Identity: post-LN, queries read the stream (already a LayerNorm's output)."""
        return IdentityNorm()

    def kv_norm(self, block: int):
        """Identity: self-attention reads the stream, cross-attention the vision tower's output."""
        return IdentityNorm()

    @staticmethod
    def _norm(ln) -> Norm:
        return Norm("layernorm", ln.weight, ln.bias, ln.eps)

    def final_norm_layer(self) -> HeadTransform:
        """The LM head transform (dense, GELU, LayerNorm): see :class:`HeadTransform`."""
        return HeadTransform(self.decoder.cls.predictions.transform)

    @property
    def W_U(self) -> torch.Tensor:
        """``(d_model, vocab)``, tied to the word embeddings."""
        return self.decoder.cls.predictions.decoder.weight.T

    @property
    def b_U(self) -> torch.Tensor:
        return self.decoder.cls.predictions.decoder.bias

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, block: int | None = None) -> torch.Tensor:
        """Identity: absolute positions are added at the embedding."""
        return x

    # ---- the LayerNorms of the stream, in order (the frozen bookkeeping walks them)
    def stream_norms(self) -> list[tuple[str, Norm]]:
        """``[(key, Norm)]``: ``embed.ln`` then per layer ``L{l}.ln_self``,
        ``L{l}.ln_cross``, ``L{l}.ln_ffn``; ``trace.norm_inputs[key]``
        ``(batch, pos, d_model)`` holds each one's input."""
        out = [("embed.ln", self._norm(self.decoder.bert.embeddings.LayerNorm))]
        for layer, mod in enumerate(self.layers):
            out += [
                (f"L{layer}.ln_self", self._norm(mod.attention.output.LayerNorm)),
                (f"L{layer}.ln_cross", self._norm(mod.crossattention.output.LayerNorm)),
                (f"L{layer}.ln_ffn", self._norm(mod.output.LayerNorm)),
            ]
        return out

    # ---- capture: hooks around the library's forward (visual_positions: the base's, none
    # in the text sequence)
    def run_capture(self, inputs: ModelInputs, trace, keep: set[int]) -> None:
        """Hooks around the library's forward; also records every stream
        LayerNorm's input as ``trace.norm_inputs`` (the frozen bookkeeping needs
        each ``sigma``)."""

        trace.norm_inputs = {}
        run_with_hooks(self, inputs, trace, keep)
        for block, (_, kind) in enumerate(self.blocks):
            if kind == "self":  # no FFN between self- and cross-attention: a zero view, no memory
                r = trace.resid_pre[block]
                trace.mlp_out[block] = r.new_zeros(()).expand_as(r)

    def capture_hooks(self, block: int, trace, keep_pattern: bool) -> list:
        layer, cross = divmod(block, 2)
        mod = self.layers[layer]
        attn = self._attention(block)
        norms = trace.norm_inputs

        def z_in(module, args):
            x = args[0]
            trace.z[block] = x.view(*x.shape[:-1], self.n_heads, self.d_head)

        def attn_out(module, args, out):
            trace.attn_out[block] = out

        def pattern(module, args, out):
            record_pattern(trace, block, WeightsRows(out[1]))

        def norm_in(key):
            def fn(module, args):
                norms[key] = args[0]

            return fn

        regs = [(attn.output.dense, "pre", z_in)]
        if trace.keep_attn_out:
            regs.append((attn.output.dense, "fwd", attn_out))
        if cross:

            def resid_pre(module, args, kwargs):
                trace.resid_pre[block] = on_device_of(module, args[0] if args else kwargs["hidden_states"])
                trace.kv_source[block] = kwargs["encoder_hidden_states"]

            def mlp_out(module, args, out):
                trace.mlp_out[block] = out

            regs += [
                (attn, "pre_kw", resid_pre),
                (attn.output.LayerNorm, "pre", norm_in(f"L{layer}.ln_cross")),
                (mod.output.dense, "fwd", mlp_out),
                (mod.output.LayerNorm, "pre", norm_in(f"L{layer}.ln_ffn")),
            ]
        else:

            def resid_pre(module, args, kwargs):
                trace.resid_pre[block] = on_device_of(module, args[0] if args else kwargs["hidden_states"])

            regs += [(mod, "pre_kw", resid_pre), (attn.output.LayerNorm, "pre", norm_in(f"L{layer}.ln_self"))]
        if keep_pattern:
            regs.append((attn.self, "fwd", pattern))
        return regs

    def final_hooks(self, trace) -> list:
        def embed_in(module, args):
            trace.norm_inputs["embed.ln"] = args[0]

        def final(module, args):
            trace.final_resid = on_device_of(module, args[0])

        return [(self.decoder.bert.embeddings.LayerNorm, "pre", embed_in), (self.decoder.cls, "pre", final)]

    # ---- the frozen-scale bookkeeping
    @staticmethod
    def _norm_inputs(trace) -> dict:
        ni = getattr(trace, "norm_inputs", None)
        if not ni:
            raise ValueError("this trace has no LayerNorm inputs: capture it with the BLIP adapter's run_capture")
        return ni

    @torch.no_grad()
    def component_stack(self, trace, position: int, batch: int = 0) -> tuple[list[str], torch.Tensor]:
        """Names and ``(n_components, d_model)`` vectors that sum to x_L
        (``trace.final_resid[batch, position]``) exactly: every addend of the
        stream propagated through the frozen-scale LayerNorms after it.

        Components, in stream order: ``embed`` (word + position embedding
        through the embedding LayerNorm), ``bias.embed.ln``; per layer
        ``L{l}.H{h}``, ``bias.L{l}.attn_out`` (the self output projection's
        bias), ``bias.L{l}.ln_self``, ``L{l}.xattn.H{h}``,
        ``bias.L{l}.xattn.attn_out``, ``bias.L{l}.ln_cross``, ``L{l}.mlp``
        (the FFN's output, its biases included), ``bias.L{l}.ln_ffn``.
        """
        ni = self._norm_inputs(trace)
        norms = dict(self.stream_norms())
        p = int(position)
        names: list[str] = []
        stack = None  # (n, d_model): the components so far, as they are in the stream now

        def add(new_names, new_vecs):
            nonlocal stack
            names.extend(new_names)
            new = new_vecs if new_vecs.ndim == 2 else new_vecs[None]
            stack = new if stack is None else torch.cat([stack, new.to(stack.dtype)])

        def through(key):
            nonlocal stack
            norm = norms[key]
            x = ni[key][batch, p]
            stack = norm.frozen(x, stack)
            add([f"bias.{key}"], norm.bias.to(stack.dtype))

        e = ni["embed.ln"][batch, p]
        add(["embed"], e)
        through("embed.ln")
        for block, (name, kind) in enumerate(self.blocks):
            layer = block // 2
            heads = trace.head_output(self, block, p, batch)  # (heads, d_model)
            add([f"{name}.H{h}" for h in range(heads.shape[0])], heads)
            add([f"bias.{name}.attn_out"], self.b_O(block).to(heads.dtype))
            if kind == "self":
                through(f"L{layer}.ln_self")
            else:
                through(f"L{layer}.ln_cross")
                add([f"L{layer}.mlp"], trace.mlp_out[block][batch, p])
                through(f"L{layer}.ln_ffn")
        return names, stack

    def _norms_after(self, block: int, output: str) -> list[str]:
        """Keys of the stream LayerNorms that a block's output passes, in order."""
        keys = [k for k, _ in self.stream_norms()]
        layer, cross = divmod(block, 2)
        first = f"L{layer}.ln_ffn" if output == "mlp" else (f"L{layer}.ln_cross" if cross else f"L{layer}.ln_self")
        if output == "mlp" and not cross:
            raise ValueError(f"block {block} (self-attention) has no FFN; the FFN is in the cross block")
        return keys[keys.index(first) :]

    @torch.no_grad()
    def readout_pullback(
        self, trace, block: int, position: int, g: torch.Tensor, batch: int = 0, output: str = "attn"
    ) -> torch.Tensor:
        """Map readout directions on x_L back to a block's output space.

        Args:
            g: ``(..., d_model)`` directions on x_L (final_resid at ``position``).
            output: "attn" (the output projection's output, as in
                ``trace.attn_out``; default) or "mlp" (the FFN of a cross block).

        Returns:
            ``(..., d_model)`` ``P^T g`` with ``P`` the frozen-scale LayerNorm
            maps between the block's output and x_L: for every output ``c`` at
            ``position``, ``P^T g . c == g . (c's component of x_L)``.
        """
        ni = self._norm_inputs(trace)
        norms = dict(self.stream_norms())
        p = int(position)
        for key in reversed(self._norms_after(block, output)):
            g = norms[key].frozen_readout(ni[key][batch, p], g)
        return g

    # ---- geometry: BlipImageProcessor stretches to (height, width), no crop
    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """The cross-attention keys, in key order: index 0 is the vision tower's
        CLS token (``row = col = -1``, the whole image as its box: it pools
        every patch), then the patches row-major (index ``1 + row * cols + col``),
        boxes in the original image (``image_size = (width, height)``) after
        undoing the processor's aspect-changing resize. ``position`` is None
        (keys, not sequence positions)."""

        ip = self.processor.image_processor
        if getattr(ip, "do_center_crop", False) or getattr(ip, "do_pad", False):
            raise NotImplementedError("BLIP geometry is mapped for the plain resize (no crop, no pad)")
        height, width = size_value(ip.size, "height"), size_value(ip.size, "width")
        patch = self.model.config.vision_config.patch_size
        patch = patch[0] if isinstance(patch, (tuple, list)) else patch
        w, h = image_size
        sx, sy = w / width, h / height
        tokens = [VisualToken(0, None, 0, -1, -1, [0.0, 0.0, float(w), float(h)])]
        for r in range(height // patch):
            for c in range(width // patch):
                x0, y0 = c * patch, r * patch
                box = [x0 * sx, y0 * sy, (x0 + patch) * sx, (y0 + patch) * sy]
                tokens.append(VisualToken(len(tokens), None, 0, r, c, box))
        return tokens

    def cross_key_roles(self, trace, block: int, batch: int = 0) -> list[str]:
        """One role per key of a cross block: "visual_global" (CLS, no patch) then "visual"."""
        n = trace.kv_source[block].shape[1]
        return ["visual_global"] + ["visual"] * (n - 1)
