"""The audit request: the registry's read-outs over every image-question pair of a
pairs file, and the one summary run the session records (``vlm-readout audit``;
:mod:`core.dataset_audit`).

:meth:`AuditRequest.run` computes the audit in this process. The command runs the
same pieces (:meth:`~AuditRequest.read_items`, :meth:`~AuditRequest.run_shard`,
:meth:`~AuditRequest.summary_run`) around what stays its own: the launcher's shards
and their gather, the output folder's files, Ctrl-C.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from core.requests.base import Cancel, Progress, Request, register_request

if TYPE_CHECKING:
    from core.dataset_audit import AuditOptions, ShardResult
    from core.dataset_audit.summaries import AuditSummary
    from core.files.pairs import Pair
    from core.readouts import ReadoutMethod

# what the run's numbers are read at, as its parameters state it
TARGET_RULE = (
    "the dataset's answer minus its foil where given; else the answer text's token where given; "
    "else the model's top token"
)
QUERY_RULE = "answer position (after the answer text's tokens before the one read, where an answer text is given)"


def with_answer_text(items: list[Pair], text: str | None, index: int | None) -> list[Pair]:
    """The items read out at token ``index`` (None: 0) of answer ``text``, over every
    item's own ``answer_text`` / ``answer_token_index``; as they are without a text."""
    if text is None:
        return items
    return [dataclasses.replace(i, answer_text=text, answer_token_index=index or 0) for i in items]


@register_request
@dataclass(frozen=True, kw_only=True, eq=False)
class AuditRequest(Request):
    """Audit the pairs of ``dataset`` (a JSONL, or a folder holding ``dataset.jsonl`` or one
    ``*.jsonl``: :func:`core.files.pairs.pairs_file`).

    Attributes:
        methods: the read-outs, comma-separated or a sequence of names (None: the default ones,
            :data:`core.dataset_audit.DEFAULT_METHODS`).
        limit: only the first N pairs.
        batch_size: pairs per forward.
        rollout_alpha, region_min_cover, dla_top_k, fill: the read-outs' options
            (:class:`core.dataset_audit.AuditOptions`; ``fill``: the counterfactual's).
        answer_text, answer_token_index: read every pair out at token ``answer_token_index``
            (None: 0) of this answer text instead of each pair's own.
    """

    name: ClassVar[str] = "audit"

    dataset: str
    methods: str | tuple[str, ...] | None = None
    limit: int | None = None
    batch_size: int = 8
    rollout_alpha: float = 0.5
    region_min_cover: float = 0.25
    dla_top_k: int = 10
    fill: str = "mean"
    answer_text: str | None = None
    answer_token_index: int | None = None

    def readouts(self) -> list[ReadoutMethod]:
        """The read-outs asked (:func:`core.dataset_audit.parse_methods`: an unknown or
        unavailable one is one line)."""
        from core.dataset_audit import DEFAULT_METHODS, parse_methods

        return parse_methods(self.methods if self.methods is not None else DEFAULT_METHODS)

    def options(self) -> AuditOptions:
        from core.dataset_audit import AuditOptions

        return AuditOptions(
            rollout_alpha=self.rollout_alpha,
            region_min_cover=self.region_min_cover,
            dla_top_k=self.dla_top_k,
            counterfactual_fill=self.fill,
        )

    def pairs_file(self) -> Path:
        from core.files.pairs import pairs_file

        return pairs_file(self.dataset, "dataset file")

    def read_items(self, progress: Progress = None) -> list[Pair]:
        """The pairs (every problem one line naming the file and line), with the asked answer text."""
        from core.files.pairs import read_pairs

        items = read_pairs(self.pairs_file(), limit=self.limit, what="dataset file", progress=progress)
        return with_answer_text(items, self.answer_text, self.answer_token_index)

    def run_shard(
        self,
        loaded,
        items: list[Pair],
        *,
        rank: int = 0,
        world: int = 1,
        progress: Progress = None,
        cancel: Cancel = None,
    ) -> ShardResult:
        """Process ``rank`` of ``world``'s share of ``items`` (:func:`core.dataset_audit.run_shard`)."""
        from core.dataset_audit import run_shard

        return run_shard(
            loaded,
            items,
            self.readouts(),
            self.options(),
            batch_size=self.batch_size,
            rank=rank,
            world=world,
            progress=progress,
            cancel=cancel,
        )

    def run_parameters(self, loaded, n_items: int) -> dict[str, Any]:
        """What the run's files, its audit rows and its session run state it was run with."""
        return {
            "model": loaded.spec,
            "fingerprint": getattr(loaded, "fingerprint", ""),
            "family": loaded.adapter.family,
            **loaded.adapter.dtype_and_device(),
            "dataset": str(self.pairs_file()),
            "n_samples": n_items,
            "limit": self.limit,
            "batch_size": self.batch_size,
            "methods": [m.name for m in self.readouts()],
            "target": TARGET_RULE,
            "query": QUERY_RULE,
            "answer_text": self.answer_text,
            "answer_token_index": self.answer_token_index,
        }

    def summary_run(self, loaded, merged: ShardResult, n_items: int, out: str | None = None) -> AuditSummary:
        """The one session run of the audit (kind ``audit``): the summary (counts and
        distributions; the per-sample numbers stay in the output folder ``out``, None: none)
        and one audit row per read-out."""
        from core.dataset_audit import SCHEMA_VERSION, audit_table, summarize
        from core.dataset_audit.summaries import AuditSummary
        from core.results.readout import jsonable

        methods, run_params = self.readouts(), self.run_parameters(loaded, n_items)
        counts = jsonable(summarize(merged.records, methods, n_items, merged.cancelled))
        audits = audit_table(methods, merged.first_audits, run_params, self.options())
        return AuditSummary(SCHEMA_VERSION, jsonable(run_params), **counts, out=out, audits=audits)

    def parameters(self) -> dict[str, Any]:
        """What was asked, by the names the run's parameters use (the dataset as the pairs file
        read, the read-outs by name) and the read-outs' options."""
        return {
            "dataset": str(self.pairs_file()),
            "methods": [m.name for m in self.readouts()],
            "limit": self.limit,
            "batch_size": self.batch_size,
            "rollout_alpha": self.rollout_alpha,
            "region_min_cover": self.region_min_cover,
            "dla_top_k": self.dla_top_k,
            "fill": self.fill,
            "answer_text": self.answer_text,
            "answer_token_index": self.answer_token_index,
        }

    def run(self, loaded, progress: Progress = None, cancel: Cancel = None) -> AuditSummary:
        """The whole audit in this process, cancellable between batches (a cancelled run's
        summary says so): the pairs read, every batch run, the summary run."""
        from core.dataset_audit import merge_shards

        items = self.read_items(progress)
        shard = self.run_shard(loaded, items, progress=progress, cancel=cancel)
        return self.summary_run(loaded, merge_shards([shard]), len(items))
