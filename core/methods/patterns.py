"""Attention pattern estimators (docs/METHODS.md §4.2) for one query position.

Mass on BOS (and other sink positions) is always reported on its own, never
folded into the visual or entity averages; padding never counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from core.files.images import load_image
from core.forward.capture import capture, no_pattern_note
from core.forward.geometry import region_tokens
from core.results.audit import AuditRecord
from core.results.readout import from_dict_fields

FULL_PATTERN_LIMIT = 1024  # rollout's limit: it costs a pos^3 product per block (RolloutStream)


@dataclass
class HeadSummary:
    """One head's pattern at one query position.

    ``visual_patch_mass`` is the mass on each visual token laid out on the
    patch grid ``(rows, cols)`` of the primary image (see :func:`patch_grids`),
    patch-granular (no interpolation); ``visual_patch_mass_by_image`` holds
    every image's grid when the model sees several (tiles, a base and a
    high-resolution view). ``bos_mass`` is the sink's mass (position 0 / BOS);
    ``other_mass`` the mass on delimiter, special and global (CLS) tokens, kept
    out of the visual and text numbers.
    """

    layer: int  # block index (see Trace.block_names)
    head: int
    block: str
    visual_mass: float
    bos_mass: float
    entropy: float  # nats, over the whole pattern
    argmax_source: int
    visual_patch_mass: list[list[float]]
    other_mass: dict[str, float] = field(default_factory=dict)
    visual_patch_mass_by_image: list[dict] | None = None

    @property
    def name(self) -> str:
        """``L2.H3``: the block's name, then the head."""
        return f"{self.block}.H{self.head}"

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> HeadSummary:
        """The head a :meth:`to_dict` (a stored analyze ``attention`` row) describes."""
        return from_dict_fields(cls, d)


@dataclass
class PatternSummary:
    query_position: int
    heads: list[HeadSummary]
    audit: AuditRecord = field(repr=False, default=None)


def mass(pattern: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """``pattern (..., pos)``, ``sources (n,)`` positions -> ``(...)`` summed weight."""
    return pattern[..., sources].sum(-1)


def entropy(pattern: torch.Tensor) -> torch.Tensor:
    """``(..., pos) -> (...)``: -sum A log A in nats (0 log 0 = 0)."""
    p = pattern.clamp_min(0)
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)


def patch_grids(values: torch.Tensor, tokens) -> list[tuple[int, torch.Tensor]]:
    """Lay per-token values onto each image's patch grid.

    Args:
        values: ``(..., n_tokens)``, one per visual token in ``tokens`` order.
        tokens: the :class:`core.forward.geometry.VisualToken` list.

    Returns:
        ``[(image, (..., rows, cols))]`` sorted by image; tokens without a
        patch (``col < 0``: newline, CLS) are left out; cells no token covers are NaN.
    """
    if values.shape[-1] != len(tokens):
        raise ValueError(f"{values.shape[-1]} values for {len(tokens)} visual tokens")
    out = []
    for im in sorted({t.image for t in tokens if t.col >= 0}):
        idx = [k for k, t in enumerate(tokens) if t.image == im and t.col >= 0]
        rows = max(tokens[k].row for k in idx) + 1
        cols = max(tokens[k].col for k in idx) + 1
        grid = values.new_full((*values.shape[:-1], rows, cols), float("nan"))
        r = torch.tensor([tokens[k].row for k in idx])
        c = torch.tensor([tokens[k].col for k in idx])
        grid[..., r, c] = values[..., torch.tensor(idx)]
        out.append((im, grid))
    return out


def primary_image(tokens) -> int | None:
    """The image whose patch boxes cover the most of the original image (the
    whole-image view: LLaVA-NeXT's base image, Idefics3's global image); ties
    go to the lower index. None where no visual token covers a patch (a
    resampler's latents, Idefics2): there is no patch map to draw."""
    area: dict[int, float] = {}
    for t in tokens:
        if t.col >= 0:
            x0, y0, x1, y1 = t.box
            area[t.image] = area.get(t.image, 0.0) + max(0.0, x1 - x0) * max(0.0, y1 - y0)
    if not area:
        return None
    best = max(area.values())
    return min(im for im, a in area.items() if a >= best * (1 - 1e-9))


