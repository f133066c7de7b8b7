"""The dtype a model runs in, the dtype its read-outs accumulate in, and where
its weights sit: one vocabulary for the command lines, the app, the loader,
the methods and the records (docs/METHODS.md, "Precision").

A model may run in bfloat16 or float16; every read-out that sums (softmax rows,
DLA over components and sources, lens logits and KL, norms, statistics,
effects) does so in :func:`accumulation_dtype`, float32 for half precision, so
that the read-out adds no rounding of its own beyond the model's."""

from __future__ import annotations

import torch

# What --dtype accepts (float64 is the tests' exactness dtype, open to the library, not offered).
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
HALF_DTYPES = (torch.bfloat16, torch.float16)


def dtype_of(value) -> torch.dtype:
    """A torch floating dtype from a name ("bfloat16", "torch.float16", "fp32" is refused)
    or a torch dtype; ValueError for anything else ("auto" is resolved by the loader,
    :func:`core.models.memory.resolve_dtype`)."""
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {value}; expected one of {', '.join(_DTYPES)}")
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; expected one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a read-out of a ``dtype`` model sums in: float64 for a float64
    model (the tests' exactness runs), float32 otherwise (half precision sums in
    float32, as the model's own kernels accumulate)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps / 2`` of ``dtype``: 2^-8 for bfloat16, 2^-11 for float16, 2^-24
    for float32, 2^-53 for float64."""
    return torch.finfo(dtype).eps / 2


def placement(model) -> str:
    """Where ``model``'s weights sit: one device ("cpu", "cuda:0") or, for a
    model spread by a device map, the devices joined by "+" in first-use order
    ("cuda:0+cuda:1+cpu")."""
    devices = dict.fromkeys(str(p.device) for p in model.parameters())
    return "+".join(devices) or "cpu"
