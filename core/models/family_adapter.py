"""The one generic adapter: a family's :class:`core.models.declaration.Family`
turned into canonical weights, norms, capture hooks, edit sites, RoPE, masks
and the residual graph of its block form.

A family subclasses :class:`FamilyAdapter` with ``declaration = Family(...)``;
everything here reads the declaration, so the hook code, the weight split and
the sandwich-norm decomposition live once. What a family still writes: its
geometry (``visual_tokens``) and the vision path edits reach (``vision_features``),
checks of the config fields it reads, and overrides where its computation
truly differs (Mllama's gated cross-attention, Qwen's M-RoPE position ids).
"""

from __future__ import annotations

import importlib
from functools import cached_property
from operator import attrgetter
from typing import ClassVar

import torch

from core.errors import InterventionError, QuestionError, UndefinedReadoutError
from core.forward.attention_rows import WeightsRows
from core.forward.capture import on_device_of, record_pattern
from core.models.adapter import Adapter, ModelInputs, config_int, config_value
from core.models.declaration import Family
from core.models.norms import CohereNorm, GemmaNorm, Norm
from core.shell.precision import accumulating


def pattern_hook(trace, layer: int):
    """A forward hook on an eager attention module that gives block ``layer``'s
    weights ``(batch, heads, queries, keys)`` to :func:`core.forward.capture.record_pattern`."""

    def pattern(module, args, out):
        weights = out[1]
        if weights is None:
            raise RuntimeError("attention weights missing: the model is not running eager attention")
        record_pattern(trace, layer, WeightsRows(weights))

    return pattern


def image_block_ids(token_type_ids: torch.Tensor) -> torch.Tensor:
    """``(batch, pos)``: the index of each contiguous run of typed (``!= 0``)
    tokens, -1 elsewhere (one image's tokens share an id), as transformers' Gemma 3."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    return get_block_sequence_ids_for_mask(token_type_ids.cpu())


def allowed_by_rule(
    rule: str, attention_mask, token_type_ids, n_pos: int, sliding_window: int | None = None
) -> torch.Tensor:
    """``(batch, pos, keys)`` bool, as transformers builds the mask of ``rule``
    (:data:`core.models.declaration.MASK_RULES`): (causal OR the rule's
    bidirectional pairs) AND, on a sliding-window layer, ``key > query - window``
    AND the key not padding. Without ``token_type_ids`` the rule is causal."""
    batch = next((t.shape[0] for t in (attention_mask, token_type_ids) if t is not None), 1)
    allowed = torch.ones(n_pos, n_pos, dtype=torch.bool).tril().expand(batch, -1, -1)
    if token_type_ids is not None and rule != "causal":
        types = token_type_ids.cpu()
        if rule == "prefix":
            both = (types == 0)[:, :, None] & (types == 0)[:, None, :]
        elif rule == "image_tokens":
            both = (types == 1)[:, :, None] & (types == 1)[:, None, :]
        else:  # image_block
            block = image_block_ids(types)
            both = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] >= 0)
        allowed = allowed | both
    if sliding_window is not None:
        q, k = torch.arange(n_pos).view(-1, 1), torch.arange(n_pos).view(1, -1)
        allowed = allowed & (k > q - sliding_window)
    if attention_mask is not None:
        allowed = allowed & attention_mask.cpu().bool()[:, None, :]
    return allowed


class TextConfigSizes:
    """The sizes of a decoder described by the model config's ``text_config``."""

    @property
    def text_config(self):
        return self.model.config.text_config

    @property
    def n_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def n_heads(self) -> int:
        return self.text_config.num_attention_heads

    @property
    def d_model(self) -> int:
        return self.text_config.hidden_size


