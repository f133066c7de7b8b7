"""The dtype a model runs in, the dtype its read-outs accumulate in, and where
its weights sit: one vocabulary for the command lines, the app, the loader,
the methods and the records (docs/METHODS.md, "Precision").

A model may run in bfloat16 or float16; every read-out that sums (softmax rows,
DLA over components and sources, lens logits and KL, norms, statistics,
effects) does so in :func:`accumulation_dtype`, float32 for half precision, so
that the read-out adds no rounding of its own beyond the model's.

torch is imported inside the functions that need it: the command lines'
parsers and the app's picker read :data:`DTYPE_CHOICES` before any model code loads."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# What --dtype and the app's picker accept ("auto": the loader chooses; float64, the tests'
# exactness dtype, is open to the library but not offered).
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# What "auto" means (core.models.memory.resolve_dtype), said once for the command lines' help and the app's tooltip.
AUTO_DTYPE_MEANING = (
    "auto: float32 on the CPU when it fits in memory, else bfloat16; on CUDA the checkpoint's own dtype "
    "(bfloat16 for a float32 checkpoint of over 1B parameters)"
)
FLOAT_NAMES = ("float64", "float32", "bfloat16", "float16")
HALF_NAMES = ("bfloat16", "float16")


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def is_half(dtype) -> bool:
    """bfloat16 or float16."""
    return dtype_name(dtype) in HALF_NAMES


def dtype_of(value) -> torch.dtype:
    """A torch floating dtype from a name ("bfloat16", "torch.float16") or a torch
    dtype; ValueError for anything else ("auto" is resolved by the loader,
    :func:`core.models.memory.resolve_dtype`)."""
    import torch

    name = dtype_name(value)
    if name not in FLOAT_NAMES or not isinstance(value, (str, torch.dtype)):
        raise ValueError(f"unsupported dtype {value!r}; expected one of {', '.join(FLOAT_NAMES)}")
    return getattr(torch, name)


def accumulation_dtype(dtype) -> torch.dtype:
    """The dtype a read-out of a ``dtype`` model sums in: float64 for a float64
    model (the tests' exactness runs), float32 otherwise (half precision sums in
    float32, as the model's own kernels accumulate)."""
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def accumulating(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in :func:`accumulation_dtype` of its own dtype: a half-precision
    tensor upcast to float32 (exactly: every half value is a float32 value), a
    float32 or float64 one returned as it is (no copy, the same numbers)."""
    return tensor.to(accumulation_dtype(tensor.dtype))


def unit_roundoff(dtype) -> float:
    """``u = eps / 2`` of ``dtype``: 2^-8 for bfloat16, 2^-11 for float16, 2^-24
    for float32, 2^-53 for float64."""
    import torch

    return torch.finfo(dtype).eps / 2


def placement(model) -> str:
    """Where ``model``'s weights sit: one device ("cpu", "cuda:0") or, for a
    model spread by a device map, the devices joined by "+" in first-use order
    ("cuda:0+cuda:1+cpu")."""
    devices = dict.fromkeys(str(p.device) for p in model.parameters())
    return "+".join(devices) or "cpu"


def check_device(device) -> str | None:
    """``device`` ("cpu", "cuda", "cuda:N", "mps", "auto", None or a torch.device)
    as the loader takes it, after checking it names a device this machine has;
    :class:`core.errors.ModelLoadError` (one line) for a misspelled one or a GPU
    that is not there, before anything is read or allocated."""
    import torch

    from core.errors import ModelLoadError

    if device is None or device == "auto":
        return device
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ModelLoadError(
            f"device {str(device)!r}: not a device (expected cpu, cuda, cuda:N, mps or auto)"
        ) from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ModelLoadError(f"device {str(device)!r}: CUDA is not available on this machine (use cpu)")
        if dev.index is not None and dev.index >= count:
            raise ModelLoadError(
                f"device {str(device)!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ModelLoadError(f"device {str(device)!r}: MPS is not available on this machine (use cpu)")
    elif dev.type != "cpu":
        raise ModelLoadError(f"device {str(device)!r}: not supported (expected cpu, cuda, cuda:N, mps or auto)")
    return str(device)
