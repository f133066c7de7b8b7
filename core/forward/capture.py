"""One no-grad forward that records what the read-outs need: a :class:`Trace`.

Hooks are scoped: registered inside :func:`hooks` and removed in its
``finally``, so none outlives a run. By default the model runs its own
attention implementation (sdpa, or flash where it was loaded with it) and the
attention patterns a read-out asks for are recomputed, row by row, from the
queries, keys and mask each attention call received (core/forward/attention_rows.py,
docs/ARCHITECTURE.md "Capture on the sdpa path"); ``attention="eager"``
switches the language model to eager attention for the run instead (and back
afterwards) and keeps the rows of the weights it returns: the oracle the
recomputed rows are tested against.

Each head's output is kept as the output projection's input ``z``
``(batch, pos, heads, d_head)`` (a view, no copy); ``W_O^h z^h`` is
materialised only for the positions a method asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from core.errors import UndefinedReadoutError, oom_guard
from core.forward import attention_rows
from core.forward.attention_rows import RecomputedRows

# The block kinds that attend: they have heads and a pattern (the others are MIXER_KINDS).
ATTENTION_KINDS = ("self", "cross")


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
        attn_out: per layer ``(batch, pos, d_model)``: the attention block's output
            (W_O z + b_O, as the block adds it), on request (``keep_attn_out``): no
            read-out needs it beside ``z``; it is what the heads are checked to sum to.
        mlp_out: per layer ``(batch, pos, d_model)``.
        patterns: per kept block ``(batch, heads, n_query, keys)``: attention weights
            of the kept query positions (keys: sequence positions for self-attention,
            visual tokens for cross-attention).
        block_names, block_kinds: per block, its name and kind: "self" or "cross"
            (attention), or a mixer kind without attention pattern ("linear",
            "conv": :data:`core.models.declaration.MIXER_KINDS`).
        mixer_out: per mixer block (a kind without pattern) ``(batch, pos, d_model)``:
            its token mixer's write (such a block has no heads: its ``z`` is None).
        mlp_in: per mixture-of-experts block ``(batch, pos, d_model)``: what its MoE
            module read (the router's and experts' input), so each expert's write is
            recomputed for the positions a read-out asks for.
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
        edits: the :class:`core.forward.edits.Edit` s this run was made with; empty for
            the model's own computation.
        query_positions: ``(n_query,)`` the kept query positions (same for every batch row).
        final_resid: ``(batch, pos, d_model)`` x_L, before the final norm.
        logits: ``(batch, pos, vocab)``.
        attention: how the patterns were obtained: "sdpa" (recomputed rows of
            the model's own attention calls) or "eager" (the weights eager
            attention returned).
        pattern_blocks: the blocks whose rows ``patterns`` keeps.
        pattern_streams: during the capture only, callables
            ``stream(block, kind, rows)`` each block's whole pattern is offered
            to (``rows.rows(positions)``, chunk by chunk: rollout); emptied after.
    """

    input_ids: torch.Tensor
    answer_positions: torch.Tensor
    visual_positions: torch.Tensor
    resid_pre: list[torch.Tensor] = field(default_factory=list)
    z: list[torch.Tensor] = field(default_factory=list)
    attn_out: list[torch.Tensor] = field(default_factory=list)
    mlp_out: list[torch.Tensor] = field(default_factory=list)
    mixer_out: dict[int, torch.Tensor] = field(default_factory=dict)
    mlp_in: dict[int, torch.Tensor] = field(default_factory=dict)
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
    edits: list = field(default_factory=list)  # core.forward.edits.Edit applied in this run (empty: the model as is)
    answer_id: int | None = None  # the target token the caller named (capture(answer=...)), else None
    foil_id: int | None = None
    norm_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # post-norm families: each stream norm's input
    attention: str = "sdpa"
    pattern_blocks: set[int] = field(default_factory=set)
    keep_attn_out: bool = False
    pattern_streams: list[Callable] = field(default_factory=list)

    @property
    def n_blocks(self) -> int:
        return len(self.resid_pre)

    @property
    def attention_blocks(self) -> list[int]:
        """The blocks that attend (kind "self" or "cross"): the ones with heads and a pattern."""
        return [b for b, kind in enumerate(self.block_kinds) if kind in ATTENTION_KINDS]

    def head_output(self, adapter, block: int, positions: torch.Tensor | int, batch: int = 0) -> torch.Tensor:
        """``W_O^h z^h`` for the given positions: ``(n_pos, heads, d_model)``."""
        if self.z[block] is None:
            raise UndefinedReadoutError(adapter.no_pattern(block))
        z = self.z[block][batch, positions]  # (n_pos, heads, d_head) or (heads, d_head)
        return torch.einsum("...hd,hdm->...hm", z, adapter.W_O(block).to(z.dtype))


