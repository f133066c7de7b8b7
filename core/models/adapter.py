"""The canonical view of a loaded model.

An :class:`Adapter` is the one place that knows a family's module paths and
input format. Methods never reach into a model's modules: they go through
the adapter. Each family subclasses it in ``core/models/families/<family>.py``
and registers itself in :mod:`core.models.registry`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from PIL import Image


@dataclass
class ModelInputs:
    """A prepared batch.

    Attributes:
        tensors: keyword arguments for the family's forward.
        answer_positions: ``(batch,)`` index of the position whose next-token
            distribution is the answer.
        input_ids: ``(batch, pos)`` the token ids of the text stream.
    """

    tensors: dict[str, torch.Tensor]
    answer_positions: torch.Tensor
    input_ids: torch.Tensor
    prompts: list[str]


class Adapter(ABC):
    """Canonical names for one model family.

    Attributes:
        family: registry name of the family ("llava", "coca", ...).
        final_norm: "rmsnorm" or "layernorm".
        attention_kind: "self" (visual tokens interleaved with text) or
            "cross" (text queries attend to visual keys).
        position_scheme: "none", "absolute", "rope" or "mrope".
    """

    family: ClassVar[str]
    final_norm: ClassVar[str]
    # What "frozen" means in frozen-scale DLA for this family's graph (stated in every audit row).
    frozen_convention: ClassVar[str] = "final norm scale frozen at x_L"
    attention_kind: ClassVar[str]
    position_scheme: ClassVar[str]

    def __init__(self, model: torch.nn.Module, processor: Any, tokenizer: Any, config: dict | None = None):
        self.model = model
        self.processor = processor
        self.tokenizer = tokenizer
        self.config = config or {}

    @classmethod
    def check_config(cls, config) -> None:
        """Raise :class:`core.errors.UnsupportedArchitectureError` for a model
        config this adapter cannot read out exactly; called before the weights
        load (default: every config of the architecture is fine)."""
        return None

    # ---- sizes
    @property
    @abstractmethod
    def n_layers(self) -> int: ...

    @property
    @abstractmethod
    def n_heads(self) -> int: ...

    @property
    @abstractmethod
    def d_model(self) -> int: ...

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- text
    @abstractmethod
    def prompt(self, question: str) -> str:
        """The text the model is run on for ``question``."""

    @abstractmethod
    def check_question(self, question: str) -> None:
        """Raise :class:`core.errors.QuestionError` if the question cannot fit."""

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)]).strip()

    def token_id(self, token: str) -> int:
        """Id of a one-token answer string; QuestionError if it is not one token."""
        from core.errors import QuestionError

        ids = self.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise QuestionError(f"{token!r} is not a single token for this model ({len(ids)} tokens)")
        return int(ids[0])

    # ---- running
    @abstractmethod
    def prepare(self, images: list[Image.Image], questions: list[str]) -> ModelInputs:
        """Process images (PIL images, paths or uint8 arrays) and questions
        into one right-padded batch."""

    @abstractmethod
    def forward_logits(self, inputs: ModelInputs) -> torch.Tensor:
        """Full logits ``(batch, pos, vocab)`` of the text stream."""

    @abstractmethod
    def append_token(self, inputs: ModelInputs, token_id: int) -> ModelInputs:
        """The same batch (of one) with ``token_id`` appended after the answer position."""

    def next_token_logits(self, inputs: ModelInputs) -> torch.Tensor:
        """Logits at the answer position, ``(batch, vocab)``."""
        logits = self.forward_logits(inputs)
        return logits[torch.arange(logits.shape[0], device=logits.device), inputs.answer_positions]

    # ---- canonical weights (TransformerLens names; per query head, grouped K/V mapped)
    @property
    def n_kv_heads(self) -> int:
        return self.n_heads

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def kv_group(self, head: int) -> int:
        """The key/value head that query head ``head`` reads (grouped-query attention)."""
        return head // (self.n_heads // self.n_kv_heads)

    def W_Q(self, layer: int) -> torch.Tensor:
        """``(heads, d_model, d_head)``: q = Norm(r) @ W_Q[h] + b_Q[h] (before RoPE)."""
        raise NotImplementedError(f"{self.family}: W_Q not mapped yet")

    def b_Q(self, layer: int) -> torch.Tensor:
        """``(heads, d_head)``."""
        raise NotImplementedError(f"{self.family}: b_Q not mapped yet")

    def W_K(self, layer: int) -> torch.Tensor:
        """``(heads, d_model, d_head)``, each query head's key map (groups expanded)."""
        raise NotImplementedError(f"{self.family}: W_K not mapped yet")

    def b_K(self, layer: int) -> torch.Tensor:
        raise NotImplementedError(f"{self.family}: b_K not mapped yet")

    def W_V(self, layer: int) -> torch.Tensor:
        """``(heads, d_model, d_head)``, each query head's value map (groups expanded)."""
        raise NotImplementedError(f"{self.family}: W_V not mapped yet")

    def b_V(self, layer: int) -> torch.Tensor:
        raise NotImplementedError(f"{self.family}: b_V not mapped yet")

    def W_O(self, layer: int) -> torch.Tensor:
        """``(heads, d_head, d_model)``: head output = z[h] @ W_O[h]."""
        raise NotImplementedError(f"{self.family}: W_O not mapped yet")

    def b_O(self, layer: int) -> torch.Tensor:
        """``(d_model,)`` the output projection's bias (zeros if none)."""
        raise NotImplementedError(f"{self.family}: b_O not mapped yet")

    def attn_norm(self, layer: int):
        """The :class:`core.models.norms.Norm` in front of layer ``layer``'s attention."""
        raise NotImplementedError(f"{self.family}: attn_norm not mapped yet")

    def final_norm_layer(self):
        """The :class:`core.models.norms.Norm` in front of the unembedding."""
        raise NotImplementedError(f"{self.family}: final norm not mapped yet")

    @property
    def W_U(self) -> torch.Tensor:
        """``(d_model, vocab)``."""
        raise NotImplementedError(f"{self.family}: W_U not mapped yet")

    @property
    def b_U(self) -> torch.Tensor:
        """``(vocab,)`` (zeros if the unembedding has no bias)."""
        raise NotImplementedError(f"{self.family}: b_U not mapped yet")

    # ---- capture and geometry (see core/capture.py and core/geometry.py)
    @property
    def blocks(self) -> list[tuple[str, str]]:
        """``[(name, kind)]`` of the blocks a Trace is cut into; kind is "self"
        or "cross". Self-attention decoders: one block per layer."""
        return [(f"L{layer}", "self") for layer in range(self.n_layers)]

    def kv_norm(self, block: int):
        """The norm applied to the stream keys and values read (self-attention: ``attn_norm``)."""
        return self.attn_norm(block)

    def run_capture(self, inputs: ModelInputs, trace, keep: set[int]) -> None:
        """Fill ``trace`` with one forward; default: hooks around the library's forward."""
        from core.capture import run_with_hooks

        run_with_hooks(self, inputs, trace, keep)

    def visual_positions(self, inputs: ModelInputs) -> torch.Tensor:
        """``(batch, n_visual)`` sequence positions of the visual tokens."""
        raise NotImplementedError(f"{self.family}: visual positions not mapped yet")

    def capture_hooks(self, layer: int, trace, keep_pattern: bool) -> list:
        """``[(module, kind, fn)]`` hooks filling ``trace`` for block ``layer``:
        ``resid_pre``, ``z`` (the output projection's input as (batch, pos, heads,
        d_head)), ``attn_out``, ``mlp_out`` and, if ``keep_pattern``, the
        patterns of ``trace.query_positions``. Kinds as in :func:`core.capture.hooks`."""
        raise NotImplementedError(f"{self.family}: capture not mapped yet")

    def final_hooks(self, trace) -> list:
        """Hooks that record ``trace.final_resid`` (the final norm's input)."""
        raise NotImplementedError(f"{self.family}: capture not mapped yet")

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply the position scheme to queries or keys ``(pos, heads, d_head)``.

        ``positions`` is in the scheme's own format: ``(pos,)`` for RoPE,
        ``(3, pos)`` (temporal, height, width) for M-RoPE."""
        raise NotImplementedError(f"{self.family}: positions not mapped yet")

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """:class:`core.geometry.VisualToken` per visual token, boxes in the original image."""
        raise NotImplementedError(f"{self.family}: geometry not mapped yet")

    # ---- the residual graph (METHODS.md 4.7: "rewrite by the actual graph")
    def component_stack(self, trace, position: int, batch: int = 0) -> tuple[list[str], torch.Tensor]:
        """Names and ``(n_components, d_model)`` vectors that sum to x_L at
        ``position``. Pre-norm default: x_L = x_0 + sum_l (sum_h W_O^h z^h + b_O) + sum_l m_l;
        a post-norm family (BLIP) propagates each addend through the frozen norms after it."""
        names = ["embed"]
        vecs = [trace.resid_pre[0][batch, position]]
        for block, block_name in enumerate(trace.block_names):
            heads = trace.head_output(self, block, position, batch)  # (heads, d_model)
            names += [f"{block_name}.H{h}" for h in range(heads.shape[0])]
            vecs += list(heads)
            b_O = self.b_O(block)
            if torch.any(b_O != 0):
                names.append(f"bias.{block_name}.attn_out")
                vecs.append(b_O.to(heads.dtype))
            names.append(f"{block_name}.mlp")
            vecs.append(trace.mlp_out[block][batch, position])
        return names, torch.stack(vecs)

    def readout_pullback(self, trace, block: int, position: int, g: torch.Tensor, batch: int = 0) -> torch.Tensor:
        """Directions ``g (..., d_model)`` on x_L mapped back to block ``block``'s
        attention-output space, so ``g' . c`` reads a raw head write as it
        reaches x_L. Pre-norm: the identity (every write is added to x_L as is)."""
        return g

    # ---- the modules hooks and interventions reach (hook-based families)
    def attention_module(self, block: int) -> torch.nn.Module:
        """Block ``block``'s attention module (its eager call is where q/k are recorded)."""
        raise NotImplementedError(f"{self.family}: attention modules not mapped")

    def z_module(self, block: int) -> torch.nn.Module:
        """The output projection whose input is ``z`` ``(batch, pos, heads * d_head)``."""
        raise NotImplementedError(f"{self.family}: output projections not mapped")

    def mlp_module(self, block: int) -> torch.nn.Module:
        """Block ``block``'s MLP (its output is ``mlp_out``)."""
        raise NotImplementedError(f"{self.family}: MLPs not mapped")

    def layer_module(self, block: int) -> torch.nn.Module:
        """Block ``block``'s layer, whose first input is the residual entering it (``resid_pre``)."""
        raise NotImplementedError(f"{self.family}: layers not mapped")

    def visual_site_module(self, site: str) -> tuple[torch.nn.Module, str]:
        """``(module, "pre" | "fwd")``: the module whose first input ("pre") or
        output ("fwd") is the visual-feature site ``site`` ("vision_out",
        "projector_out") ``(batch, n_visual, width)``."""
        from core.errors import InterventionError

        raise InterventionError(f"{self.family}: no {site!r} site (edit sites: {', '.join(self.edit_sites)})")

    # The edit sites (core.edits.SITES) this family applies; others are refused.
    edit_sites: ClassVar[tuple[str, ...]] = ("z", "mlp")

    def check_edits(self, edits) -> None:
        """Raise :class:`core.errors.InterventionError` for an edit this family
        cannot apply (a site it does not have, a block out of range)."""
        from core.errors import InterventionError

        n = len(self.blocks)
        for e in edits:
            if e.site not in self.edit_sites:
                raise InterventionError(
                    f"{self.family}: no {e.site!r} edit site (this family has: {', '.join(self.edit_sites)})"
                )
            if e.block is not None and not 0 <= e.block < n:
                raise InterventionError(f"{e.describe()}: block out of range (the model has {n} blocks)")

    def edit_hooks(self, edits) -> list:
        """``[(module, kind, fn)]`` applying :class:`core.edits.Edit` s: a
        pre-hook on the output projection changes a head's ``z`` slice (so the
        head's write ``W_O^h z^h`` changes and ``b_O`` stays), a forward hook
        changes the MLP output, a pre-hook on a layer changes the residual
        entering it, hooks on :meth:`visual_site_module` change visual features,
        and a pre-hook on the attention module adds ``-inf`` to the knocked-out
        entries of the additive attention mask it is called with (so only the
        chosen block's softmax sees them, and its other weights renormalise)."""
        self.check_edits(edits)
        regs = []
        for e in edits:
            if e.site == "mlp":

                def mlp(module, args, out, e=e):
                    return e.apply(out)

                regs.append((self.mlp_module(e.block), "fwd", mlp))
            elif e.site == "z":

                def z(module, args, e=e):
                    return (e.apply(args[0], self.d_head), *args[1:])

                regs.append((self.z_module(e.block), "pre", z))
            elif e.site == "resid":

                def resid(module, args, kwargs, e=e):
                    if args:
                        return (e.apply(args[0]), *args[1:]), kwargs
                    return args, {**kwargs, "hidden_states": e.apply(kwargs["hidden_states"])}

                regs.append((self.layer_module(e.block), "pre_kw", resid))
            elif e.site == "knockout":
                regs.append((self.attention_module(e.block), "pre_kw", self._knockout_hook(e)))
            else:  # visual feature sites
                module, kind = self.visual_site_module(e.site)
                if kind == "pre":

                    def pre(module, args, e=e):
                        return (e.apply(args[0]), *args[1:])

                    regs.append((module, "pre", pre))
                else:

                    def fwd(module, args, out, e=e):
                        return e.apply(out)

                    regs.append((module, "fwd", fwd))
        return regs

    def _knockout_hook(self, e):
        """A pre-hook (with kwargs) on an attention module that knocks edges out
        of the additive mask ``(batch, 1 | heads, q, k)`` it is called with."""
        from core.errors import InterventionError

        def knock(module, args, kwargs):
            mask = kwargs.get("attention_mask")
            if mask is None:
                raise InterventionError(
                    f"{self.family}: cannot knock out edges, the attention is called without a mask"
                )
            if mask.dtype == torch.bool:  # True = may attend
                additive = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
                mask = additive.masked_fill(~mask, float("-inf"))
            b, _, q, k = mask.shape
            mask = e.knock(mask.expand(b, self.n_heads, q, k))
            return args, {**kwargs, "attention_mask": mask}

        return knock

    def site_record_hooks(self, site: str, store: dict) -> list:
        """``[(module, kind, fn)]`` that store the visual-feature site's tensor
        ``(batch, n_visual, width)`` in ``store[site]`` (what the module computed,
        before any edit at that site)."""
        module, kind = self.visual_site_module(site)
        if kind == "pre":

            def pre(module, args):
                store[site] = args[0]

            return [(module, "pre", pre)]

        def fwd(module, args, out):
            store[site] = out

        return [(module, "fwd", fwd)]

    def qk_record_hooks(self, trace, blocks: set[int]) -> list | None:
        """Hooks recording ``trace.q`` / ``trace.k`` / ``trace.score_scale`` for
        families whose attention does not go through transformers' eager
        function; None: the eager function is wrapped (see core.capture.record_qk)."""
        return None

    def score_scale(self, block: int) -> float:
        """The factor ``q . k`` is multiplied by before the softmax."""
        return self.d_head**-0.5

    def score_transform(self, block: int, scores: torch.Tensor) -> torch.Tensor:
        """Whatever the model does to scaled scores before the mask (identity;
        Gemma 2's soft-capping overrides it)."""
        return scores

    def qk_gain(self, block: int) -> torch.Tensor | None:
        """``(d_head,)`` the product of per-head q and k norm gains, for families
        that normalise q and k per head (None: no such norms)."""
        return None

    def input_embeddings(self) -> torch.Tensor:
        """``(vocab, d_model)`` token embeddings as the first block receives
        them (families that scale embeddings include the scale)."""
        return self.model.get_input_embeddings().weight

    def queries_keys(self, trace, block: int, batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``(pos, heads, d_head)`` for every sequence position and keys
        ``(keys, heads, d_head)`` (one per query head, groups expanded) recomputed
        from the captured residual and the canonical weights: norm, W_Q / W_K,
        bias, then the position scheme (RoPE / M-RoPE) for self-attention.
        Families with extra q/k transforms (q/k norms) override this."""
        x = self.attn_norm(block)(trace.resid_pre[block][batch])
        source = trace.kv_source[block]
        kv = x if source is None else self.kv_norm(block)(source[batch])
        q = torch.einsum("pm,hmd->phd", x, self.W_Q(block).to(x.dtype)) + self.b_Q(block).to(x.dtype)
        k = torch.einsum("pm,hmd->phd", kv, self.W_K(block).to(x.dtype)) + self.b_K(block).to(x.dtype)
        if self.position_scheme in ("rope", "mrope") and source is None:
            positions = self.rope_positions(trace, batch)
            q, k = self.rotate(q, positions), self.rotate(k, positions)
        return q, k

    # ---- roles, masks and positions the read-outs need (overridden where a family differs)
    def rope_positions(self, trace, batch: int = 0) -> torch.Tensor:
        """The positions :meth:`rotate` takes for every sequence position of one
        batch row: ``(pos,)`` sequence indices by default; M-RoPE families return
        ``(3, pos)`` from ``trace.position_ids``."""
        if trace.position_ids is not None:
            p = trace.position_ids
            return p[:, batch] if p.ndim == 3 else p[batch]
        return torch.arange(trace.input_ids.shape[1])

    def allowed_keys(self, trace, block: int, batch: int = 0) -> torch.Tensor:
        """``(pos, keys)`` bool: which keys each query may attend to in block
        ``block``. Self-attention default: causal, padding keys excluded;
        cross-attention: every visual token. A prefix-LM (PaliGemma) overrides."""
        n = trace.input_ids.shape[1]
        if trace.block_kinds[block] == "cross":
            n_keys = trace.kv_source[block].shape[1]
            return torch.ones(n, n_keys, dtype=torch.bool)
        allowed = torch.ones(n, n, dtype=torch.bool).tril()
        if trace.attention_mask is not None:
            allowed = allowed & trace.attention_mask[batch].bool().cpu().view(1, -1)
        return allowed

    def token_roles(self, trace, batch: int = 0) -> list[str]:
        """One role per sequence position: "sink" (position 0: BOS, or the first
        token, which serves as the attention sink in models without BOS), "visual",
        "visual_delimiter" (image start/end/newline/separator tokens), "special"
        (other special tokens: chat markup, EOS), "padding", or "text". Patterns
        report sink, delimiter and special mass separately, never inside entity
        averages; padding is never counted."""
        ids = trace.input_ids[batch].tolist()
        roles = ["text"] * len(ids)
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        for i, t in enumerate(ids):
            if t in special:
                roles[i] = "special"
        for i in self.visual_delimiter_positions(trace, batch):
            roles[i] = "visual_delimiter"
        for i in trace.visual_positions[batch].tolist():
            roles[i] = "visual"
        if trace.attention_mask is not None:
            for i, m in enumerate(trace.attention_mask[batch].tolist()):
                if not m:
                    roles[i] = "padding"
        else:  # right-padded batches: nothing real follows the answer position
            for i in range(int(trace.answer_positions[batch]) + 1, len(ids)):
                roles[i] = "padding"
        if roles and roles[0] != "padding":
            roles[0] = "sink"
        return roles

    def cross_key_roles(self, trace, block: int, batch: int = 0) -> list[str]:
        """The role of each key of cross-attention block ``block``: "visual", or
        "visual_global" for a key that pools the whole image (BLIP's CLS)."""
        return ["visual"] * trace.kv_source[block].shape[1]

    def visual_delimiter_positions(self, trace, batch: int = 0) -> list[int]:
        """Sequence positions of tokens that frame or separate visual tokens but
        carry no patch (image start/end markers, row newlines); default none."""
        return []

    def describe(self) -> dict:
        return {
            "family": self.family,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "d_model": self.d_model,
            "final_norm": self.final_norm,
            "attention_kind": self.attention_kind,
            "position_scheme": self.position_scheme,
        }
