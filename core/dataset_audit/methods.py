"""The audit's ``--methods``: the dataset-scale read-outs of the registry
(:mod:`core.readouts`), chosen by name."""

from __future__ import annotations

from collections.abc import Sequence

from core.errors import ReadoutError
from core.readouts import DATASET_READOUTS, READOUTS, ReadoutMethod

DEFAULT_METHODS = ("answer", "lens", "attention", "dla", "rollout")
METHODS = DATASET_READOUTS  # name -> read-out, the registry's dataset-scale ones (a live view)


def parse_methods(spec: str | Sequence[str]) -> list[ReadoutMethod]:
    """``"answer,lens"`` -> the registered methods, in the given order; an
    unknown, analyze-only or unavailable name is a one-line :class:`ReadoutError`."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not names:
        raise ReadoutError(f"no methods given; available: {', '.join(METHODS)}")
    out = []
    for n in names:
        if n not in READOUTS:
            raise ReadoutError(f"unknown method {n!r}; available: {', '.join(METHODS)}")
        why = "analyze only, not a dataset read-out" if n not in METHODS else METHODS[n].available()
        if why:
            raise ReadoutError(f"method {n!r} is not available: {why}")
        if METHODS[n] not in out:
            out.append(METHODS[n])
    return out