def no_pattern_note(adapter, trace: Trace) -> str | None:
    """What a read-out over attention patterns says of a hybrid decoder's other
    blocks (``"no attention pattern at L0, L2 (Gated DeltaNet linear attention)"``);
    None when every block attends."""
    by_what: dict[str, list[str]] = {}
    for b in range(trace.n_blocks):
        if b not in trace.attention_blocks:
            mixer = adapter.mixer(b)
            by_what.setdefault(mixer.what if mixer is not None else trace.block_kinds[b], []).append(
                trace.block_names[b]
            )
    if not by_what:
        return None
    said = "; ".join(f"{', '.join(names)} ({what})" for what, names in by_what.items())
    return f"no attention pattern and no heads at {said}: not read, and not zero"


def on_device_of(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` on the device of ``module``'s weights: what a capture hook records of a
    module's input, so a model spread over devices (accelerate's device map, whose
    hook moves the input only after the forward pre-hooks ran) keeps each block's
    record where the block's weights are; ``x`` itself when already there."""
    p = next(module.parameters(), None)
    return x if p is None else x.to(p.device)


@contextmanager
def hooks(registrations: Sequence[tuple[torch.nn.Module, str, object]]) -> Iterator[None]:
    """Register ``(module, kind, fn)`` hooks (kind: "pre", "pre_kw", "fwd", "fwd_kw") and
    remove every one on exit, whatever happens inside."""
    handles = []
    try:
        for module, kind, fn in registrations:
            if kind == "pre":
                handles.append(module.register_forward_pre_hook(fn))
            elif kind == "pre_kw":
                handles.append(module.register_forward_pre_hook(fn, with_kwargs=True))
            elif kind == "fwd_kw":
                handles.append(module.register_forward_hook(fn, with_kwargs=True))
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


ATTENTION_MODES = ("sdpa", "eager")


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
    attention: str = "sdpa",
    pattern_streams: Sequence[Callable] = (),
    keep_attn_out: bool = False,
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
        edits: :class:`core.forward.edits.Edit` s to apply (ablation or patching); the
            trace then records the edited run and says so in ``trace.edits``.
        inputs: the prepared batch, when the caller already has it (saves
            running the processor twice).
        attention: "sdpa" (default): the model's own attention runs and the
            kept rows are recomputed from what each call received; "eager":
            the language model runs eager attention and the rows are those of
            the weights it returns. Families whose attention has no fast path
            (BLIP's, CoCa's replay) compute their pattern either way.
        pattern_streams: ``stream(block, kind, rows)`` called once per block
            with its whole pattern, which ``rows.rows(positions)`` gives a
            chunk at a time (see :class:`core.methods.patterns.RolloutStream`).
        keep_attn_out: also keep each block's attention output (``trace.attn_out``,
            one ``(batch, pos, d_model)`` per block: the memory of a forward's
            activations, for checks that the heads sum to it).
    """
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention: {attention!r} is not one of {', '.join(ATTENTION_MODES)}")
    adapter = loaded.adapter
    if inputs is None:
        inputs = adapter.prepare([image], [question])
    blocks = adapter.blocks
    n = len(blocks)
    attending = {b for b, (_, kind) in enumerate(blocks) if kind in ATTENTION_KINDS}
    keep = set(attending if pattern_layers is None else pattern_layers)
    qk_blocks = attending if keep_qk is True else set(keep_qk or ())
    for b in sorted((keep | qk_blocks) - attending):
        if 0 <= b < n:
            raise UndefinedReadoutError(adapter.no_pattern(b))
    if pattern_streams and len(attending) < n:
        raise UndefinedReadoutError(
            f"{adapter.no_pattern(min(set(range(n)) - attending))}; a product of every layer's pattern "
            "(rollout) is not defined"
        )
    qpos = torch.as_tensor(
        list(query_positions) if query_positions is not None else [int(inputs.answer_positions[0])],
        dtype=torch.long,
    )
    n_pos = inputs.input_ids.shape[1]
    if len(qpos) and not (-n_pos <= int(qpos.min()) and int(qpos.max()) < n_pos):
        raise IndexError(f"query positions out of range: the sequence has {n_pos} positions")
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
        attention=attention,
        pattern_blocks=keep,
        pattern_streams=list(pattern_streams),
        keep_attn_out=keep_attn_out,
    )
    try:
        with oom_guard("capturing (keep fewer layers or query positions)"):
            with record_attention(adapter, trace, qk_blocks):
                adapter.run_capture(inputs, trace, keep)
    finally:
        trace.pattern_streams = []
    rows = torch.arange(trace.logits.shape[0], device=trace.logits.device)
    adapter.check_logits(trace.logits[rows, inputs.answer_positions.to(rows.device)])
    return trace


@torch.no_grad()
def edited_logits(loaded, inputs, edits: Sequence) -> torch.Tensor:
    """``(batch, pos, vocab)`` logits of one forward of ``inputs`` with ``edits`` applied and
    nothing recorded: the family's edit hooks around the library's own forward (its fast
    attention path); a family that applies edits in its own replay (``replays_edits``) runs
    :func:`capture` instead. What a sweep of many edited forwards runs."""
    adapter = loaded.adapter
    if adapter.replays_edits:
        return capture(loaded, None, "", pattern_layers=[], edits=edits, inputs=inputs).logits
    with oom_guard("running the edited forward (a smaller batch)"), hooks(adapter.edit_hooks(list(edits))):
        logits = adapter.forward_logits(inputs)
    rows = torch.arange(logits.shape[0], device=logits.device)
    adapter.check_logits(logits[rows, inputs.answer_positions.to(rows.device)])
    return logits


def gradient_logits(loaded, inputs, edits: Sequence) -> torch.Tensor:
    """:func:`edited_logits` with autograd on: the logits' graph reaches every value an
    edit adds (``Edit.add`` with a zero tensor that requires grad reads the gradient of
    any function of the logits at that activation). A replaying family runs the capture
    itself with grad enabled (``capture`` without its no-grad wrapper)."""
    adapter = loaded.adapter
    with torch.enable_grad():
        if adapter.replays_edits:
            return capture.__wrapped__(loaded, None, "", pattern_layers=[], edits=edits, inputs=inputs).logits
        with hooks(adapter.edit_hooks(list(edits))):
            return adapter.forward_logits(inputs)


def record_pattern(trace: Trace, block: int, source) -> None:
    """What block ``block``'s pattern gives the trace: the rows of
    ``trace.query_positions`` (if the block's are kept) and the whole
    pattern, offered to each of ``trace.pattern_streams``. ``source`` is a
    :class:`core.forward.attention_rows.WeightsRows` (a pattern the model computed)
    or :class:`core.forward.attention_rows.RecomputedRows` (a recorded call)."""
    if block in trace.pattern_blocks:
        trace.patterns[block] = source.rows(trace.query_positions)
    for stream in trace.pattern_streams:
        stream(block, trace.block_kinds[block], source)


def recomputes_patterns(adapter, trace: Trace) -> bool:
    """Whether this capture recomputes patterns from recorded attention calls
    (the sdpa path of a family whose attention goes through transformers'
    attention functions); otherwise the family's hooks read the pattern the
    model computed."""
    return trace.attention == "sdpa" and getattr(adapter, "attention_functions", True)


def wants_pattern(trace: Trace, block: int) -> bool:
    """Whether block ``block``'s pattern is needed at all (kept rows or a stream)."""
    return block in trace.pattern_blocks or bool(trace.pattern_streams)


@contextmanager
def record_attention(adapter, trace: Trace, qk_blocks: set[int]) -> Iterator[None]:
    """Record what the language model's attention calls receive, for the
    run: the queries and keys of ``qk_blocks`` (``trace.q``, ``trace.k``,
    ``trace.score_scale``: the model's own pre-softmax scores are
    ``q k^T * scale`` before the mask) and, on the sdpa path, each block's
    pattern rows (:func:`record_pattern` of a
    :class:`core.forward.attention_rows.RecomputedRows`). Families that replay the
    forward themselves (``adapter.records_qk``) fill ``trace.q``/``trace.k``
    in their replay; families whose attention is computed inline (BLIP) hook
    their q/k projections (``adapter.qk_record_hooks``)."""
    if getattr(adapter, "records_qk", False):  # the family's replay fills trace.q / trace.k itself
        yield
        return
    own = adapter.qk_record_hooks(trace, qk_blocks)
    if own is not None:  # attention computed inline: the family hooks its q / k projections
        with hooks(own):
            yield
        return
    rows = recomputes_patterns(adapter, trace)
    blocks = set(qk_blocks) | ({b for b in range(trace.n_blocks) if wants_pattern(trace, b)} if rows else set())
    if not blocks:
        yield
        return

    def on_call(block, call):
        if block in qk_blocks:
            # (batch, heads, pos, d_head) -> (batch, pos, heads, d_head)
            trace.q[block] = call.query.transpose(1, 2)
            trace.k[block] = call.key.transpose(1, 2)
            trace.score_scale[block] = call.scaling
        if rows and wants_pattern(trace, block):
            # a stream walks every chunk after the kept rows asked for theirs: those (the prompt's
            # first and last chunks, as a rule) are computed once
            record_pattern(trace, block, RecomputedRows(call, reuse=2 if trace.pattern_streams else 0))

    with attention_rows.recording({b: adapter.attention_module(b) for b in blocks}, on_call) as seen:
        yield
    missing = blocks - seen
    if missing:
        raise RuntimeError(f"attention of blocks {sorted(missing)} not recorded: it did not go through transformers")


def run_with_hooks(adapter, inputs, trace: Trace, keep: set[int]) -> None:
    """The default capture: the family's hooks around the library's own
    forward; under ``attention="eager"`` with the language model switched to
    eager attention and each block's weights read by the family's hooks."""
    eager = not recomputes_patterns(adapter, trace)
    regs = adapter.edit_hooks(trace.edits)  # first, so the capture hooks see the edited values
    for block in range(trace.n_blocks):
        regs += adapter.capture_hooks(block, trace, keep_pattern=eager and wants_pattern(trace, block))
    regs += adapter.final_hooks(trace)
    switch = eager_attention(adapter.model) if trace.attention == "eager" else nullcontext()
    with switch, hooks(regs):
        trace.logits = adapter.forward_logits(inputs)
