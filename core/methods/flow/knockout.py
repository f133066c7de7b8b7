"""Attention knockout over layer windows.

An *edge kind* ``SOURCE->TARGET`` names two position sets
(:mod:`core.methods.flow.positions`): every attention edge from a query in the
target set to a key in the source set is cut in a window of ``width``
consecutive layers centred on each layer in turn, and in all layers at once;
each cut is one forward, whose answer numbers (:class:`Target`) are read at the
answer position.

The cut is made on the model's own attention path: the additive mask each
affected attention call receives gets ``-inf`` at the cut entries
(:class:`core.forward.edits.Edit` site ``knockout``, applied by the adapter's
edit hooks; CoCa's replay adds it to its scores), so the softmax gives them
zero weight and the row renormalises over the edges that remain; no switch to
eager attention. In a self-attention block the keys are sequence positions; in
a cross-attention block (the image read through cross-attention) they are the
source's visual tokens, and a text source has no edge there. ``heads``
restricts the cut to those heads of every block (None: all heads).

What it can support: that the answer needs the direct edges of this kind in
these layers, under renormalised routing. What it cannot: what flows along
them; information can still reach the query through other positions that read
the source (indirect routes), and the renormalised mass goes somewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from core.errors import InterventionError
from core.forward.capture import Trace, capture
from core.forward.edits import Edit
from core.methods.flow.batches import edited_rows
from core.methods.flow.positions import EdgeKind, PositionSet, position_sets
from core.methods.interventions import answer_values
from core.methods.patterns import FULL_PATTERN_LIMIT
from core.results.audit import AuditRecord
from core.results.readout import AnswerEffect, Target

ALL_LAYERS = "all"  # the window of every layer

_NOTES = [
    "the cut weights are set to 0 before the softmax normalises, so the remaining keys gain their mass: "
    "the effect mixes losing the edges with re-routing to the others",
    "information can still reach the query through other positions that read the source (indirect routes), "
    "unless those edges are cut too",
    "a window's effect is of cutting every edge of the kind in all its layers at once; windows overlap",
    "in a cross-attention block whose every key is cut the query reads nothing: its weights are all 0, "
    "so the heads' outputs there are 0 (the block adds its output bias only)",
]


def layer_of(block_name: str) -> str:
    """The layer a block belongs to: ``L3.xattn`` is layer ``L3``'s cross-attention."""
    return block_name.split(".", 1)[0]


def windows(layers: Sequence[str], width: int) -> list[tuple[str, list[str]]]:
    """``(centre, layers)`` of each window of ``width`` consecutive layers centred on each
    layer in turn (clipped at both ends; an even width reaches one layer further to later
    layers than to earlier ones), then ``(ALL_LAYERS, every layer)``."""
    if width < 1:
        raise InterventionError(f"window width {width}: at least 1 layer")
    below, above = (width - 1) // 2, width // 2
    out = [(centre, list(layers[max(0, i - below) : i + above + 1])) for i, centre in enumerate(layers)]
    return out + [(ALL_LAYERS, list(layers))]


@dataclass
class CutBlock:
    """The edges cut in one block: ``queries`` and ``keys`` (sequence positions, or visual
    tokens for a cross-attention block's keys)."""

    block: str
    queries: list[int]
    keys: list[int]

    def to_dict(self) -> dict:
        return {"block": self.block, "queries": self.queries, "keys": self.keys}

    @classmethod
    def from_dict(cls, d: dict) -> CutBlock:
        return cls(str(d["block"]), [int(q) for q in d["queries"]], [int(k) for k in d["keys"]])


