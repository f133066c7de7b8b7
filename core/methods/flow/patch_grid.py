"""Activation-patching grids: one activation copied from a source run into the
clean run at each layer x position (or position group), everything downstream
recomputed, and the answer read with the normalised patching metric.

The source is the same question about another image of the same size (another
scene, the region-filled image, the object moved), so that both runs have the
same positions. The activation is the residual stream entering a block
(``resid``), the attention output (``attn``: every head's output before W_O, so
the block's attention write with its output bias kept), the MLP output
(``mlp``), or one head's output (``head``: ``z`` of head H). The metric is the
answer's logit difference (the clean run's answer against the foil, by default
the source run's answer), normalised so that 0 is the clean run and 1 the
source run::

    metric = (LD_patched - LD_clean) / (LD_source - LD_clean)

which is undefined when both runs have the same logit difference (refused).
The cells run as rows of batched forwards with nothing recorded
(:func:`core.forward.capture.edited_logits`, :attr:`Edit.rows`).

What it supports: the activation at these positions, with what follows it,
carries enough to move the answer from the clean to the source behaviour on
this pair (sufficiency; a total effect, direct plus indirect). What it cannot:
uniqueness of the route, or behaviour away from this pair.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from core.errors import InterventionError
from core.forward.capture import Trace, capture
from core.methods.flow.batches import edited_rows
from core.methods.flow.positions import PositionSet, position_sets
from core.methods.interventions import activation_patch, answer_values
from core.results.audit import AuditRecord
from core.results.readout import Target

SITES = ("resid", "attn", "mlp", "head")
GROUPS = ("image", "region", "question", "answer")  # the default columns: position groups
EACH = "each"  # columns: every position


@dataclass
class PatchGrid:
    """The normalised patching metric of every layer x column.

    Attributes:
        site: ``resid``, ``attn``, ``mlp`` or ``head``; ``head``: the head patched (``L1.H2``: its index).
        blocks: the rows (block names).
        columns: the columns: each a :class:`PositionSet` (a group, or one position named ``p<N>``).
        metric: ``[row][column]`` the normalised metric (None: the column has no position there).
        logit_diff: ``[row][column]`` the patched run's logit difference.
        clean, source: the two runs' numbers (answer and foil the same in both).
    """

    site: str
    head: int | None
    blocks: list[str]
    columns: list[PositionSet]
    metric: list[list[float | None]]
    logit_diff: list[list[float | None]]
    clean: Target
    source: Target
    audit: AuditRecord | None = field(default=None, repr=False)
    cancelled: bool = False

    kind = "patch-grid"  # the session's run kind (core.results.readout.Readout)

    def cell(self, block: str, column: str) -> float | None:
        return self.metric[self.blocks.index(block)][[c.name for c in self.columns].index(column)]

    def summary(self) -> str:
        """``patch grid (resid, 4 x 4): largest metric 0.93 at L1 x image; logit diff clean +2.1, source -1.3``."""
        cells = [
            (v, b, c.name)
            for b, row in zip(self.blocks, self.metric)
            for v, c in zip(row, self.columns)
            if v is not None
        ]
        what = self.site if self.head is None else f"{self.site} H{self.head}"
        best = max(cells, default=None, key=lambda x: x[0])
        said = f"largest metric {best[0]:.2f} at {best[1]} x {best[2]}" if best else "no cell ran"
        return (
            f"patch grid ({what}, {len(self.blocks)} x {len(self.columns)}): {said}; logit diff clean "
            f"{self.clean.logit_diff:+.3f}, source {self.source.logit_diff:+.3f}"
            + (" [cancelled]" if self.cancelled else "")
        )

    def parameters(self) -> dict:
        return {
            "method": "activation patching",
            "site": self.site,
            "head": self.head,
            "answer": self.clean.answer,
            "foil": self.clean.foil,
            "columns": [c.name for c in self.columns],
        }

    def audit_records(self) -> list[AuditRecord]:
        return [self.audit] if self.audit else []

    def to_dict(self) -> dict:
        return {
            "method": "activation patching",
            "metric_definition": "(LD_patched - LD_clean) / (LD_source - LD_clean); LD = logit(answer) - logit(foil)",
            "site": self.site,
            "head": self.head,
            "blocks": self.blocks,
            "columns": [c.to_dict() for c in self.columns],
            "metric": self.metric,
            "logit_diff": self.logit_diff,
            "clean": self.clean.to_dict(),
            "source": self.source.to_dict(),
            "audit": self.audit.to_dict() if self.audit else None,
            "cancelled": self.cancelled,
        }

    @classmethod
    def from_dict(cls, d: dict) -> PatchGrid:
        def grid(rows):
            return [[None if v is None else float(v) for v in row] for row in rows]

        return cls(
            str(d["site"]),
            None if d["head"] is None else int(d["head"]),
            [str(b) for b in d["blocks"]],
            [PositionSet.from_dict(c) for c in d["columns"]],
            grid(d["metric"]),
            grid(d["logit_diff"]),
            Target.from_dict(d["clean"]),
            Target.from_dict(d["source"]),
            AuditRecord.from_dict(d["audit"]) if d.get("audit") else None,
            bool(d.get("cancelled", False)),
        )


@dataclass
class PairedRuns:
    """The clean and the source run of one question, and the logit difference they are read by.

    Attributes:
        inputs: the clean run's prepared batch (one row).
        tokens: ``(answer id, foil id)``.
        clean, source: the two runs' numbers; ``span``: LD_source - LD_clean (not 0).
    """

    inputs: object
    clean_trace: Trace
    source_trace: Trace
    position: int
    tokens: tuple[int, int]
    clean: Target
    source: Target
    span: float


def paired_runs(loaded, image, source_image, question, answer_id=None, foil_id=None, answer_prefix=()) -> PairedRuns:
    """Capture ``image`` and ``source_image`` asked ``question``; the answer (default: the clean
    run's top token) and foil (default: the source run's). Refused in one line: runs of other
    positions, the same token twice, the same logit difference in both runs."""
    adapter = loaded.adapter
    inputs = adapter.prepare([image], [question], answer_prefix=list(answer_prefix))
    source_inputs = adapter.prepare([source_image], [question], answer_prefix=list(answer_prefix))
    if source_inputs.input_ids.shape != inputs.input_ids.shape or bool(
        (source_inputs.answer_positions != inputs.answer_positions).any()
    ):
        raise InterventionError(
            f"the source run has {source_inputs.input_ids.shape[1]} positions and the clean run "
            f"{inputs.input_ids.shape[1]}: patch between images the model reads with the same positions (same size)"
        )
    clean_trace = capture(loaded, None, "", pattern_layers=[], inputs=inputs)
    source_trace = capture(loaded, None, "", pattern_layers=[], inputs=source_inputs)
    pos = int(clean_trace.answer_positions[0])
    if answer_id is None:
        answer_id = int(clean_trace.logits[0, pos].argmax())
    if foil_id is None:
        foil_id = int(source_trace.logits[0, pos].argmax())
    if foil_id == answer_id:
        raise InterventionError(
            f"the clean and the source run both answer {adapter.token_str(answer_id)!r}: name a foil (--foil)"
        )
    clean = answer_values(adapter, clean_trace, answer_id, foil_id)
    source = answer_values(adapter, source_trace, answer_id, foil_id)
    span = source.logit_diff - clean.logit_diff
    if abs(span) < 1e-6 * max(1.0, abs(clean.logit_diff)):
        raise InterventionError("the clean and the source run have the same logit difference: the metric is undefined")
    return PairedRuns(inputs, clean_trace, source_trace, pos, (answer_id, foil_id), clean, source, span)


def cell_edits(source: Trace, site: str, block: int, head: int | None, positions: Sequence[int], n_heads: int):
    """The edits that copy ``site`` of ``block`` at ``positions`` from ``source``."""
    if site == "resid":
        return [activation_patch(source, "resid", block, None, positions)]
    if site == "mlp":
        return [activation_patch(source, "mlp", block, None, positions)]
    heads = range(n_heads) if site == "attn" else [head]
    return [activation_patch(source, "z", block, h, positions) for h in heads]


@torch.no_grad()
def patch_grid(
    loaded,
    image,
    source_image,
    question: str,
    *,
    site: str = "resid",
    head: int | None = None,
    columns: str | Sequence[str] = GROUPS,
    answer_id: int | None = None,
    foil_id: int | None = None,
    region: Sequence[int] = (),
    answer_prefix: Sequence[int] = (),
    batch_size: int = 8,
    progress: Callable[[int, int, str], None] | None = None,
    cancel: Callable[[], bool] | None = None,
) -> PatchGrid:
    """Patch ``site`` from the run of ``source_image`` into the run of ``image`` (the same
    ``question``) at every block x column.

    Args:
        site: ``resid``, ``attn``, ``mlp`` or ``head`` (with ``head``: its index).
        columns: position-group names (:mod:`core.methods.flow.positions`; ``region`` needs
            ``region``; the default groups leave it out without one), or ``"each"``: every
            position of the sequence.
        answer_id, foil_id: the tokens of the logit difference (default: the clean run's top
            token and the source run's; the same token twice is refused: name a foil).
        batch_size: patched copies per forward.
    """
    adapter = loaded.adapter
    if site not in SITES:
        raise InterventionError(f"patch site {site!r}: expected one of {', '.join(SITES)}")
    if (site == "head") != (head is not None):
        raise InterventionError("a head is patched with site 'head', and only that site takes one")
    if head is not None and not 0 <= head < adapter.n_heads:
        raise InterventionError(f"head {head}: the model has heads 0-{adapter.n_heads - 1}")
    pair = paired_runs(loaded, image, source_image, question, answer_id, foil_id, answer_prefix)
    inputs, clean_trace, source_trace = pair.inputs, pair.clean_trace, pair.source_trace
    pos, answer_id, foil_id, clean, source, span = pair.position, *pair.tokens, pair.clean, pair.source, pair.span

    if columns == EACH:
        cols = [PositionSet(f"p{p}", (p,)) for p in range(pos + 1)]
    else:
        names = [columns] if isinstance(columns, str) else list(columns)
        if tuple(names) == GROUPS and not region:  # the default groups: the region where one is painted
            names = [n for n in names if n != "region"]
        sets = position_sets(adapter, clean_trace, inputs, question, names, region=region, answer_prefix=answer_prefix)
        cols = [sets[n] for n in names]
    blocks = list(range(clean_trace.n_blocks))
    cells = [(b, c) for b in blocks for c, col in enumerate(cols) if col.positions]
    values: dict[tuple[int, int], float] = {}
    rows = edited_rows(
        loaded, inputs, cells, lambda key: cell_edits(source_trace, site, key[0], head, cols[key[1]].positions, adapter.n_heads),
        batch_size=batch_size, image=image, question=question, answer_prefix=answer_prefix, cancel=cancel,
    )  # fmt: skip
    for done, chunk, logits in rows:
        logits = logits[:, pos].double()
        for row, key in enumerate(chunk):
            values[key] = float(logits[row, answer_id] - logits[row, foil_id])
        if progress is not None:
            b, c = chunk[-1]
            progress(done, len(cells), f"{clean_trace.block_names[b]} x {cols[c].name}")
    cancelled = len(values) < len(cells)
    logit_diff = [[values.get((b, c)) for c in range(len(cols))] for b in blocks]
    metric = [[None if v is None else (v - clean.logit_diff) / span for v in row] for row in logit_diff]
    audit = AuditRecord.for_method(
        "activation patching",
        controls=["the clean and the source run (metric 0 and 1)", "every layer x column"],
        parameters={
            "position": pos,
            "answer_id": answer_id,
            "foil_id": foil_id,
            "site": site,
            "head": head,
            "columns": [c.name for c in cols],
        },
        notes=[
            "each cell copies one activation with everything downstream recomputed: a total effect (direct plus "
            "indirect), on this clean / source pair only",
            "metric = (LD_patched - LD_clean) / (LD_source - LD_clean): 0 is the clean run, 1 the source run; "
            "values outside [0, 1] overshoot",
            "no effect does not mean unused: another route can carry the same information",
        ],
    )
    return PatchGrid(
        site, head, list(clean_trace.block_names), cols, metric, logit_diff, clean, source, audit, cancelled
    )
