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

import re
import warnings
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


# What --device and the loader take: "cpu", "cuda", "cuda:N", "mps" (each at most one index:
# a CPU or an Apple GPU is one device) or "auto" (spread over the GPUs by a device map).
DEVICE_FORMS = "cpu, cuda, cuda:N, mps or auto"
_DEVICE_NAME = re.compile(r"(cpu|cuda|mps)(?::([0-9]{1,9}))?")
_SHOWN_CHARACTERS = 40  # a device name longer than this is no device: the message shows its start


def shown_device(device) -> str:
    """``device`` quoted for a message, cut to its start when it is too long to be a device name."""
    text = str(device)
    return repr(text if len(text) <= _SHOWN_CHARACTERS else text[:_SHOWN_CHARACTERS] + "...")


def available_devices() -> list[str]:
    """The devices this machine has, as a message lists them: "cpu", each CUDA
    device with its name ("cuda:0 (NVIDIA H100 80GB HBM3)"), "mps" where the
    Apple GPU is usable."""
    import torch

    devices = ["cpu"]
    with warnings.catch_warnings():  # a broken driver warns on every query: the list says enough
        warnings.simplefilter("ignore")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for i in range(count):
            try:
                devices.append(f"cuda:{i} ({torch.cuda.get_device_name(i)})")
            except Exception:  # a device that cannot say its name is still there
                devices.append(f"cuda:{i}")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            devices.append("mps")
    return devices


def _torch_device_kind(kind: str) -> bool:
    """Whether torch knows ``kind`` as a device type ("meta", "xpu"): one the
    read-outs do not support, rather than a misspelling."""
    import torch

    try:
        torch.device(kind)
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


def device_problem(device) -> str | None:
    """Why ``device`` names no device of this machine (one phrase ending with the
    devices available), or None when it does. Torch is imported only for a GPU
    name: "cpu" and "auto" are answered without it (the command lines check
    --device when they parse it)."""
    if not isinstance(device, str):
        if type(device).__module__ != "torch" or type(device).__name__ != "device":
            return f"not a device name (got {type(device).__name__}; expected {DEVICE_FORMS})"
        device = str(device)
    if device in ("auto", "cpu"):
        return None
    match = _DEVICE_NAME.fullmatch(device)
    if match is None:
        kind = device.split(":", 1)[0][:_SHOWN_CHARACTERS]
        problem = "not supported" if kind not in ("cpu", "cuda", "mps") and _torch_device_kind(kind) else "not a device"
        return f"{problem} (expected {DEVICE_FORMS}); available: {', '.join(available_devices())}"
    kind, index = match.group(1), match.group(2)
    index = None if index is None else int(index)
    available = available_devices()
    here = f"available: {', '.join(available)}"
    if kind == "cpu" or kind == "mps":
        if kind == "mps" and "mps" not in available:
            return f"MPS is not available on this machine; {here}"
        return None if index in (None, 0) else f"no such device (the {kind.upper()} is one device, {kind}); {here}"
    count = sum(d.startswith("cuda:") for d in available)
    if count == 0:
        return f"CUDA is not available on this machine; {here}"
    if index is not None and index >= count:
        return f"no such device (this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}); {here}"
    return None


def check_device(device) -> str | None:
    """``device`` ("cpu", "cuda", "cuda:N", "mps", "auto", None or a torch.device)
    as the loader takes it, after checking it names a device this machine has;
    :class:`core.errors.ModelLoadError` (one line naming the devices available)
    for a misspelled one or a GPU that is not there, before anything is read or
    allocated."""
    from core.errors import ModelLoadError

    if device is None:
        return None
    problem = device_problem(device)
    if problem is not None:
        raise ModelLoadError(f"device {shown_device(device)}: {problem}")
    return str(device)
