"""Tuned lens (docs/METHODS.md §4.9): a learned translator per layer, read through
the FROZEN final norm and unembedding,

    z^{tuned}_l = W_U Norm_f(T_l(x_l)) + b_U,

trained to minimise KL(final || lens) on a corpus of image-question pairs,
and always reported beside three baselines evaluated on the same tokens.

Layers are the trace's blocks: row ``l`` reads ``trace.resid_pre[l]`` (the
residual entering block ``l``); one extra row ``l = n_blocks`` reads x_L, where
the trained reader is the identity (the final distribution itself, KL 0) and
no translator is trained.

The package, lowest first (each module imports only those above it):

* :mod:`.lens`: the translators (:class:`TunedLens`, its forms), :class:`LensConfig`, errors.
* :mod:`.data`: token positions, batches and the pairs corpus (the synthetic-scene
  corpus and the default held-out sets are in :mod:`core.zoo.lens_corpus`).
* :mod:`.training`: :func:`train_lens` (the tuned-lens recipe, checkpoints, resume).
* :mod:`.readers`: the trained reader and its baselines at a layer, the rows
  analyze and the app overlay, the audit row.
* :mod:`.evaluate`: :func:`evaluate_lens` and its :class:`LensEvaluation`.
* :mod:`.store`: :func:`save_lens`, :func:`load_lens` and the report.
* :mod:`.build`: :func:`build_lens`, the whole job.

This module re-exports the public names, so ``from core.methods.tuned_lens import X`` keeps working.
"""

from core.methods.tuned_lens.build import build_lens
from core.methods.tuned_lens.data import Batch, PairsCorpus, position_mask, read_pairs
from core.methods.tuned_lens.evaluate import LN2, LensEvaluation, ReaderMetrics, attach_evaluation, evaluate_lens
from core.methods.tuned_lens.lens import (
    FORMS,
    POSITION_SETS,
    SCHEMA_VERSION,
    Cancel,
    LensConfig,
    LensError,
    LensMismatchError,
    Progress,
    TunedLens,
)
from core.methods.tuned_lens.readers import lens_audit, tuned_lens_readers, tuned_lens_rows
from core.methods.tuned_lens.store import LENS_CONFIG, LENS_REPORT, LENS_TENSORS, load_lens, report_markdown, save_lens
from core.methods.tuned_lens.training import TrainResult, train_lens

__all__ = [
    "FORMS",
    "LENS_CONFIG",
    "LENS_REPORT",
    "LENS_TENSORS",
    "LN2",
    "POSITION_SETS",
    "SCHEMA_VERSION",
    "Batch",
    "Cancel",
    "LensConfig",
    "LensError",
    "LensEvaluation",
    "LensMismatchError",
    "PairsCorpus",
    "Progress",
    "ReaderMetrics",
    "TrainResult",
    "TunedLens",
    "attach_evaluation",
    "build_lens",
    "evaluate_lens",
    "lens_audit",
    "load_lens",
    "position_mask",
    "read_pairs",
    "report_markdown",
    "save_lens",
    "train_lens",
    "tuned_lens_readers",
    "tuned_lens_rows",
]
