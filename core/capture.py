"""One no-grad forward that records what the read-outs need: a :class:`Trace`.

Hooks are scoped: registered inside :func:`hooks` and removed in its
``finally``, so none outlives a run. Attention patterns need eager attention
(under sdpa transformers returns no weights), so the language model is
switched to eager for the run and switched back afterwards.

Each head's output is kept as the output projection's input ``z``
``(batch, pos, heads, d_head)`` (a view, no copy); ``W_O^h z^h`` is
materialised only for the positions a method asks for.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from core.errors import oom_guard
from core.lazy import make_module_callable


@dataclass
class Trace:
    """What one forward computed.

    The stream is cut into *blocks* (``block_names``): one per decoder layer
    for self-attention models ("L0", "L1", ...); for cross-attention models
    also the cross-attention blocks ("L0.xattn") and any text-only tower in
    front ("T0"). Every per-layer list below is indexed by block.

    Attributes:
        input_ids: ``(batch, pos)``.
        answer_positions: ``(batch,)`` the position whose next token is the answer.
        visual_positions: ``(batch, n_visual)`` sequence positions of the visual tokens.
        resid_pre: per layer ``(batch, pos, d_model)``: the residual entering block l.
        z: per layer ``(batch, pos, heads, d_head)``: each head's output before W_O.
        attn_out: per layer ``(batch, pos, d_model)``: the attention block's output (W_O z + b_O).
        mlp_out: per layer ``(batch, pos, d_model)``.
        patterns: per kept block ``(batch, heads, n_query, keys)``: attention weights
            of the kept query positions (keys: sequence positions for self-attention,
            visual tokens for cross-attention).
        block_names, block_kinds: per block, its name and "self" or "cross".
        kv_source: per block, the stream its keys and values read before their
            norm: None for self-attention (it reads ``resid_pre``), the visual
            tokens ``(batch, n_visual, d_model)`` for cross-attention.
        position_ids: what the model's position scheme ran with, when the
            family records it (M-RoPE: ``(3, batch, pos)``).
        attention_mask: ``(batch, pos)`` 1 for real tokens, 0 for padding (None: no padding).
        q, k, score_scale: on request (``keep_qk``), per block, the queries
            ``(batch, pos, heads, d_head)`` and keys ``(batch, keys, kv_heads, d_head)``
            exactly as the model's attention received them (after bias, q/k norms
            and the position scheme) and the factor it scales ``q . k`` by; so
            ``q k^T * scale`` are the model's own pre-softmax scores (before the mask).
        edits: the :class:`core.edits.Edit` s this run was made with; empty for
            the model's own computation.
        query_positions: ``(n_query,)`` the kept query positions (same for every batch row).
        final_resid: ``(batch, pos, d_model)`` x_L, before the final norm.
        logits: ``(batch, pos, vocab)``.
    """

    input_ids: torch.Tensor
    answer_positions: torch.Tensor
    visual_positions: torch.Tensor
    resid_pre: list[torch.Tensor] = field(default_factory=list)
    z: list[torch.Tensor] = field(default_factory=list)
    attn_out: list[torch.Tensor] = field(default_factory=list)
    mlp_out: list[torch.Tensor] = field(default_factory=list)
    patterns: dict[int, torch.Tensor] = field(default_factory=dict)
    query_positions: torch.Tensor | None = None
    final_resid: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    block_names: list[str] = field(default_factory=list)
    block_kinds: list[str] = field(default_factory=list)
    kv_source: list[torch.Tensor | None] = field(default_factory=list)
    position_ids: torch.Tensor | None = None  # the positions the model ran with, in its scheme's format
    attention_mask: torch.Tensor | None = None  # (batch, pos) 1 for real tokens, 0 for padding
    q: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> (batch, pos, heads, d_head)
    k: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> (batch, keys, kv_heads, d_head)
    score_scale: dict[int, float] = field(default_factory=dict)  # block -> the model's score scaling
    edits: list = field(default_factory=list)  # core.edits.Edit applied in this run (empty: the model as is)
    answer_id: int | None = None  # the target token the caller named (capture(answer=...)), else None
    foil_id: int | None = None
    norm_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # post-norm families: each stream norm's input

    @property
    def n_blocks(self) -> int:
        return len(self.resid_pre)

    def head_output(self, adapter, block: int, positions: torch.Tensor | int, batch: int = 0) -> torch.Tensor:
        """``W_O^h z^h`` for the given positions: ``(n_pos, heads, d_model)``."""
        z = self.z[block][batch, positions]  # (n_pos, heads, d_head) or (heads, d_head)
        return torch.einsum("...hd,hdm->...hm", z, adapter.W_O(block).to(z.dtype))


@contextmanager
def hooks(registrations: Sequence[tuple[torch.nn.Module, str, object]]) -> Iterator[None]:
    """Register ``(module, kind, fn)`` hooks (kind: "pre", "pre_kw", "fwd") and
    remove every one on exit, whatever happens inside."""
    handles = []
    try:
        for module, kind, fn in registrations:
            if kind == "pre":
                handles.append(module.register_forward_pre_hook(fn))
            elif kind == "pre_kw":
                handles.append(module.register_forward_pre_hook(fn, with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(fn))
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def eager_attention(model) -> Iterator[None]:
    """Run ``model`` with eager attention (weights returned), then restore."""
    before = getattr(model.config, "_attn_implementation", None)
    if before == "eager" or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@torch.no_grad()
def capture(
    loaded,
    image,
    question: str,
    *,
    answer: str | None = None,
    foil: str | None = None,
    pattern_layers: Sequence[int] | None = None,
    query_positions: Sequence[int] | None = None,
    keep_qk: bool | Sequence[int] = False,
    edits: Sequence = (),
    inputs=None,
) -> Trace:
    """Run the model once on (image, question) and record a :class:`Trace`.

    Args:
        answer, foil: target tokens (one token each) recorded as
            ``trace.answer_id`` / ``trace.foil_id`` for the read-outs.
        pattern_layers: blocks whose attention patterns are kept (default all).
        query_positions: query positions whose patterns are kept (default:
            the answer position only, which is what fits for a 7B model).
        keep_qk: record the model's own post-position-scheme queries and keys
            (``True``: every block; or a list of blocks).
        edits: :class:`core.edits.Edit` s to apply (ablation or patching); the
            trace then records the edited run and says so in ``trace.edits``.
        inputs: the prepared batch, when the caller already has it (saves
            running the processor twice).
    """
    adapter = loaded.adapter
    if inputs is None:
        inputs = adapter.prepare([image], [question])
    blocks = adapter.blocks
    n = len(blocks)
    keep = set(range(n) if pattern_layers is None else pattern_layers)
    qpos = torch.as_tensor(
        list(query_positions) if query_positions is not None else [int(inputs.answer_positions[0])],
        dtype=torch.long,
    )
    trace = Trace(
        inputs.input_ids,
        inputs.answer_positions,
        adapter.visual_positions(inputs),
        resid_pre=[None] * n,
        z=[None] * n,
        attn_out=[None] * n,
        mlp_out=[None] * n,
        query_positions=qpos,
        block_names=[name for name, _ in blocks],
        block_kinds=[kind for _, kind in blocks],
        kv_source=[None] * n,
        attention_mask=inputs.tensors.get("attention_mask"),
        edits=list(edits),
        answer_id=adapter.token_id(answer) if answer else None,
        foil_id=adapter.token_id(foil) if foil else None,
    )
    qk_blocks = set(range(n)) if keep_qk is True else set(keep_qk or ())
    with oom_guard("capturing (keep fewer layers or query positions)"):
        with record_qk(adapter, trace, qk_blocks):
            adapter.run_capture(inputs, trace, keep)
    return trace


@contextmanager
def record_qk(adapter, trace: Trace, blocks: set[int]) -> Iterator[None]:
    """Record the queries and keys the model's eager attention receives, for
    ``blocks``. transformers resolves ``eager_attention_forward`` in the
    attention class's own module at call time, so it is wrapped there for the
    run and restored in ``finally``; other modules' calls (the vision tower)
    pass through untouched. Families that replay the forward themselves
    (``adapter.records_qk``) fill ``trace.q``/``trace.k`` in their replay."""
    if not blocks or getattr(adapter, "records_qk", False):
        yield
        return
    own = adapter.qk_record_hooks(trace, blocks)
    if own is not None:  # attention computed inline (BLIP): hooks on the q/k projections
        with hooks(own):
            yield
        return

    by_module = {id(adapter.attention_module(b)): b for b in blocks}
    patched: dict[object, object] = {}

    def wrap(original):
        def eager_attention_forward(module, query, key, value, attention_mask, scaling, *args, **kwargs):
            block = by_module.get(id(module))
            if block is not None:
                # (batch, heads, pos, d_head) -> (batch, pos, heads, d_head)
                trace.q[block] = query.transpose(1, 2)
                trace.k[block] = key.transpose(1, 2)
                trace.score_scale[block] = float(scaling)
            return original(module, query, key, value, attention_mask, scaling, *args, **kwargs)

        return eager_attention_forward

    try:
        for b in blocks:
            mod = sys.modules[type(adapter.attention_module(b)).__module__]
            if mod not in patched:
                if not hasattr(mod, "eager_attention_forward"):
                    raise NotImplementedError(
                        f"{adapter.family}: cannot record q/k ({mod.__name__} has no eager attention)"
                    )
                patched[mod] = mod.eager_attention_forward
                mod.eager_attention_forward = wrap(mod.eager_attention_forward)
        yield
    finally:
        for mod, original in patched.items():
            mod.eager_attention_forward = original
    missing = blocks - set(trace.q)
    if missing:
        raise RuntimeError(f"q/k not recorded for blocks {sorted(missing)}: the attention did not run eagerly")


def run_with_hooks(adapter, inputs, trace: Trace, keep: set[int]) -> None:
    """The default capture: the family's hooks around the library's own forward."""
    regs = adapter.edit_hooks(trace.edits)  # first, so the capture hooks see the edited values
    for block in range(trace.n_blocks):
        regs += adapter.capture_hooks(block, trace, keep_pattern=block in keep)
    regs += adapter.final_hooks(trace)
    with eager_attention(adapter.model), hooks(regs):
        trace.logits = adapter.forward_logits(inputs)


make_module_callable(__name__, capture)  # core.capture(...) is the function (core/lazy.py)
