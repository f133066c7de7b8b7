"""The whole tuned-lens job: train, evaluate on the default (or given)
held-out sets (:func:`core.zoo.lens_corpus.default_eval_sets` for the
default models), record the report and save (:func:`build_lens`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from core.methods.tuned_lens.evaluate import LensEvaluation, attach_evaluation, evaluate_lens
from core.methods.tuned_lens.lens import Cancel, LensConfig, Progress, TunedLens
from core.methods.tuned_lens.readers import lens_audit
from core.methods.tuned_lens.store import save_lens
from core.methods.tuned_lens.training import TrainResult, train_lens


def build_lens(
    loaded,
    corpus,
    config: LensConfig | None = None,
    *,
    out: Path | str | None = None,
    eval_sets: dict[str, tuple[Any, int | None]] | None = None,
    checkpoint: Path | str | None = None,
    resume: bool = False,
    batch_size: int = 32,
    progress: Progress = None,
    cancel: Cancel = None,
) -> tuple[TunedLens, dict[str, LensEvaluation], TrainResult]:
    """Train a lens, evaluate it with its baselines on every set of
    ``eval_sets`` (``{name: (corpus, n)}``), store the KL tables and the
    capacity report in the lens, and save it to ``out`` (when given).

    The report keeps each evaluation set's per-layer KL of the identity, mean,
    random and trained readers (and the orthogonal one) by token group
    (:func:`attach_evaluation`).
    """
    result = train_lens(loaded, corpus, config, checkpoint=checkpoint, resume=resume, progress=progress, cancel=cancel)
    lens = result.lens
    evaluations: dict[str, LensEvaluation] = {}
    if not result.cancelled:
        for name, (ev_corpus, n) in (eval_sets or {}).items():
            t0 = time.perf_counter()
            ev = evaluate_lens(loaded, lens, ev_corpus, n, batch_size=batch_size, progress=progress, cancel=cancel)
            ev.data["seconds"] = round(time.perf_counter() - t0, 2)
            evaluations[name] = ev
            attach_evaluation(lens, name, ev)
    lens.report["audit"] = lens_audit(lens).to_dict()
    if out is not None:
        save_lens(lens, out)
    return lens, evaluations, result