class FamilyAdapter(TextConfigSizes, Adapter):
    """The canonical view of a decoder described by :attr:`declaration`."""

    declaration: ClassVar[Family]
    forward_options = {"use_cache": False}  # one full run: no key / value cache

    # ---- the config and the prompt
    @classmethod
    def check_config(cls, config) -> None:
        """The image token id (the model finds its image by it) and the length
        limit the adapter reads must be integers."""
        super().check_config(config)
        config_int(config, "image_token_id", required=True)
        text = "text_config." if getattr(config, "text_config", None) is not None else ""
        config_int(config, f"{text}max_position_embeddings", minimum=1)

    def max_positions(self) -> int:
        """The decoder's position limit (10**9 when the config sets none)."""
        return int(getattr(self.text_config, "max_position_embeddings", None) or 10**9)

    def check_fits(self, question: str, ids: list[int]) -> None:
        """QuestionError for a prompt whose own tokens cannot fit the decoder;
        where the image's token count follows its size, :meth:`prepare` checks
        the real total (:meth:`Adapter.batch_inputs`)."""
        total = len(self.tokenizer.encode(self.prompt(question), add_special_tokens=False))
        if total > self.max_positions():
            raise QuestionError(f"the question is too long: {total} tokens, the model takes {self.max_positions()}")

    @property
    def prompt_field(self) -> str:
        return "chat_template" if getattr(self.processor, "chat_template", None) else f"{self.family} fallback prompt"

    def prompt(self, question: str) -> str:
        """The processor's chat template rendered for one user turn holding the
        image then the question, with the generation prompt; the family's
        fallback prompt when the processor has no template.
        QuestionError naming ``chat_template`` if the template does not render."""
        conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        if getattr(self.processor, "chat_template", None):
            try:
                return self.processor.apply_chat_template(conversation, add_generation_prompt=True)
            except Exception as e:  # the template is data from the model folder: any Jinja error or raise
                first = (str(e).splitlines() or [""])[0][:300]
                raise QuestionError(f"chat_template: cannot render the prompt ({type(e).__name__}: {first})") from None
        return self.fallback_prompt.format(question=question)

    # ---- the module map
    @property
    def language_model(self):
        return attrgetter(self.declaration.decoder.path)(self.model)

    @property
    def lm_head(self) -> torch.nn.Module:
        """The unembedding module (``W_U`` / ``b_U`` are its weight and bias)."""
        return attrgetter(self.declaration.decoder.unembed)(self.model)

    def _layer(self, block: int):
        return self.language_model.layers[block]

    def _attn(self, block: int):
        if self.mixer(block) is not None:
            raise UndefinedReadoutError(self.no_pattern(block))
        return getattr(self._layer(block), self.declaration.decoder.attention)

    # ---- hybrid decoders: layers whose token mixer is not attention (Decoder.mixers)
    @cached_property
    def _mixers(self) -> list:
        """Per layer its :class:`core.models.declaration.Mixer`, None for attention."""
        declared = {m.layer_type: m for m in self.declaration.decoder.mixers}
        if not declared:
            return [None] * self.n_layers
        types = getattr(self.text_config, "layer_types", None) or []
        return [declared.get(types[i]) if i < len(types) else None for i in range(self.n_layers)]

    def mixer(self, block: int):
        return self._mixers[block]

    def mixer_module(self, block: int):
        """Block ``block``'s token mixer without attention (its output is the layer's first write)."""
        mixer = self.mixer(block)
        if mixer is None:
            raise ValueError(f"{self.blocks[block][0]} attends: it has no mixer")
        return getattr(self._layer(block), mixer.module)

    @property
    def blocks(self) -> list[tuple[str, str]]:
        """One block per layer: "self" for attention, the mixer's kind for a layer without."""
        return [(f"L{layer}", "self" if mixer is None else mixer.kind) for layer, mixer in enumerate(self._mixers)]

    @cached_property
    def first_attention_block(self) -> int:
        """The first layer that attends (where the shared attention sizes are read)."""
        return next(b for b, mixer in enumerate(self._mixers) if mixer is None)

    # ---- mixture-of-experts MLPs (a family that has them overrides moe_experts / expert_writes)
    def expert_writes(self, block: int, x: torch.Tensor, expert: int | None = None) -> list[tuple[str, torch.Tensor]]:
        """``[(name, (n, d_model))]``: for MLP inputs ``x (n, d_model)`` (what the MoE
        module reads), each part of its write: ``L{l}.E{e}`` the routed expert ``e``'s
        output times its router weight (zero rows where the token is not routed to it),
        ``L{l}.shared_expert`` where the family has one. ``expert``: that routed
        expert's part only. They sum to the module's output up to rounding."""
        raise NotImplementedError(f"{self.family}: block {block} has no experts")

    def expert_parts_at(self, trace, block: int, position: int, batch: int = 0) -> list[tuple[str, torch.Tensor]]:
        """``[(name, (d_model,))]``: :meth:`expert_writes` of the MoE module's recorded input at
        ``position`` (a family whose router rounds differently row by row overrides it)."""
        x = trace.mlp_in[block][batch, position][None]
        return [(n, v[0]) for n, v in self.expert_writes(block, x)]

    def mlp_components(self, trace, block: int, position: int, batch: int = 0) -> list[tuple[str, torch.Tensor]]:
        """A dense MLP: ``L{l}.mlp``. A mixture of experts: the routed experts'
        writes at ``position`` (the ones its router chose) and the shared expert,
        then ``L{l}.experts_residue``: the MLP's write minus those (the order of the
        model's own sum: zero but for rounding), so the stack still sums to x_L."""
        if not self.moe_experts(block):
            return super().mlp_components(trace, block, position, batch)
        name = trace.block_names[block]
        parts = self.expert_parts_at(trace, block, position, batch)
        chosen = [(n, v) for n, v in parts if torch.any(v != 0) or not n.startswith(f"{name}.E")]
        residue = accumulating(trace.mlp_out[block][batch, position]) - sum(accumulating(v) for _, v in parts)
        return [*chosen, (f"{name}.experts_residue", residue)]

    def _part(self, block: int, name: str):
        return getattr(self._attn(block), name)

    def attention_module(self, block: int):
        return self._attn(block)

    def z_module(self, block: int):
        return self._part(block, self.declaration.decoder.o)

    def mlp_module(self, block: int):
        """The module whose output is the MLP sublayer's write (``mlp_out``):
        the MLP, or under sandwich norms its post-norm."""
        d = self.declaration.decoder
        return getattr(self._layer(block), d.sandwich[1] if d.sandwich else d.mlp)

    def layer_module(self, block: int):
        return self._layer(block)

    # ---- sizes and attention constants
    @property
    def d_head(self) -> int:
        return int(self._attn(self.first_attention_block).head_dim)

    @property
    def n_kv_heads(self) -> int:
        return self.text_config.num_key_value_heads

    def score_scale(self, block: int) -> float:
        return float(self._attn(block).scaling)

    def sliding_window(self, block: int) -> int | None:
        """None for a layer without attention. The attention module's own ``sliding_window`` where transformers sets it per
        layer (None on full layers: Qwen2, Cohere 2, Gemma 3), else the text config's
        (Mistral), unless its ``layer_types`` call the layer full attention."""
        if self.mixer(block) is not None:
            return None
        attn = self._attn(block)
        if hasattr(attn, "sliding_window"):
            window = attn.sliding_window
        else:
            types = getattr(self.text_config, "layer_types", None)
            full = types is not None and types[block] != "sliding_attention"
            window = None if full else getattr(self.text_config, "sliding_window", None)
        return None if window is None else int(window)

    # ---- canonical weights (per query head; grouped K/V expanded)
    def _split_in(self, linear, n: int, expand: bool) -> torch.Tensor:
        """(n * d_head, d_model) weight -> (heads, d_model, d_head), groups expanded if ``expand``."""
        w = linear.weight.view(n, self.d_head, -1).transpose(1, 2)
        if expand and n != self.n_heads:
            w = w.repeat_interleave(self.n_heads // n, dim=0)
        return w

    def _split_bias(self, linear, n: int) -> torch.Tensor:
        if linear.bias is None:
            return torch.zeros(self.n_heads, self.d_head, dtype=linear.weight.dtype, device=linear.weight.device)
        b = linear.bias.view(n, self.d_head)
        return b.repeat_interleave(self.n_heads // n, dim=0) if n != self.n_heads else b

    def W_Q(self, layer: int) -> torch.Tensor:
        return self._split_in(self._part(layer, self.declaration.decoder.q), self.n_heads, False)

    def b_Q(self, layer: int) -> torch.Tensor:
        return self._split_bias(self._part(layer, self.declaration.decoder.q), self.n_heads)

    def W_K(self, layer: int) -> torch.Tensor:
        return self._split_in(self._part(layer, self.declaration.decoder.k), self.n_kv_heads, True)

    def b_K(self, layer: int) -> torch.Tensor:
        return self._split_bias(self._part(layer, self.declaration.decoder.k), self.n_kv_heads)

    def W_V(self, layer: int) -> torch.Tensor:
        return self._split_in(self._part(layer, self.declaration.decoder.v), self.n_kv_heads, True)

    def b_V(self, layer: int) -> torch.Tensor:
        return self._split_bias(self._part(layer, self.declaration.decoder.v), self.n_kv_heads)

    def W_O(self, layer: int) -> torch.Tensor:
        o = self.z_module(layer)
        return o.weight.view(self.d_model, self.n_heads, self.d_head).permute(1, 2, 0)

    def b_O(self, layer: int) -> torch.Tensor:
        o = self.z_module(layer)
        return o.bias if o.bias is not None else torch.zeros(self.d_model, dtype=o.weight.dtype, device=o.weight.device)

    @property
    def logit_scale(self) -> float:
        """The factor the model multiplies its logits by (1 without one)."""
        field = self.declaration.decoder.logit_scale
        return 1.0 if field is None else float(getattr(self.text_config, field))

    @property
    def W_U(self) -> torch.Tensor:
        """``(d_model, vocab)``; times the logit scale where the model scales its logits."""
        w = self.lm_head.weight.T
        return w if self.declaration.decoder.logit_scale is None else w * self.logit_scale

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``c tanh(logits / c)`` where the declaration names the soft-cap's config field and the
        config sets it, else as they are."""
        field = self.declaration.decoder.logit_softcap
        cap = None if field is None else getattr(self.text_config, field, None)
        if cap is None:
            return logits
        return torch.tanh(logits / float(cap)) * float(cap)

    @property
    def b_U(self) -> torch.Tensor:
        head = self.lm_head
        return (
            head.bias
            if head.bias is not None
            else torch.zeros(head.weight.shape[0], dtype=head.weight.dtype, device=head.weight.device)
        )

    def input_embeddings(self) -> torch.Tensor:
        """``(vocab, d_model)`` token embeddings as block 0 receives them; with
        scaled embeddings ``E * embed_scale`` (the scale in the embedding's dtype, as Gemma applies it)."""
        if not self.declaration.decoder.scaled_embeddings:
            return super().input_embeddings()
        emb = self.language_model.embed_tokens
        return emb.weight * emb.embed_scale.to(emb.weight.dtype)

    # ---- norms, each computed as the model does (NORM_FORMS)
    def _norm(self, module) -> Norm:
        form = self.declaration.decoder.norm
        eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
        if form == "gemma":
            return GemmaNorm("rmsnorm", module.weight, None, eps, weight_offset=1.0, compute_dtype=torch.float32)
        if form == "cohere":
            return CohereNorm("layernorm", module.weight, None, eps, compute_dtype=torch.float32)
        if form == "layernorm":
            return Norm("layernorm", module.weight, module.bias, eps)
        return Norm("rmsnorm", module.weight, None, eps, compute_dtype=torch.float32)

    def attn_norm(self, layer: int):
        return self._norm(getattr(self._layer(layer), self.declaration.decoder.attn_norm))

    def final_norm_layer(self):
        return self._norm(getattr(self.language_model, self.declaration.decoder.final_norm))

    def q_norm(self, block: int) -> Norm | None:
        """The per-head norm over ``d_head`` on queries before the rotation (None without one)."""
        names = self.declaration.decoder.qk_norms
        return None if names is None else self._norm(self._part(block, names[0]))

    def k_norm(self, block: int) -> Norm | None:
        """The per-head norm over ``d_head`` on keys before the rotation (None without one)."""
        names = self.declaration.decoder.qk_norms
        return None if names is None else self._norm(self._part(block, names[1]))

    def qk_gain(self, block: int) -> torch.Tensor | None:
        """``(d_head,)`` the product of the q and k norms' gains (with Gemma's ``1 +``):
        position-free, the score is ``q^T diag(qk_gain) k / (rms(q) rms(k) sqrt(d_head))``
        with ``q``, ``k`` the raw projections; the rotation between norm and score mixes
        coordinate pairs, so with positions this is the form only where the gains agree on each pair."""
        q, k = self.q_norm(block), self.k_norm(block)
        if q is None:
            return None
        return (q.weight_offset + q.weight) * (k.weight_offset + k.weight)

    def query_extras(self, block: int) -> str | None:
        """``"q/k norms"`` where the block normalises its queries per head, else None."""
        return "q/k norms" if self.q_norm(block) is not None else None

    # ---- positions
    @cached_property
    def _rotate_half(self):
        module, name = self.declaration.rotary.rotate_half.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)

    def _rotary(self, block: int | None):
        """``(rotary module, extra arguments)`` of block ``block``, or None where it is not rotated."""
        per_layer = self.declaration.rotary.per_layer
        rotary = getattr(self.language_model, self.declaration.decoder.rotary)
        if per_layer is None:
            return rotary, ()
        if block is None:
            raise ValueError(f"{self.family}: rotate needs the block (its layers rotate differently)")
        if per_layer == "sliding_only":
            return (rotary, ()) if self.sliding_window(block) is not None else None
        return rotary, (self.text_config.layer_types[block],)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, block: int | None = None) -> torch.Tensor:
        """The model's rotation of queries or keys ``(..., pos, heads, d_head)`` at
        ``positions``: ``(pos,)`` for RoPE; ``(3, pos)`` (temporal, height, width)
        for M-RoPE, where a ``(pos,)`` tensor is used on all three axes (right for
        text, not for visual tokens). ``block``: the layer, where layers rotate
        differently (:class:`core.models.declaration.Rotary` ``per_layer``)."""
        spec = self.declaration.rotary
        rotary = self._rotary(block)
        if rotary is None:
            return x
        module, extra = rotary
        if spec.scheme == "mrope":
            if positions.ndim == 1:
                positions = positions.view(1, -1).expand(3, -1)
            if positions.ndim != 2 or positions.shape[0] != 3:
                raise ValueError(f"M-RoPE positions must be (3, pos) or (pos,), got {tuple(positions.shape)}")
            cos, sin = module(x, positions.to(x.device).view(3, 1, -1), *extra)
        else:
            cos, sin = module(x, positions.to(x.device).view(1, -1), *extra)
        cos, sin = cos[0].unsqueeze(-2), sin[0].unsqueeze(-2)  # (pos, 1, rotary dims)
        if spec.float32:
            xf = x.float()
            return (xf * cos + self._rotate_half(xf) * sin).to(x.dtype)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if spec.partial:
            turned, rest = x[..., : cos.shape[-1]], x[..., cos.shape[-1] :]
            return torch.cat([turned * cos + self._rotate_half(turned) * sin, rest], dim=-1)
        return x * cos + self._rotate_half(x) * sin

    def positions_for_inputs(self, inputs: ModelInputs) -> torch.Tensor:
        """M-RoPE: ``(3, batch, pos)`` the position ids (temporal, height, width)
        the model computes for ``inputs`` (padding positions get 0), through the
        model's own ``get_rope_index``."""
        t = inputs.tensors
        ids = t["input_ids"]
        if t.get("image_grid_thw") is None or t.get("mm_token_type_ids") is None:
            mask = t.get("attention_mask")
            if mask is None:
                pos = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
            else:
                pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
            return pos.unsqueeze(0).expand(3, -1, -1)
        pos, _ = self.model.model.get_rope_index(
            ids,
            mm_token_type_ids=t["mm_token_type_ids"],
            image_grid_thw=t["image_grid_thw"],
            attention_mask=t.get("attention_mask"),
        )
        return pos

    def decoding_inputs(self, inputs: ModelInputs) -> dict[str, torch.Tensor]:
        """M-RoPE: the positions ``(3, batch, pos)`` of the whole sequence (a
        cached step takes the last one), as transformers' generate passes them.
        Without them the model falls back on the rope deltas it stored at its
        last forward (whichever image that was) over the whole attention mask,
        which does not fit a one-token step. Other schemes: none."""
        if self.position_scheme != "mrope":
            return {}
        return {"position_ids": self.positions_for_inputs(inputs)}

    def rope_positions(self, trace, batch: int = 0) -> torch.Tensor:
        """The positions :meth:`rotate` takes for one batch row: the ones the
        decoder ran with where the capture recorded them (``(3, pos)`` for M-RoPE),
        else ``arange(pos) + first``."""
        p = getattr(trace, "position_ids", None)
        if p is not None:
            return p[:, batch] if p.ndim == 3 else p[batch] if p.ndim == 2 else p
        return torch.arange(trace.input_ids.shape[1]) + self.declaration.rotary.first

    def queries_keys(self, trace, block: int, batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``(pos, heads, d_head)`` and keys (groups expanded) as the model
        scores them: norm, W_Q / W_K (+ bias), the q / k norms if any, then the
        block's rotation."""
        x = self.attn_norm(block)(trace.resid_pre[block][batch])
        q = torch.einsum("pm,hmd->phd", x, self.W_Q(block).to(x.dtype)) + self.b_Q(block).to(x.dtype)
        k = torch.einsum("pm,hmd->phd", x, self.W_K(block).to(x.dtype)) + self.b_K(block).to(x.dtype)
        if self.declaration.decoder.qk_norms is not None:
            q, k = self.q_norm(block)(q), self.k_norm(block)(k)
        if self.position_scheme not in ("rope", "mrope"):
            return q, k
        positions = self.rope_positions(trace, batch)
        return self.rotate(q, positions, block), self.rotate(k, positions, block)

    # ---- masks
    def run_capture(self, inputs, trace, keep: set[int]) -> None:
        """The hooked forward; keeps ``trace.token_type_ids`` (the mask rule's
        token types) where the rule reads them."""
        from core.forward.capture import run_with_hooks

        types = self.declaration.mask.types
        if types is not None:
            trace.token_type_ids = inputs.tensors.get(types)
        run_with_hooks(self, inputs, trace, keep)

    def allowed_keys(self, trace, block: int, batch: int = 0) -> torch.Tensor:
        """``(pos, keys)`` bool: the mask block ``block`` ran with where the capture
        recorded it, else the declared rule rebuilt (:func:`allowed_by_rule`)."""
        recorded = getattr(trace, "decoder_masks", {}).get(block)
        if recorded is not None:
            m = recorded[batch, 0]
            return (m if m.dtype == torch.bool else m == 0).cpu()
        rule = self.declaration.mask.rule
        if rule == "causal":
            return super().allowed_keys(trace, block, batch)
        rows = slice(batch, batch + 1)
        mask = trace.attention_mask[rows] if trace.attention_mask is not None else None
        types = getattr(trace, "token_type_ids", None)
        types = types[rows] if types is not None else None
        return allowed_by_rule(rule, mask, types, trace.input_ids.shape[1], self.sliding_window(block))[0]

    # ---- capture
    def capture_hooks(self, layer: int, trace, keep_pattern: bool) -> list:
        """Hooks that fill ``trace`` for block ``layer`` (see core.forward.capture.Trace):
        ``resid_pre`` (the layer's input), ``z`` (o's input), ``mlp_out`` (the MLP
        sublayer's write), ``attn_out``, the pattern under eager attention; under
        sandwich norms ``trace.norm_inputs["L{l}.<post-attention norm>"]`` (the o
        output the norm scales); with a recorded mask, ``trace.decoder_masks[l]``
        (the model's own 4-D mask, a reference) and at block 0 the position ids."""
        d = self.declaration.decoder
        block = self._layer(layer)

        def resid_pre(module, args, kwargs):
            trace.resid_pre[layer] = on_device_of(block, args[0] if args else kwargs["hidden_states"])

        def mlp_out(module, args, out):
            trace.mlp_out[layer] = out[0] if isinstance(out, tuple) else out

        regs = [(block, "pre_kw", resid_pre), (self.mlp_module(layer), "fwd", mlp_out)]
        if self.moe_experts(layer):

            def mlp_in(module, args, kwargs):
                trace.mlp_in[layer] = args[0] if args else kwargs["hidden_states"]

            regs.append((self.mlp_module(layer), "pre_kw", mlp_in))
        if self.declaration.mask.recorded:
            regs.append((block, "pre_kw", self._record_mask(trace, layer)))
        if self.mixer(layer) is not None:

            def mixer_out(module, args, out):
                trace.mixer_out[layer] = out[0] if isinstance(out, tuple) else out

            return [*regs, (self.mixer_module(layer), "fwd", mixer_out)]
        attn = self._attn(layer)
        o = self.z_module(layer)

        def z_in(module, args):
            x = args[0]
            trace.z[layer] = x.view(*x.shape[:-1], self.n_heads, self.d_head)

        def attn_out(module, args, out):
            trace.attn_out[layer] = out

        regs.append((o, "pre", z_in))
        if trace.keep_attn_out:
            regs.append((o, "fwd", attn_out))
        if keep_pattern:
            regs.append((attn, "fwd", pattern_hook(trace, layer)))
        if d.sandwich is not None:
            key = f"L{layer}.{d.sandwich[0]}"

            def attn_in(module, args):
                trace.norm_inputs[key] = args[0]

            regs.append((getattr(block, d.sandwich[0]), "pre", attn_in))
        return regs

    @staticmethod
    def _record_mask(trace, layer: int):
        def inputs(module, args, kwargs):
            mask = kwargs.get("attention_mask")
            if isinstance(mask, dict):  # hybrid configs pass one mask per layer type
                mask = mask.get("full_attention")
            if isinstance(mask, torch.Tensor) and mask.ndim == 4:
                if not hasattr(trace, "decoder_masks"):
                    trace.decoder_masks = {}
                trace.decoder_masks[layer] = mask
            if layer == 0 and kwargs.get("position_ids") is not None:
                hidden = args[0] if args else kwargs["hidden_states"]
                trace.position_ids = kwargs["position_ids"].expand(hidden.shape[0], -1)

        return inputs

    def final_hooks(self, trace) -> list:
        """``trace.final_resid`` (the final norm's input); for M-RoPE also
        ``trace.position_ids`` ``(3, batch, pos)``, the positions the decoder ran with."""
        norm = getattr(self.language_model, self.declaration.decoder.final_norm)

        def final(module, args):
            trace.final_resid = on_device_of(module, args[0])

        hooks = [(norm, "pre", final)]
        if self.position_scheme == "mrope":

            def positions(module, args, kwargs):
                trace.position_ids = self._decoder_positions(kwargs)

            hooks.append((self.language_model, "pre_kw", positions))
        return hooks

    @staticmethod
    def _decoder_positions(kwargs: dict) -> torch.Tensor:
        """The decoder's ``(3, batch, pos)`` positions from its call kwargs, as
        Qwen2-VL's text model derives them (no cache: a single full run)."""
        pos = kwargs.get("position_ids")
        embeds = kwargs.get("inputs_embeds")
        if pos is None:
            ref = embeds if embeds is not None else kwargs["input_ids"]
            batch, n = ref.shape[0], ref.shape[1]
            return torch.arange(n, device=ref.device).view(1, 1, -1).expand(3, batch, -1)
        if pos.ndim == 2:
            return pos[None].expand(3, -1, -1)
        if pos.shape[0] == 4:  # text positions prepended for packed sequences
            return pos[1:]
        return pos

    # ---- the tokens around the image
    def delimiter_ids(self) -> set[int]:
        """The ids of the declared delimiters (``config.<field>``, ``processor.<attr>`` or a token)."""
        ids = set()
        for name in self.declaration.delimiters:
            where, _, attr = name.partition(".")
            if where == "config":
                value = config_value(self.model.config, attr)
            elif where == "processor":
                value = getattr(self.processor, attr)
            else:
                value = name
            if value is not None:
                ids.add(int(value) if isinstance(value, int) else self.vocab_id(value))
        return ids

    def visual_delimiter_positions(self, trace, batch: int = 0) -> list[int]:
        """Positions of the declared delimiter tokens."""
        if not self.declaration.delimiters:
            return []
        marks = self.delimiter_ids()
        return [i for i, t in enumerate(trace.input_ids[batch].tolist()) if t in marks]

    # ---- the vision side edits reach
    @property
    def projector(self) -> torch.nn.Module:
        return attrgetter(self.declaration.projector)(self.model)

    def project_visual(self, features: torch.Tensor) -> torch.Tensor:
        """``(batch, patches, vision width)`` -> ``(batch, patches, d_model)``: what the language model reads."""
        return self.projector(features)

    def visual_site_module(self, site: str):
        """``vision_out``: the projector's input (the features the language side
        reads); ``projector_out``: its output, the rows placed at the image-token
        positions. Refused in one line where the family declares no such sites."""
        d = self.declaration
        if site in ("vision_out", "projector_out"):
            if d.visual_sites:
                return self.projector, "pre" if site == "vision_out" else "fwd"
            if d.no_visual_sites:
                raise InterventionError(f"{self.family}: no {site!r} site: {d.no_visual_sites}")
        return super().visual_site_module(site)

    # ---- the residual graph of the block form
    def describe(self) -> dict:
        form = self.declaration.decoder.form
        return super().describe() if form == "sequential" else {**super().describe(), "norm_placement": form}

    def post_attention_norm(self, block: int):
        """Under sandwich norms: the norm o's output passes before the stream."""
        return self._norm(getattr(self._layer(block), self.declaration.decoder.sandwich[0]))

    def stream_norms(self) -> list:
        """Under sandwich norms, the norm each write passes before the stream: per layer its two post-norms."""
        names = self.declaration.decoder.sandwich or ()
        return [
            (f"L{i}.{name}", self._norm(getattr(layer, name)))
            for i, layer in enumerate(self.language_model.layers)
            for name in names
        ]

    def _attn_input(self, trace, block: int, batch: int, position: int) -> torch.Tensor:
        return trace.norm_inputs[f"L{block}.{self.declaration.decoder.sandwich[0]}"][batch, position]

    @torch.no_grad()
    def component_stack(self, trace, position: int, batch: int = 0) -> tuple[list[str], torch.Tensor]:
        """Pre-norm and parallel blocks: the base's split. Sandwich norms: ``embed``;
        per block ``L{l}.H{h}`` (the head's write at the block norm's frozen
        scale), ``bias.L{l}.attn_out`` (o's bias, likewise, if any),
        ``L{l}.attn_norm_residue`` (the write minus those: the norm's float32
        rounding) and ``L{l}.mlp`` (the MLP's write). They sum to x_L."""
        if self.declaration.decoder.form != "sandwich":
            return super().component_stack(trace, position, batch)
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
        """``g`` on x_L read in o's output space: the identity for pre-norm and
        parallel blocks; under sandwich norms through the block's frozen post-norm."""
        if self.declaration.decoder.form != "sandwich":
            return g
        return self.post_attention_norm(block).frozen_readout(self._attn_input(trace, block, batch, position), g)