@dataclass
class KnockoutWindow:
    """One window's cut and its answer numbers.

    Attributes:
        centre: the layer the window is centred on, or ``"all"``.
        layers: the layers in the window.
        cut: the blocks whose edges were cut (a block where the kind has no edge is absent).
        edited: the answer numbers with the edges cut (the original's when nothing was cut).
        effect: edited minus original.
    """

    centre: str
    layers: list[str]
    cut: list[CutBlock]
    edited: Target
    effect: AnswerEffect

    def to_dict(self) -> dict:
        return {
            "centre": self.centre,
            "layers": self.layers,
            "cut": [c.to_dict() for c in self.cut],
            "edited": self.edited.to_dict(),
            "effect": self.effect.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> KnockoutWindow:
        return cls(
            str(d["centre"]),
            [str(x) for x in d["layers"]],
            [CutBlock.from_dict(c) for c in d["cut"]],
            Target.from_dict(d["edited"]),
            AnswerEffect.from_dict(d["effect"]),
        )


@dataclass
class KnockoutProfile:
    """One edge kind over every window: its sets and each window's numbers."""

    edge: str
    source: PositionSet
    target: PositionSet
    windows: list[KnockoutWindow]
    rollout_reach: list[float] | None = None
    rollout_correlation: float | None = None

    def window(self, centre: str) -> KnockoutWindow | None:
        return next((w for w in self.windows if w.centre == centre), None)

    def drops(self, layers: Sequence[str]) -> list[float | None]:
        """The drop of the target score (:attr:`AnswerEffect.drop`) of the window centred on
        each of ``layers`` (None where it did not run)."""
        return [None if self.window(x) is None else self.window(x).effect.drop for x in layers]

    def to_dict(self) -> dict:
        return {
            "edge": self.edge,
            "source": self.source.to_dict(),
            "target": self.target.to_dict(),
            "windows": [w.to_dict() for w in self.windows],
            "rollout_reach": self.rollout_reach,
            "rollout_correlation": self.rollout_correlation,
        }

    @classmethod
    def from_dict(cls, d: dict) -> KnockoutProfile:
        reach = d.get("rollout_reach")
        corr = d.get("rollout_correlation")
        return cls(
            str(d["edge"]),
            PositionSet.from_dict(d["source"]),
            PositionSet.from_dict(d["target"]),
            [KnockoutWindow.from_dict(w) for w in d["windows"]],
            None if reach is None else [float(x) for x in reach],
            None if corr is None else float(corr),
        )


@dataclass
class KnockoutResult:
    """Every edge kind's knockout profile against one unedited run.

    Attributes:
        position: the answer position the numbers are read at.
        original: the unedited run's numbers.
        width: the window width in layers.
        heads: the heads cut in every block (None: all).
        layers: the model's layers, in order (the profiles' x-axis).
        profiles: one per edge kind, in the order asked.
        cancelled: a cancel stopped the sweep (the windows run so far are kept).
    """

    position: int
    original: Target
    width: int
    heads: list[int] | None
    layers: list[str]
    profiles: list[KnockoutProfile]
    audit: AuditRecord | None = field(default=None, repr=False)
    cancelled: bool = False

    kind = "knockout"  # the session's run kind (core.results.readout.Readout)

    def profile(self, edge: str) -> KnockoutProfile | None:
        return next((p for p in self.profiles if p.edge == edge), None)

    def summary(self) -> str:
        """``knockout (window 1) at position 12: image->answer in all layers: 'blue' logit diff ...``."""
        from core.results.readout import change_line

        parts = []
        for p in self.profiles:
            every = p.window(ALL_LAYERS)
            if every is not None:
                parts.append(
                    f"{p.edge} in all layers: {change_line(self.original, every.edited, every.effect.flipped)}"
                )
        said = "; ".join(parts) or "no window ran"
        return f"knockout (window {self.width}) at position {self.position}: {said}" + (
            " [cancelled]" if self.cancelled else ""
        )

    def parameters(self) -> dict:
        return {
            "method": "attention knockout",
            "position": self.position,
            "answer": self.original.answer,
            "foil": self.original.foil,
            "edges": [p.edge for p in self.profiles],
            "window": self.width,
            "heads": self.heads,
        }

    def audit_records(self) -> list[AuditRecord]:
        return [self.audit] if self.audit else []

    def to_dict(self) -> dict:
        return {
            "method": "attention knockout",
            "position": self.position,
            "original": self.original.to_dict(),
            "window": self.width,
            "heads": self.heads,
            "layers": self.layers,
            "profiles": [p.to_dict() for p in self.profiles],
            "audit": self.audit.to_dict() if self.audit else None,
            "cancelled": self.cancelled,
        }

    @classmethod
    def from_dict(cls, d: dict) -> KnockoutResult:
        return cls(
            int(d["position"]),
            Target.from_dict(d["original"]),
            int(d["window"]),
            None if d["heads"] is None else [int(h) for h in d["heads"]],
            [str(x) for x in d["layers"]],
            [KnockoutProfile.from_dict(p) for p in d["profiles"]],
            AuditRecord.from_dict(d["audit"]) if d.get("audit") else None,
            bool(d.get("cancelled", False)),
        )


def block_cuts(
    trace: Trace, source: PositionSet, target: PositionSet, blocks: Sequence[int]
) -> list[tuple[int, list[int]]]:
    """``(block, keys)`` of each of ``blocks`` where the edge kind has edges: a self-attention
    block's keys are the source's sequence positions, a cross-attention block's its visual
    tokens (a cut that would leave a query no key is refused by :meth:`Edit.knock`)."""
    out = []
    for b in blocks:
        keys = list(source.visual) if trace.block_kinds[b] == "cross" else list(source.positions)
        if keys and target.positions:
            out.append((b, keys))
    return out


def reads_nothing(trace: Trace, block: int, keys: Sequence[int]) -> bool:
    """Whether the cut takes every key of cross-attention ``block``: the row then reads
    nothing (all its weights 0), which a softmax over no key cannot say."""
    kv = trace.kv_source[block]
    return trace.block_kinds[block] == "cross" and kv is not None and set(range(kv.shape[1])) <= set(keys)


def knockout_edits(trace: Trace, cuts, target: PositionSet, heads: Sequence[int] | None) -> list[Edit]:
    """One :class:`Edit` per cut block and head (one for all heads: None): site ``knockout``;
    a cross-attention block whose every key is cut reads nothing at the queries, so its head
    outputs there are 0 (site ``z`` zeroed: a weighted sum with every weight 0)."""
    edits = []
    for b, keys in cuts:
        for h in heads if heads is not None else [None]:
            if not reads_nothing(trace, b, keys):
                edits.append(Edit(b, h, tuple(target.positions), site="knockout", keys=tuple(keys)))
            elif h is not None:
                edits.append(Edit(b, h, tuple(target.positions), site="z"))
            else:
                edits += [Edit(b, g, tuple(target.positions), site="z") for g in range(trace.z[b].shape[2])]
    return edits


class RolloutReach:
    """A pattern stream (``capture(pattern_streams=...)``) that keeps, after each layer, how
    much of the target rows of attention rollout (:class:`core.methods.patterns.RolloutStream`,
    docs/METHODS.md §4.6) lands on the source nodes: ``reach[edge][layer]`` = the target
    positions' mean of ``sum over sources R_l[target, source]``, ``R_l`` the rollout through
    layer ``l``. A structural approximation of flow, set beside the knockout profile; not a
    decomposition of the output."""

    def __init__(self, trace_blocks: Sequence[str], pairs: dict[str, tuple[PositionSet, PositionSet]], alpha: float):
        from core.methods.patterns import RolloutStream

        self.stream = RolloutStream(alpha)
        self.names = list(trace_blocks)
        self.pairs = pairs
        self.reach: dict[str, dict[str, float]] = {edge: {} for edge in pairs}

    def __call__(self, block: int, kind: str, rows) -> None:
        self.stream(block, kind, rows)
        matrix, n = self.stream.matrix[0], self.stream.n_pos
        layer = layer_of(self.names[block])
        for edge, (source, target) in self.pairs.items():
            nodes = list(source.positions) + [n + v for v in source.visual if n + v < matrix.shape[1]]
            nodes = [x for x in nodes if x < matrix.shape[1]]
            value = float(matrix[list(target.positions)][:, nodes].sum(-1).mean()) if nodes else 0.0
            self.reach[edge][layer] = value  # the layer's last block's value stays


def profile_correlation(drops: Sequence[float | None], reach: Sequence[float]) -> float | None:
    """Pearson's correlation over the layers between knockout's drop and rollout's reach
    (None for fewer than three layers or a constant profile)."""
    pairs = [(d, r) for d, r in zip(drops, reach) if d is not None]
    if len(pairs) < 3:
        return None
    x = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    y = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    x, y = x - x.mean(), y - y.mean()
    norm = float(x.norm() * y.norm())
    return None if norm == 0 else float((x * y).sum()) / norm


@torch.no_grad()
def knockout_sweep(
    loaded,
    inputs,
    image,
    question: str,
    edges: Sequence[EdgeKind],
    answer_id: int,
    foil_id: int | None = None,
    *,
    width: int = 1,
    heads: Sequence[int] | None = None,
    region: Sequence[int] = (),
    answer_prefix: Sequence[int] = (),
    batch_size: int = 8,
    rollout_alpha: float | None = 0.5,
    base: Trace | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    cancel: Callable[[], bool] | None = None,
) -> KnockoutResult:
    """Cut each edge kind in every window (:func:`windows`) and read the answer.

    The windows run as rows of batched forwards, ``batch_size`` edited copies of the
    input each, every row's edges cut in its row only (:attr:`Edit.rows`), with nothing
    recorded (:func:`core.forward.capture.edited_logits`); a window where the kind has no
    edge needs no forward (its numbers are the original's).

    Args:
        inputs: the prepared batch (one row) of ``image`` and ``question`` (with ``answer_prefix``).
        edges: the edge kinds, each a profile.
        width: the window width in layers.
        heads: the heads cut in every block (None: all).
        region: the painted region's visual tokens (the ``region`` set).
        batch_size: edited copies per forward.
        rollout_alpha: the rollout's mixing weight for its per-layer reach beside each profile
            (one more capture, full patterns; None, or a sequence past the rollout's limit: none).
        base: the unedited capture of ``inputs`` (run here when None).
        progress: ``progress(done, total, message)`` after each forward.
        cancel: polled before each forward; True stops with the windows so far.
    """
    adapter = loaded.adapter
    if base is None:
        base = capture(loaded, None, "", pattern_layers=[], inputs=inputs)
    if heads is not None:
        heads = sorted(set(int(h) for h in heads))
        if heads and (heads[0] < 0 or heads[-1] >= adapter.n_heads):
            raise InterventionError(f"heads {heads}: the model has heads 0-{adapter.n_heads - 1}")
    if batch_size < 1:
        raise InterventionError(f"batch size {batch_size}: at least 1")
    names = [n for e in edges for n in (e.source, e.target)]
    sets = position_sets(adapter, base, inputs, question, names, region=region, answer_prefix=answer_prefix)
    position = int(base.answer_positions[0])
    original = answer_values(adapter, base, answer_id, foil_id)
    # only blocks that attend have edges to cut: a hybrid decoder's other layers are left as they run
    attending = base.attention_blocks
    uncut = [b for b in range(base.n_blocks) if b not in attending]
    layers = list(dict.fromkeys(layer_of(base.block_names[b]) for b in attending))
    blocks_of = {layer: [b for b in attending if layer_of(base.block_names[b]) == layer] for layer in layers}
    plan = windows(layers, width)

    cuts_of = {}  # (edge index, window index) -> [(block, keys)]
    for i, edge in enumerate(edges):
        source, target = sets[edge.source], sets[edge.target]
        for w, (_, in_window) in enumerate(plan):
            cuts_of[i, w] = block_cuts(base, source, target, [b for layer in in_window for b in blocks_of[layer]])
    runs = [key for key, cuts in cuts_of.items() if cuts]
    edited_of = {}
    rows = edited_rows(
        loaded, inputs, runs, lambda key: knockout_edits(base, cuts_of[key], sets[edges[key[0]].target], heads),
        batch_size=batch_size, image=image, question=question, answer_prefix=answer_prefix, cancel=cancel,
    )  # fmt: skip
    for done, chunk, logits in rows:
        for row, key in enumerate(chunk):
            edited_of[key] = Target.from_logits(adapter, logits[row, position], answer_id, foil_id, position=position)
        if progress is not None:
            i, w = chunk[-1]
            progress(done, len(runs), f"{edges[i].name}, window at {plan[w][0]}")
    cancelled = len(edited_of) < len(runs)

    reach = None
    if rollout_alpha is not None and base.input_ids.shape[1] <= FULL_PATTERN_LIMIT and not uncut:
        pairs = {e.name: (sets[e.source], sets[e.target]) for e in edges}
        reach = RolloutReach(base.block_names, pairs, rollout_alpha)
        capture(loaded, None, "", inputs=inputs, pattern_layers=[], pattern_streams=[reach])

    profiles = []
    for i, edge in enumerate(edges):
        rows = []
        for w, (centre, in_window) in enumerate(plan):
            cuts = cuts_of[i, w]
            if cuts and (i, w) not in edited_of:  # cancelled before it ran
                continue
            edited = edited_of.get((i, w), original)
            cut = [CutBlock(base.block_names[b], list(sets[edge.target].positions), keys) for b, keys in cuts]
            rows.append(KnockoutWindow(centre, in_window, cut, edited, AnswerEffect.between(original, edited)))
        profile = KnockoutProfile(edge.name, sets[edge.source], sets[edge.target], rows)
        if reach is not None:
            profile.rollout_reach = [reach.reach[edge.name].get(x, 0.0) for x in layers]
            profile.rollout_correlation = profile_correlation(profile.drops(layers), profile.rollout_reach)
        profiles.append(profile)
    audit = AuditRecord.for_method(
        "attention knockout",
        controls=["unedited run of the same input", "windows of every layer and all layers at once"]
        + (["competing token (foil)"] if foil_id is not None else []),
        parameters={
            "position": position,
            "answer_id": int(answer_id),
            "foil_id": foil_id,
            "edges": [e.name for e in edges],
            "window": width,
            "heads": heads,
        },
        notes=list(_NOTES)
        + (
            [
                f"beside each profile, attention rollout's reach (alpha {rollout_alpha}) and its correlation with "
                "knockout's drop over the layers: a correlation of a structural approximation with an "
                "intervention, not a decomposition of the output"
            ]
            if reach is not None
            else []
        )
        + (
            [
                f"not cut: {', '.join(base.block_names[b] for b in uncut)} ({adapter.no_pattern(uncut[0])}): "
                "information still moves between positions there, so a cut of every attention layer is not a "
                "cut of the edge; no rollout beside the profiles (it needs every layer's pattern)"
            ]
            if uncut
            else []
        ),
    )
    return KnockoutResult(position, original, width, heads, layers, profiles, audit, cancelled)