def key_roles(adapter, trace, block: int, batch: int = 0) -> list[str]:
    """The role of every key of block ``block``: the sequence's token roles
    for self-attention; for cross-attention the family's key roles ("visual",
    or "visual_global" for a CLS-like key)."""
    if trace.block_kinds[block] == "cross":
        return adapter.cross_key_roles(trace, block, batch)
    return adapter.token_roles(trace, batch)


def summarize_heads(adapter, trace, tokens, query_index: int = 0, batch: int = 0) -> PatternSummary:
    """Mass on the visual tokens, on the sink, on delimiters, entropy and the
    argmax source for every kept block and head at ``trace.query_positions[query_index]``.

    Args:
        tokens: the visual tokens (``adapter.visual_tokens``), aligned with
            ``trace.visual_positions`` (self-attention) or the keys of the
            cross-attention blocks.
    """
    heads = []
    primary = primary_image(tokens)
    for layer in sorted(trace.patterns):
        pat = trace.patterns[layer][batch, :, query_index].float()  # (heads, keys)
        roles = key_roles(adapter, trace, layer, batch)
        if "padding" in roles and float(pat[:, [i for i, r in enumerate(roles) if r == "padding"]].max()) > 1e-6:
            raise RuntimeError(f"block {layer}: attention reached padding positions")
        by_role = {r: torch.tensor([i for i, x in enumerate(roles) if x == r], dtype=torch.long) for r in set(roles)}
        empty = torch.zeros(0, dtype=torch.long)
        vm = mass(pat, by_role.get("visual", empty))
        bm = mass(pat, by_role.get("sink", empty))
        others = {r: mass(pat, idx) for r, idx in by_role.items() if r not in ("visual", "sink", "text", "padding")}
        ent = entropy(pat)
        arg = pat.argmax(-1)
        if trace.block_kinds[layer] == "cross":
            vis_values = pat
        elif trace.visual_positions.shape[1]:
            vis_values = pat[:, trace.visual_positions[batch]]
        else:  # a text-only block of a cross-attention model: no visual key
            vis_values = pat.new_zeros(pat.shape[0], len(tokens))
        grids = patch_grids(vis_values, tokens)
        by_image = dict(grids)
        for h in range(pat.shape[0]):
            heads.append(
                HeadSummary(
                    layer,
                    h,
                    trace.block_names[layer],
                    float(vm[h]),
                    float(bm[h]),
                    float(ent[h]),
                    int(arg[h]),
                    by_image[primary][h].tolist() if primary is not None else None,  # no patch: no map
                    {r: float(v[h]) for r, v in sorted(others.items())},
                    [{"image": im, "grid": g[h].tolist()} for im, g in grids] if len(grids) > 1 else None,
                )
            )
    qpos = int(trace.query_positions[query_index])
    audit = AuditRecord.for_method(
        "pattern analysis",
        controls=[
            "padding excluded (checked)",
            "sink mass reported separately",
            "delimiter / special / global-token mass reported separately",
            "patch-granular (not interpolated)",
        ],
        parameters={"query_position": qpos, "layers": sorted(trace.patterns), "primary_image": primary},
        notes=[
            "attention aligned with a region shows routing co-occurrence only; a high weight on a source "
            "whose value is small may not matter"
        ]
        + [note for note in [no_pattern_note(adapter, trace)] if note],
    )
    return PatternSummary(qpos, heads, audit)


ROLES = ("sink", "visual", "visual_delimiter", "visual_global", "special", "text")


