"""The read-out registry: one module per read-out, one registry that both
drivers use (docs/ARCHITECTURE.md, "Data flow").

* :func:`core.analyze.analyze` runs :data:`ANALYZE_READOUTS` on one sample
  and places each section under its ``analyze_key`` of the analyze JSON.
* The dataset audit (:mod:`core.dataset_audit`) runs the ``--methods`` it is
  given (the read-outs with ``dataset_scale``) on batches and keeps each
  sample's :meth:`~core.readouts.base.ReadoutMethod.audit_section`.

Every read-out is a :class:`~core.readouts.base.ReadoutMethod` with
``run(context) -> (section, audit_record)`` over a
:class:`~core.readouts.base.SampleContext`. Modules: ``answer`` (the
target), ``residual`` (decomposition / DLA), ``logit_lens``, ``tuned_lens``,
``attention`` (head patterns at the answer row), ``rollout``,
``text_patterns``, ``answer_patterns`` (each answer row's mass by key kind), ``counterfactual`` (a batch read-out, audit only). A new
dataset read-out: subclass ``ReadoutMethod`` (also importable as
``core.dataset_audit.AuditMethod``) and :func:`register_method` it.

Import-light on purpose: the read-out modules import torch and their
``core.methods`` functions inside ``run`` / ``audit_section`` ("function-local:
see core.readouts"), because the audit command's ``--methods`` help lists this
registry and building the command line must not import torch
(tests/core/test_trust_cli.py). import-linter counts those imports all the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from core.readouts.answer import AnswerReadout
from core.readouts.answer_patterns import AnswerPatternsReadout
from core.readouts.attention import AttentionReadout
from core.readouts.base import TEXT_PATTERN_LIMIT, ReadoutMethod, ReadoutOptions, SampleContext, pattern_rows
from core.readouts.counterfactual import CounterfactualReadout
from core.readouts.logit_lens import LensReadout
from core.readouts.residual import DlaReadout
from core.readouts.rollout import RolloutReadout
from core.readouts.text_patterns import TextPatternsReadout
from core.readouts.tuned_lens import TunedLensReadout

__all__ = [
    "ANALYZE_READOUTS",
    "DATASET_READOUTS",
    "READOUTS",
    "TEXT_PATTERN_LIMIT",
    "ReadoutMethod",
    "ReadoutOptions",
    "SampleContext",
    "dataset_names",
    "pattern_rows",
    "register_method",
]

READOUTS: dict[str, ReadoutMethod] = {}


def register_method(method: ReadoutMethod) -> None:
    """Make ``method`` available under ``method.name`` (to the audit's ``--methods``
    when it has ``dataset_scale``); a name registered again is replaced."""
    READOUTS[method.name] = method


for _m in (
    AnswerReadout(),
    LensReadout(),
    AttentionReadout(),
    DlaReadout(),
    RolloutReadout(),
    CounterfactualReadout(),
    TunedLensReadout(),
    TextPatternsReadout(),
    AnswerPatternsReadout(),
):
    register_method(_m)

# What analyze runs, in the order of its audit rows (the JSON's keys have their own order).
ANALYZE_READOUTS = ("answer", "dla", "lens", "attention", "tuned_lens", "rollout", "text_patterns", "answer_patterns")


def dataset_names() -> list[str]:
    """The registered read-outs the dataset audit can run, in registration order."""
    return [n for n, m in READOUTS.items() if m.dataset_scale]


class _DatasetReadouts(Mapping):
    """The live view of :data:`READOUTS` the dataset audit offers (``dataset_scale`` only)."""

    def __getitem__(self, name: str) -> ReadoutMethod:
        m = READOUTS[name]
        if not m.dataset_scale:
            raise KeyError(name)
        return m

    def __iter__(self) -> Iterator[str]:
        return iter(dataset_names())

    def __len__(self) -> int:
        return len(dataset_names())


DATASET_READOUTS: Mapping[str, ReadoutMethod] = _DatasetReadouts()
