"""What every read-out of the registry shares: the per-sample context it reads,
the options a run gives it, the base class, and the small helpers the
dataset audit derives its flat numbers with.

A read-out is computed once per sample, from a :class:`SampleContext`
(the capture, the sample's row in its batch, the visual tokens, the target
answer and foil ids, the options), by ``run(context) -> (section,
audit_record)``. ``section`` is the read-out's piece of the analyze result, a
typed value whose ``to_dict()`` is that piece of the analyze JSON
(docs/ARCHITECTURE.md, "The analyze JSON"; a list of such values for the
per-layer and per-head read-outs); :func:`core.analyze.analyze` places it under
:attr:`ReadoutMethod.analyze_key` of the :class:`core.analyze.AnalyzeResult`. The dataset audit keeps
:meth:`ReadoutMethod.audit_section` of it per sample (a compact form: flat
numbers, region masses), from which its CSV columns, long tables and
summaries are derived, so that for one sample the audit's numbers are
analyze's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from core.results.audit import AuditRecord


# Text tokens in the text-text patterns (those nearest the answer): bounds the JSON,
# which holds blocks x heads x TEXT_PATTERN_LIMIT^2 weights at most.
TEXT_PATTERN_LIMIT = 48


def pattern_rows(adapter, inputs, n_answer_prefix: int = 0) -> list[int]:
    """The query rows the text-side read-outs read, for every row of the batch
    ``inputs``: the last :data:`TEXT_PATTERN_LIMIT` non-visual positions up to
    each answer position (the answer row among them; a superset of the text
    rows the text-text patterns keep, since token roles need a trace) and every
    answer row (the prompt's last token and the ``n_answer_prefix`` answer
    tokens after it: ``answer_patterns``). Never the visual rows: what the
    capture recomputes stays linear in the sequence length."""
    visual = adapter.visual_positions(inputs)
    rows: set[int] = set()
    for b, answer in enumerate(int(a) for a in inputs.answer_positions.tolist()):
        seen = set(visual[b].tolist())
        text = [p for p in range(answer + 1) if p not in seen]
        rows |= set(text[-TEXT_PATTERN_LIMIT:]) | set(range(answer - n_answer_prefix, answer + 1))
    return sorted(rows)


@dataclass
class ReadoutOptions:
    """What every read-out of one run is run with.

    ``answer_top_k``: alternatives in the answer section's ``top``;
    ``lens_top_k``: tokens per logit-lens row; ``tuned``: a
    :class:`core.methods.tuned_lens.TunedLens` of the model (analyze's
    ``tuned_lens`` read-out), or None.
    """

    rollout_alpha: float = 0.5
    region_min_cover: float = 0.25
    dla_top_k: int = 10
    lens_top_k: int = 1
    answer_top_k: int = 5
    counterfactual_fill: str = "mean"
    tuned: Any = None


@dataclass(kw_only=True)  # built by keyword (core.readouts.pipeline.CapturedBatch.context)
class SampleContext:
    """One sample (inside a batch), as the read-outs see it.

    Attributes:
        trace: the batch's :class:`core.forward.capture.Trace` (None when no read-out
            needs one); ``batch`` is this sample's row in it.
        position: the answer position (the row read out).
        query_index: where ``position`` sits in ``trace.query_positions``.
        rollout: the :class:`core.methods.patterns.RolloutStream` the capture
            fed (None: no rollout this run, a prompt over ``FULL_PATTERN_LIMIT`` tokens).
        logits: ``(vocab,)`` float32 logits at the answer position, on the CPU.
        tokens: the visual tokens (:class:`core.forward.geometry.VisualToken`).
        cover: ``(n_tokens,)`` share of each token's box inside the target
            mask (None without a mask); ``region``: the token indices
            :func:`core.forward.geometry.region_tokens` keeps.
        item: the dataset item (:class:`core.dataset_audit.DatasetItem`) in an
            audit, None in analyze.
        answer_prefix: the answer tokens the forward ran after the prompt
            (teacher forcing, :mod:`core.answer_text`); a read-out that runs
            forwards of its own appends them too.
    """

    loaded: Any
    image: Any
    trace: Any
    batch: int
    query_index: int | None
    rollout: Any
    logits: torch.Tensor
    answer_id: int
    predicted_id: int
    options: ReadoutOptions
    foil_id: int | None = None
    item: Any = None
    mask: np.ndarray | None = None
    tokens: list = field(default_factory=list)
    cover: np.ndarray | None = None
    region: list[int] | None = None
    position: int | None = None
    question: str | None = None
    answer_prefix: tuple[int, ...] = ()

    @property
    def adapter(self):
        return self.loaded.adapter

    @cached_property
    def token_strings(self) -> list[str]:
        """One string per sequence position of this sample (the analyze JSON's ``input.tokens``)."""
        # function-local: see core.readouts
        from core.methods.patterns import tokens_of_ids

        return tokens_of_ids(self.adapter, self.trace.input_ids[self.batch].tolist())


class ReadoutMethod:
    """One read-out of the registry (:mod:`core.readouts`). Subclass it and
    :func:`core.readouts.register_method` it to add a dataset-audit method.

    Attributes:
        name: the registry name (the audit's ``--methods`` name).
        audit_method: its row of :data:`core.results.audit.METHOD_TABLE`.
        analyze_key: the key of the analyze JSON its section fills (None: not
            part of analyze).
        dataset_scale: whether the audit may run it (False: analyze only).
        patterns: which attention rows the capture must keep: "none",
            "answer" (the answer position), "text" (:func:`pattern_rows`: the
            answer rows and the text rows nearest them) or "rollout" (no rows:
            a :class:`core.methods.patterns.RolloutStream` fed during the capture).
        needs_capture: whether it reads a Trace (else logits suffice).
        batched: True when :meth:`run_batch` handles a whole batch at once.
        long_table: ``(file name, columns)`` of the audit's long table, or None.
    """

    name = ""
    audit_method = ""
    analyze_key: str | None = None
    dataset_scale = True
    patterns = "none"
    needs_capture = True
    batched = False
    long_table: tuple[str, list[str]] | None = None

    def available(self) -> str | None:
        """None when usable, else why not (one line)."""
        return None

    def run(self, ctx: SampleContext) -> tuple[Any, AuditRecord | None]:
        """The sample's section (typed: see the module docstring) and the read-out's own audit row."""
        raise NotImplementedError

    def run_batch(self, contexts: list[SampleContext]) -> list[tuple[Any, AuditRecord | None]]:
        """Every sample of a batch at once (for read-outs that run forwards of
        their own); a :class:`core.errors.ReadoutError` here reruns the samples one by one."""
        return [self.run(c) for c in contexts]

    def audit_section(self, section, ctx: SampleContext) -> dict:
        """What the audit keeps of ``section`` for one sample (default: all of it)."""
        return section

    def csv_columns(self) -> list[str]:
        return []

    def csv_values(self, section: dict) -> dict:
        return {}

    def long_rows(self, index: int, section: dict) -> list[dict]:
        return []

    def summarize(self, sections: list[dict]) -> dict:
        return {}

    def controls(self) -> list[str]:
        return []

    def parameters(self, options: ReadoutOptions) -> dict:
        return {}

    def notes(self) -> list[str]:
        return []


def distribution(values, value_range=None) -> dict | None:
    """:class:`core.methods.patterns.Distribution` of the non-missing values, as a dict (None if none)."""
    # function-local: see core.readouts
    from core.methods.patterns import Distribution

    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    return Distribution.of(v, value_range=value_range).to_dict() if v else None


@dataclass
class PatchMass:
    """A section's patch grid(s) read back per patch token, in float64.

    ``total``: the values' sum; ``region``: weighted by each token's share
    inside the target mask (None without a mask); ``argmax``: the index of
    the token with the largest value (the first, in token order; None without
    patch tokens)."""

    total: float
    region: float | None
    argmax: int | None


def patch_mass(tokens, grid: list[list[float]], by_image: list[dict] | None, cover=None) -> PatchMass:
    """:class:`PatchMass` of a ``visual_patch_mass`` grid (the primary image's)
    and its ``visual_patch_mass_by_image`` list (present when the model sees
    several images; then it holds every image's grid). Tokens without a patch
    (``col < 0``: newline, CLS) have no cell and are left out."""
    # function-local: see core.readouts
    import torch

    from core.views import patch_values

    index = [i for i, t in enumerate(tokens) if t.col >= 0]
    v = torch.as_tensor(patch_values(tokens, grid, by_image)[index], dtype=torch.float64)
    region = None
    if cover is not None:
        region = float(v @ torch.as_tensor(cover[index], dtype=torch.float64)) if index else 0.0
    return PatchMass(float(v.sum()), region, index[int(v.argmax())] if index else None)