def role_mass(adapter, trace, query_index: int = 0, batch: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    """Mass on each key role (:func:`key_roles`) for every kept block:
    ``{block: {role: (heads,)}}``. Sink, delimiter, global and special mass
    stay apart from visual and text mass; padding gets no mass (checked)."""
    out = {}
    for block in sorted(trace.patterns):
        pat = trace.patterns[block][batch, :, query_index].float()  # (heads, keys)
        roles = key_roles(adapter, trace, block, batch)
        pad = [i for i, x in enumerate(roles) if x == "padding"]
        if pad and float(pat[:, pad].abs().max()) > 1e-6:
            raise RuntimeError(f"block {block}: attention reached padding positions")
        out[block] = {
            r: mass(pat, torch.tensor([i for i, x in enumerate(roles) if x == r], dtype=torch.long)) for r in ROLES
        }
    return out


@dataclass
class TextPatterns:
    """Attention among the prompt's text tokens, per self-attention block and head.

    The queries and the keys are the same positions: the prompt's text tokens
    (role "text" in :meth:`Adapter.token_roles`) and the answer position. The
    rest of each query row is not dropped silently: ``other_mass`` says how
    much went to keys outside the shown set, by role (sink / BOS, visual,
    delimiter, special; "text" only for text tokens left out by
    ``max_tokens``), so ``patterns.sum(-1) + sum(other_mass.values())`` is 1
    for every row.

    Attributes:
        positions: ``(n_text,)`` sequence positions of the shown tokens, ascending;
            the query rows and the key columns.
        tokens: the token string at each of ``positions``.
        answer_position: the answer position (always shown: the last row).
        blocks: the self-attention blocks used (block indices, ascending).
        block_names: their names (``Trace.block_names``), aligned with ``blocks``.
        skipped_blocks: names of the cross-attention blocks left out: their keys
            are image tokens only, so they have no text-text pattern.
        patterns: ``{block: (heads, queries, keys)}`` attention weights among the shown positions.
        other_mass: ``{block: {role: (heads, queries)}}`` mass each query row puts on
            keys outside ``positions``.
        allowed: ``{block: (queries, keys)}`` bool, which keys each query may attend
            (causal, or the prefix-LM mask); weights where it is False are 0.
        n_text_dropped: text tokens left out by ``max_tokens`` (the earliest ones).
    """

    positions: list[int]
    tokens: list[str]
    answer_position: int
    blocks: list[int]
    block_names: list[str]
    skipped_blocks: list[str]
    patterns: dict[int, torch.Tensor]
    other_mass: dict[int, dict[str, torch.Tensor]]
    allowed: dict[int, torch.Tensor]
    n_text_dropped: int = 0
    audit: AuditRecord = field(repr=False, default=None)

    def head(self, block: int, head: int) -> torch.Tensor:
        """``(queries, keys)``: one head's text-text pattern."""
        return self.patterns[block][head]

    def head_pattern(self, block: int, head: int) -> HeadTextPattern | None:
        """One head's weights, mask and hidden mass; None when ``block`` is not one
        of these (self-attention) blocks."""
        block, head = int(block), int(head)
        if block not in self.patterns:
            return None
        return HeadTextPattern(
            self.patterns[block][head],
            self.allowed[block],
            {role: v[head] for role, v in self.other_mass[block].items()},
        )

    def to_dict(self) -> dict:
        """JSON-ready, without the audit row: per-block lists aligned with
        ``blocks`` (JSON object keys would turn block indices into strings)."""
        return {
            "positions": list(self.positions),
            "tokens": list(self.tokens),
            "answer_position": self.answer_position,
            "blocks": list(self.blocks),
            "block_names": list(self.block_names),
            "skipped_blocks": list(self.skipped_blocks),
            "patterns": [self.patterns[b].tolist() for b in self.blocks],  # (blocks, heads, queries, keys)
            "other_mass": [{r: v.tolist() for r, v in self.other_mass[b].items()} for b in self.blocks],
            "allowed": [self.allowed[b].tolist() for b in self.blocks],
            "n_text_dropped": self.n_text_dropped,
        }

    @classmethod
    def from_dict(cls, d: dict) -> TextPatterns:
        """The inverse of :meth:`to_dict` (the audit row travels apart, in the analyze JSON's
        ``audit``). The weights are read in float64, which holds every JSON number as
        written, so ``from_dict(d).to_dict() == d`` (a float32 weight is one exactly)."""
        blocks = [int(b) for b in d["blocks"]]
        return cls(
            [int(p) for p in d["positions"]],
            list(d["tokens"]),
            int(d["answer_position"]),
            blocks,
            list(d["block_names"]),
            list(d.get("skipped_blocks", [])),
            {b: torch.tensor(p, dtype=torch.float64) for b, p in zip(blocks, d["patterns"], strict=True)},
            {
                b: {r: torch.tensor(v, dtype=torch.float64) for r, v in m.items()}
                for b, m in zip(blocks, d["other_mass"], strict=True)
            },
            {b: torch.tensor(a, dtype=torch.bool) for b, a in zip(blocks, d["allowed"], strict=True)},
            int(d.get("n_text_dropped", 0)),
        )


@dataclass(frozen=True)
class HeadTextPattern:
    """One head's text-side pattern (:meth:`TextPatterns.head_pattern`).

    Attributes:
        weights: ``(queries, keys)`` attention weights among the shown tokens.
        allowed: ``(queries, keys)`` bool, the keys each query may attend.
        other_mass: ``{role: (queries,)}`` the mass each query row put on keys not shown.
    """

    weights: torch.Tensor
    allowed: torch.Tensor
    other_mass: dict[str, torch.Tensor]


def head_text_pattern(text: dict | None, block: int, head: int) -> dict | None:
    """One head's text-side pattern from the JSON form (:meth:`TextPatterns.to_dict`,
    the analyze JSON's ``text_patterns``): ``{"weights": (queries, keys),
    "allowed": (queries, keys), "other_mass": {role: (queries,)}}`` as lists;
    None when there are no text patterns or ``block`` is not one of their
    (self-attention) blocks."""
    if not text or int(block) not in text.get("blocks", []):
        return None
    i = text["blocks"].index(int(block))
    return {
        "weights": text["patterns"][i][int(head)],
        "allowed": text["allowed"][i],
        "other_mass": {role: v[int(head)] for role, v in text["other_mass"][i].items()},
    }


def display_token(token: str, limit: int = 12) -> str:
    """A token as a label: line breaks and tabs escaped, a whitespace-only
    token shown as middle dots (a glyph every font has), a long one cut to ``limit`` characters."""
    shown = str(token).replace("\n", "\\n").replace("\t", "\\t")
    shown = shown if shown.strip() else "\u00b7" * max(1, len(shown))
    return shown if len(shown) <= limit else shown[: limit - 1] + "\u2026"


def text_positions(adapter, trace, batch: int = 0) -> list[int]:
    """The prompt's text positions (role "text") and the answer position, ascending."""
    answer = int(trace.answer_positions[batch])
    roles = adapter.token_roles(trace, batch)
    return [p for p, role in enumerate(roles) if role == "text" or p == answer]


def text_patterns(
    adapter,
    trace,
    token_strings: Sequence[str] | None = None,
    batch: int = 0,
    max_tokens: int | None = None,
) -> TextPatterns:
    """The attention pattern among the prompt's text tokens for every kept
    self-attention block and head (see :class:`TextPatterns`).

    Args:
        trace: a capture whose ``query_positions`` include every text position
            (:func:`text_positions`); ``capture(..., query_positions=range(seq_len))`` does.
        token_strings: one string per sequence position (the analyze JSON's
            ``input.tokens``); default: the tokenizer's tokens.
        max_tokens: keep at most this many text positions, the ones nearest the
            answer; the mass on the earlier ones is reported as "text" in ``other_mass``.

    Raises:
        ValueError: the trace kept no pattern row for some text position.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1 (the answer row), got {max_tokens}")
    roles = adapter.token_roles(trace, batch)
    positions = text_positions(adapter, trace, batch)
    n_dropped = max(0, len(positions) - max_tokens) if max_tokens is not None else 0
    positions = positions[n_dropped:]
    kept = trace.query_positions.tolist() if trace.query_positions is not None else []
    missing = [p for p in positions if p not in kept]
    if missing:
        raise ValueError(
            f"the trace kept no pattern row for text positions {missing}: "
            "capture with query_positions that include them (e.g. range(seq_len))"
        )
    if token_strings is None:
        token_strings = tokens_of_ids(adapter, trace.input_ids[batch].tolist())
    rows = torch.tensor([kept.index(p) for p in positions], dtype=torch.long)
    shown = set(positions)
    outside = {}
    for role in (*ROLES, "padding"):
        idx = [k for k, r in enumerate(roles) if r == role and k not in shown]
        if idx:
            outside[role] = torch.tensor(idx, dtype=torch.long)
    pad = outside.pop("padding", None)
    columns = torch.tensor(positions, dtype=torch.long)
    blocks = [b for b in sorted(trace.patterns) if trace.block_kinds[b] == "self"]
    patterns, other, allowed = {}, {}, {}
    for block in blocks:
        pat = trace.patterns[block][batch][:, rows.to(trace.patterns[block].device)].cpu()  # (heads, queries, keys)
        pat = pat.to(torch.promote_types(pat.dtype, torch.float32))  # half to float32; float64 stays exact
        if pad is not None and float(pat[..., pad].abs().max()) > 1e-6:
            raise RuntimeError(f"block {block}: attention reached padding positions")
        patterns[block] = pat[..., columns]
        other[block] = {role: pat[..., idx].sum(-1) for role, idx in outside.items()}
        allowed[block] = adapter.allowed_keys(trace, block, batch).cpu().bool()[columns][:, columns]
    skipped = [trace.block_names[b] for b in sorted(trace.patterns) if trace.block_kinds[b] != "self"]
    audit = AuditRecord.for_method(
        "pattern analysis",
        controls=[
            "text queries and text keys only; mass on sink / visual / delimiter / special keys reported per row",
            "padding excluded (checked)",
            "cross-attention blocks skipped (image keys only)" if skipped else "every kept block is self-attention",
        ],
        parameters={
            "positions": positions,
            "blocks": [trace.block_names[b] for b in blocks],
            "n_text_dropped": n_dropped,
        },
        notes=[
            "a text-text weight shows routing between question tokens only; what the value carries and "
            "whether the answer depends on it need source contributions or interventions"
        ],
    )
    return TextPatterns(
        positions,
        [str(token_strings[p]) for p in positions],
        int(trace.answer_positions[batch]),
        blocks,
        [trace.block_names[b] for b in blocks],
        skipped,
        patterns,
        other,
        allowed,
        n_dropped,
        audit,
    )


def tokens_of_ids(adapter, ids: list[int]) -> list[str]:
    """The tokenizer's token per id (as the analyze JSON's ``input.tokens``), else the decoded text."""
    convert = getattr(adapter.tokenizer, "convert_ids_to_tokens", None)
    if convert is not None:
        return [str(convert(i)) for i in ids]
    return [adapter.token_str(i) for i in ids]


@dataclass
class RelativePositionProfile:
    """``profile (heads, max_offset + 1)``: entry ``[h, d]`` is the mean of
    ``A[p, p - d]`` over the kept query positions ``p`` with ``p - d >= 0``
    (NaN where no query has that offset); ``counts[d]`` how many queries had it."""

    block: int
    profile: torch.Tensor
    counts: torch.Tensor
    audit: AuditRecord = field(repr=False, default=None)


def relative_position_profile(trace, block: int, max_offset: int = 64, batch: int = 0) -> RelativePositionProfile:
    """Mean weight by relative position (query minus key) in one
    self-attention block, over the kept query positions."""
    if trace.block_kinds[block] != "self":
        raise ValueError("relative position is defined for self-attention blocks")
    pat = trace.patterns[block][batch].float()  # (heads, n_query, keys)
    sums = torch.zeros(pat.shape[0], max_offset + 1)
    counts = torch.zeros(max_offset + 1)
    for qi, p in enumerate(trace.query_positions.tolist()):
        d = torch.arange(0, min(p, max_offset) + 1)
        sums[:, d] += pat[:, qi, p - d]
        counts[d] += 1
    profile = sums / counts.where(counts > 0, torch.tensor(float("nan")))
    audit = AuditRecord.for_method(
        "pattern analysis",
        controls=["conditioned on relative position", "every kept query row averaged"],
        parameters={"block": block, "max_offset": max_offset, "n_queries": len(trace.query_positions)},
        notes=["a strong offset profile is a position shortcut candidate; compare entity claims against it"],
    )
    return RelativePositionProfile(block, profile, counts, audit)


@dataclass
class PairedDifference:
    """``differences[block] (heads, keys)``: pattern of input b minus input a."""

    query_index: int
    differences: dict[int, torch.Tensor]
    audit: AuditRecord = field(repr=False, default=None)


def paired_difference(trace_a, trace_b, query_index: int = 0, batch: int = 0) -> PairedDifference:
    """The pattern of input b minus input a at the same query row. The runs
    must share their token layout (same length and visual positions), e.g. the
    same question on an edited image."""
    if trace_a.input_ids.shape != trace_b.input_ids.shape or not torch.equal(
        trace_a.visual_positions, trace_b.visual_positions
    ):
        raise ValueError("paired inputs must have the same token layout (length and visual positions)")
    diffs = {
        block: (trace_b.patterns[block][batch, :, query_index] - trace_a.patterns[block][batch, :, query_index]).float()
        for block in sorted(set(trace_a.patterns) & set(trace_b.patterns))
    }
    audit = AuditRecord.for_method(
        "pattern analysis",
        controls=["paired inputs with the same token layout", "same query row"],
        parameters={"query_index": query_index, "blocks": sorted(diffs)},
        notes=["a pattern change under an input edit is routing sensitivity, not the edit's effect on the answer"],
    )
    return PairedDifference(query_index, diffs, audit)


@dataclass
class Distribution:
    """A sample of values, summarised without hiding its spread.

    Attributes:
        quantiles: the value at each of 0.05, 0.25, 0.5, 0.75, 0.95.
        edges, counts: a histogram (``len(edges) == len(counts) + 1``).
    """

    n: int
    mean: float
    std: float
    quantiles: dict[str, float]
    edges: list[float]
    counts: list[int]

    @classmethod
    def of(cls, values, bins: int = 10, value_range: tuple[float, float] | None = None) -> Distribution:
        v = torch.as_tensor(values, dtype=torch.float64).flatten()
        if v.numel() == 0:
            raise ValueError("no values")
        qs = (0.05, 0.25, 0.5, 0.75, 0.95)
        qv = torch.quantile(v, torch.tensor(qs, dtype=torch.float64))
        lo, hi = value_range or (float(v.min()), float(v.max()))
        hi = hi if hi > lo else lo + 1e-12
        counts = torch.histc(v, bins=bins, min=lo, max=hi)
        return cls(
            int(v.numel()),
            float(v.mean()),
            float(v.std()) if v.numel() > 1 else 0.0,
            {str(q): float(x) for q, x in zip(qs, qv)},
            torch.linspace(lo, hi, bins + 1).tolist(),
            [int(c) for c in counts],
        )

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> Distribution:
        return from_dict_fields(cls, d)


@dataclass
class HeadStatistics:
    """One head's answer-row attention over many samples.

    Attributes:
        hit_rate: share of samples (with a target region) whose argmax over
            the patch tokens falls in the region; ``n_hit_samples`` counts them.
        chance_hit_rate: the mean share of patch tokens in the region, what a
            uniform head would score.
    """

    block: int
    head: int
    name: str
    visual_mass: Distribution
    sink_mass: Distribution
    region_mass: Distribution | None
    entropy: Distribution
    hit_rate: float | None
    n_hit_samples: int
    chance_hit_rate: float | None

    DISTRIBUTIONS: ClassVar[tuple[str, ...]] = ("visual_mass", "sink_mass", "region_mass", "entropy")

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        for k in self.DISTRIBUTIONS:
            d[k] = d[k].to_dict() if d[k] is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> HeadStatistics:
        given = {k: Distribution.from_dict(d[k]) if d[k] is not None else None for k in cls.DISTRIBUTIONS}
        return from_dict_fields(cls, {**d, **given})


@dataclass
class PatternStatistics:
    """The ``statistics`` run kind (a :class:`core.results.readout.Readout`): every head's answer-row
    attention over ``n_samples`` samples (:func:`pattern_statistics`). Its JSON is
    ``{"n_samples", "heads": [HeadStatistics.to_dict(), ...]}``; the audit row is recorded
    beside it, so a restored result has none."""

    n_samples: int
    heads: list[HeadStatistics]
    audit: AuditRecord = field(repr=False, default=None)
    kind: ClassVar[str] = "statistics"  # the session's run kind (core.results.readout.Readout)

    def to_dict(self) -> dict:
        return {"n_samples": self.n_samples, "heads": [h.to_dict() for h in self.heads]}

    @classmethod
    def from_dict(cls, d: dict) -> PatternStatistics:
        """The statistics a ``statistics`` JSON (:meth:`to_dict`, a stored run's) describes."""
        return cls(int(d["n_samples"]), [HeadStatistics.from_dict(h) for h in d["heads"]])

    def summary(self) -> str:
        return f"answer-row attention of {len(self.heads)} heads over {self.n_samples} samples"

    def parameters(self) -> dict:
        return {"n_samples": self.n_samples}

    def audit_records(self) -> list[AuditRecord]:
        return [self.audit] if self.audit is not None else []


def pattern_statistics(
    loaded, samples, *, region_min_cover: float = 0.25, progress=None, cancel=None
) -> PatternStatistics:
    """Answer-row attention of every head over many samples, as distributions.

    Args:
        samples: ``(image, question, region_mask)`` items; ``region_mask`` is
            ``(H, W)`` bool in original-image pixels (the target object) or None.
        progress: ``progress(done, total, message)``.
        cancel: returns True to stop early (what was done so far is kept).
    """

    adapter = loaded.adapter
    samples = list(samples)
    per: dict[tuple[int, int], dict[str, list]] = {}
    chance = []
    for n, (image, question, region) in enumerate(samples):
        if cancel is not None and cancel():
            break
        img = load_image(image)
        tr = capture(loaded, img, question)
        roles = role_mass(adapter, tr)
        tokens = adapter.visual_tokens(img.size, tr.visual_positions[0].tolist())
        patches = [i for i, t in enumerate(tokens) if t.col >= 0]  # argmax over patch tokens only
        in_region = set(region_tokens(tokens, region, region_min_cover)) if region is not None else None
        if in_region is not None and patches:
            chance.append(len(in_region) / len(patches))
        for block in sorted(tr.patterns):
            pat = tr.patterns[block][0, :, 0].float()  # (heads, keys)
            vis = pat if tr.block_kinds[block] == "cross" else pat[:, tr.visual_positions[0]]
            ent = entropy(pat)
            for h in range(pat.shape[0]):
                rec = per.setdefault((block, h), {"visual": [], "sink": [], "region": [], "entropy": [], "hit": []})
                rec["visual"].append(float(roles[block]["visual"][h]))
                rec["sink"].append(float(roles[block]["sink"][h]))
                rec["entropy"].append(float(ent[h]))
                if in_region is not None and patches and vis.shape[-1]:  # text-only blocks see no image
                    rec["region"].append(float(vis[h, sorted(in_region)].sum()) if in_region else 0.0)
                    best = patches[int(vis[h, patches].argmax())]
                    rec["hit"].append(int(best in in_region))
        if progress:
            progress(n + 1, len(samples), "attention statistics")
    heads = [
        HeadStatistics(
            block,
            h,
            f"{adapter.blocks[block][0]}.H{h}",
            Distribution.of(rec["visual"], value_range=(0.0, 1.0)),
            Distribution.of(rec["sink"], value_range=(0.0, 1.0)),
            Distribution.of(rec["region"], value_range=(0.0, 1.0)) if rec["region"] else None,
            Distribution.of(rec["entropy"]),
            sum(rec["hit"]) / len(rec["hit"]) if rec["hit"] else None,
            len(rec["hit"]),
            sum(chance) / len(chance) if chance else None,
        )
        for (block, h), rec in sorted(per.items())
    ]
    n_done = len(next(iter(per.values()))["visual"]) if per else 0
    audit = AuditRecord.for_method(
        "pattern analysis",
        controls=[
            "padding excluded",
            "sink / delimiter / special mass reported separately",
            "distributions over samples (quantiles, histogram)",
            "chance hit rate of a uniform head reported",
        ],
        parameters={"n_samples": n_done, "region_min_cover": region_min_cover, "query": "answer position"},
        notes=["a hit rate above chance is a routing regularity on this sample set, not evidence the head is used"],
    )
    return PatternStatistics(n_done, heads, audit)


def rollout(trace, alpha: float = 0.5, heads: str | int = "mean", batch: int = 0) -> torch.Tensor:
    """Attention rollout (docs/METHODS.md §4.6): ``R = prod_l (alpha A_l + (1 - alpha) I)``.

    Nodes are the sequence positions, followed (for cross-attention models)
    by the visual tokens, which only receive edges from cross-attention
    blocks and keep their identity row. Needs full patterns (capture with
    every query position kept). Returns ``(nodes, nodes)``; row ``p`` is the
    reachability of each node from position ``p``. Visual tokens of a
    self-attention model are sequence positions already.
    """
    n = trace.input_ids.shape[1]
    if trace.query_positions is None or len(trace.query_positions) != n:
        raise ValueError("rollout needs the full pattern: capture with query_positions=range(seq_len)")
    n_vis = next((trace.patterns[b].shape[-1] for b, k in enumerate(trace.block_kinds) if k == "cross"), 0)
    dev = next(iter(trace.patterns.values())).device
    eye = torch.eye(n + n_vis, device=dev)
    out = eye.clone()
    for block in sorted(trace.patterns):
        pat = trace.patterns[block][batch].float()  # (heads, pos, keys)
        a = pat.mean(0) if heads == "mean" else pat[int(heads)]
        step = eye.clone()
        if trace.block_kinds[block] == "cross":
            step[:n, :n] *= 1 - alpha
            step[:n, n:] = alpha * a
        else:
            step[:n, :n] = alpha * a + (1 - alpha) * torch.eye(n, device=dev)
        out = step @ out
    return out


class RolloutStream:
    """Attention rollout (docs/METHODS.md §4.6) accumulated block by block while
    a capture runs: a pattern stream (``core.forward.capture.capture(pattern_streams=...)``).

    Each block's head-mean pattern is read :data:`core.forward.attention_rows.ROW_CHUNK`
    rows at a time and folded into ``R <- (alpha A_l + (1 - alpha) I) R``, so no
    ``(heads, pos, pos)`` pattern is ever held and the only ``pos x pos``
    tensor is ``R`` itself (one, not per head or layer). Cost per block: one
    ``pos x pos x pos`` product (``FULL_PATTERN_LIMIT`` bounds it), besides
    recomputing the pattern on the sdpa path. The nodes are those of
    :func:`rollout`, which computes the same matrix from full patterns (the
    oracle in tests).

    Attributes:
        matrix: ``(batch, nodes, nodes)`` float32 after the capture (None before).
    """

    def __init__(self, alpha: float = 0.5, heads: str | int = "mean"):
        self.alpha, self.heads = alpha, heads
        self.matrix: torch.Tensor | None = None
        self.n_pos: int | None = None

    def _mixed(self, rows, chunk: torch.Tensor, n_keys: int) -> torch.Tensor:
        pat = rows.rows(chunk, n_keys).float()  # (batch, heads, n, keys)
        return pat.mean(1) if self.heads == "mean" else pat[:, int(self.heads)]

    def __call__(self, block: int, kind: str, rows) -> None:
        from core.forward.attention_rows import ROW_CHUNK

        n = rows.n_rows
        if self.matrix is None:
            self.n_pos = n
            self.matrix = torch.eye(n).expand(rows.batch, n, n).clone()
        out = self.matrix
        if kind == "cross":
            n_keys = rows.n_keys
            if out.shape[1] == n:  # the first cross block: the visual nodes join with identity rows
                grown = torch.eye(n + n_keys).expand(out.shape[0], n + n_keys, n + n_keys).clone()
                grown[:, :n, :n] = out
                out = grown
            source = out[:, n:]  # the visual nodes' rows
        else:
            source = out[:, :n]
        new = torch.empty_like(out[:, :n])
        for i in range(0, n, ROW_CHUNK):  # aligned chunks: each one product (core.forward.attention_rows)
            j = min(i + ROW_CHUNK, n)
            reads = rows.keys_read(j - 1)  # a causal pattern's chunk reads no later key
            a = self._mixed(rows, torch.arange(i, j), reads).to(out.device)  # (batch, chunk, keys read)
            # new rows = alpha A R + (1 - alpha) R, in one call
            torch.baddbmm(out[:, i:j], a, source[:, :reads], beta=1 - self.alpha, alpha=self.alpha, out=new[:, i:j])
        out[:, :n] = new
        self.matrix = out

    def answer_row(self, trace, batch: int = 0) -> torch.Tensor:
        """``(nodes,)``: the answer position's row of ``R``."""
        if self.matrix is None:
            raise ValueError("the rollout stream saw no pattern: pass it to capture(pattern_streams=...)")
        return self.matrix[batch, int(trace.answer_positions[batch])]


def rollout_visual_mass(
    trace, tokens, alpha: float = 0.5, batch: int = 0, stream=None
) -> list[tuple[int, torch.Tensor]]:
    """Rollout mass from the answer position onto the visual tokens, laid out
    per image as :func:`patch_grids` does: ``[(image, (rows, cols))]``; from
    ``stream`` (a :class:`RolloutStream` the capture ran) or else from the
    trace's full patterns (:func:`rollout`)."""
    if stream is not None:
        r = stream.answer_row(trace, batch)
    else:
        r = rollout(trace, alpha, batch=batch)[int(trace.answer_positions[batch])]
    n = trace.input_ids.shape[1]
    vis = trace.visual_positions[batch] if trace.visual_positions.shape[1] else torch.arange(n, r.shape[0])
    return patch_grids(r[vis], tokens)


def rollout_audit(alpha: float, heads) -> AuditRecord:
    return AuditRecord.for_method(
        "rollout / flow",
        controls=[f"residual weight 1 - alpha = {1 - alpha}"],
        parameters={"alpha": alpha, "heads": heads},
        notes=[
            "a structural-flow approximation: ignores value/output projections, head signs and directions, "
            "MLP paths, normalisation and gating; not a conserved decomposition of the output"
        ],
    )
