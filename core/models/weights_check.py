"""Load-time checks of the weights: the safetensors headers, integer or
boolean tensors in floating-point slots, a config describing far more weights
than the files hold, missing / mis-shaped / unexpected tensors as the library
reports them, and non-finite values. Each refusal is one ModelLoadError line
naming the first few tensors."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from core.errors import ModelLoadError
from core.files.input_files import checked_path
from core.models.model_files import open_regular

_SHOWN = 4  # tensor names a message lists before "+N more"


_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a header


def _safetensors_header(f: Path) -> dict:
    """The header of a safetensors file, checked against the file's size: the
    tensors' data offsets must end exactly at the end of the file."""
    with open_regular(f) as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ModelLoadError(f"{f}: corrupt or truncated weights (no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(f.stat().st_size - 8, _MAX_HEADER_BYTES):
            raise ModelLoadError(f"{f}: corrupt or truncated weights (a header of {n:,} bytes)")
        header = json.loads(fh.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != f.stat().st_size:
        raise ModelLoadError(
            f"{f}: corrupt or truncated weights (header says {8 + n + end} bytes, file has {f.stat().st_size})"
        )
    return header


def check_safetensors(files: list[Path]) -> dict[str, tuple[str, list[int]]]:
    """Open every safetensors file and touch every tensor's extent, so a corrupt
    header or a truncated file fails here with a clear message.

    Returns:
        ``{tensor name: (safetensors dtype code, shape)}`` (codes "F32",
        "BF16", "I32", ...) over all the files, read from their headers.
    """
    from safetensors import safe_open

    stored: dict[str, tuple[str, list[int]]] = {}
    for f in files:
        try:
            with checked_path(f, ModelLoadError) as held, safe_open(held, framework="pt") as st:
                keys = list(st.keys())
                if not keys:
                    raise ModelLoadError(f"{f}: weights file holds no tensors")
                for k in keys:
                    st.get_slice(k)  # validates offsets against the header
            header = _safetensors_header(f)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise ModelLoadError(f"{f}: corrupt or truncated weights ({type(e).__name__}: {e})") from None
        stored.update(
            {k: (str(v.get("dtype")), list(v.get("shape", []))) for k, v in header.items() if k != "__metadata__"}
        )
    return stored


def _is_floating_code(code: str) -> bool:
    """Whether a safetensors dtype code (F16, BF16, F32, F8_E4M3, ...) is a floating-point type."""
    return code.startswith(("F", "BF"))


# safetensors' codes of the non-floating types, as torch names them
_TORCH_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "C64": "complex64",
}


def dtype_name(dtype) -> str:
    """A torch dtype or a safetensors dtype code as torch names it ("int32")."""
    code = str(dtype).removeprefix("torch.")
    return _TORCH_NAMES.get(code, code)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _listed(items: list[str], by_layer: bool = False) -> str:
    """The first few of ``items`` (naturally sorted: layers.2 before layers.10),
    then "+N more". ``by_layer``: names under one numbered module (a whole
    layer) are shown once, as ``model.layers.3.* (9 tensors)``."""

    def natural(s: str):
        return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]

    items = sorted(items, key=natural)
    if by_layer:
        groups: dict[str, list[str]] = {}
        for name in items:
            layer = re.match(r"(.*?\.\d+)\.", name)
            groups.setdefault(f"{layer.group(1)}.*" if layer else name, []).append(name)
        items = [f"{key} ({len(names)} tensors)" if len(names) > 1 else names[0] for key, names in groups.items()]
    shown = ", ".join(items[:_SHOWN])
    return shown + (f", +{len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def integer_tensors_in_floating_slots(model, stored: dict[str, tuple[str, list[int]]]) -> list[str]:
    """``"name: int32"`` for each tensor stored as integers or booleans that
    loads into a floating-point parameter or buffer of ``model`` (the library
    would cast it silently).

    A checkpoint's names may differ from the model's by a prefix (LLaVA's
    ``language_model.model.`` is ``model.language_model.``), so each such tensor
    is matched to the model entries sharing its longest dotted suffix of two
    parts or more; a tensor matching nothing is not used (and is reported as unexpected).
    """
    integer = {k: code for k, (code, _) in stored.items() if not _is_floating_code(code)}
    if not integer:
        return []
    floating_by_suffix: dict[str, set[bool]] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        parts = name.split(".")
        for n in range(2, len(parts) + 1):
            floating_by_suffix.setdefault(".".join(parts[-n:]), set()).add(t.is_floating_point())
    found = []
    for key, code in integer.items():
        parts = key.split(".")
        for n in range(len(parts), 1, -1):
            kinds = floating_by_suffix.get(".".join(parts[-n:]))
            if kinds is not None:
                if True in kinds:
                    found.append(f"{key}: {dtype_name(code)}")
                break
    return found


_UNBACKED_LIMIT = 1 << 30  # bytes of weights a config may describe beyond what the files hold


def check_size(config_file: Path, skeleton, stored: int, dtype) -> None:
    """Before the model is built for real: a config describing far more weights
    than the files hold (a default or edited config, the files of another model)
    would have the library allocate, and fill with random values, memory the
    weights never provide. Refused when that is over 1 GiB; smaller gaps are
    named tensor by tensor once the weights are loaded.

    Args:
        skeleton: the model built on the meta device (no memory).
        stored: how many values the weight files hold (an upper bound for a pickle: its size in bytes).
    """
    import torch

    unique = {id(t): t for t in skeleton.state_dict(keep_vars=True).values()}  # tied weights once
    expected = sum(t.numel() for t in unique.values())
    gap = (expected - stored) * torch.empty((), dtype=dtype).element_size()
    if gap > _UNBACKED_LIMIT:
        raise ModelLoadError(
            f"{config_file} describes a model of {expected:,} weights but the weight files hold {stored:,}: "
            f"{gap / 2**30:.1f} GiB would be random values (the config does not describe these weights)"
        )


def check_loaded_weights(
    where: Path,
    *,
    missing: list[str],
    unexpected: list[str],
    mismatched: list[tuple[str, Any, Any]],
    integer: list[str],
    expected: list[str] = (),
) -> str | None:
    """Refuse weights that would make the model compute something other than
    the checkpoint: tensors it needs that the files lack (the library fills them
    with random values), tensors of the wrong shape, integer or boolean tensors
    in floating-point slots. One line, naming the first few of each.

    Unexpected tensors that are further numbered copies of a tensor the model
    has (``layers.7.mlp.up_proj.weight`` where the model's layers stop at 5)
    are refused too: the config describes fewer layers than the checkpoint
    (``expected``: the model's own tensor names).

    Returns:
        the warning for tensors the model does not use (None if there are none).
    """
    problems = []
    beyond = numbered_beyond_the_model(unexpected, expected)
    if beyond:
        problems.append(
            f"the weights hold {_count(len(beyond), 'tensor')} of numbered modules the model built from the config "
            f"lacks ({_listed(beyond, by_layer=True)}): the config describes fewer layers (num_hidden_layers) "
            "than the checkpoint, so the model would run without them"
        )
        unexpected = [k for k in unexpected if k not in set(beyond)]
    if missing:
        problems.append(
            f"{_count(len(missing), 'tensor')} the model needs {'is' if len(missing) == 1 else 'are'} missing from "
            f"the weights ({_listed(missing, by_layer=True)}), "
            f"so {'it' if len(missing) == 1 else 'they'} would be random"
        )
    if mismatched:
        shapes = [f"{k} is {list(file)} in the file, the model expects {list(model)}" for k, file, model in mismatched]
        problems.append(f"{_count(len(mismatched), 'mis-shaped tensor')} ({_listed(shapes)})")
    if integer:
        problems.append(
            f"{_count(len(integer), 'tensor')} stored as a non-floating type (integers or booleans) where the model "
            f"has floating-point weights ({_listed(integer)})"
        )
    extra = f"{_count(len(unexpected), 'unexpected tensor')} that this model does not have ({_listed(unexpected)})"
    if problems:
        if unexpected:
            problems.append(extra)  # tells a file of another model apart from a damaged one
        raise ModelLoadError(f"{where}: " + "; ".join(problems))
    return f"{where}: {extra}, ignored" if unexpected else None


def _numbered_template(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".#", name)


def numbered_beyond_the_model(unexpected: list[str], expected: list[str]) -> list[str]:
    """The ``unexpected`` tensor names that are another index of a numbered
    module the model has (the same name with other numbers is in ``expected``)."""
    if not unexpected or not expected:
        return []
    templates = {_numbered_template(k) for k in expected}
    return [k for k in unexpected if _numbered_template(k) != k and _numbered_template(k) in templates]


def untied_weights_warning(config_field: str, where: Path, model) -> str | None:
    """A warning when the config asks to tie weights (``tie_word_embeddings``:
    the output layer is the input embedding) that the checkpoint holds as two
    different tensors: the library then keeps them apart, so the model computes
    with the checkpoint's own output layer, not what its config says."""
    try:
        wanted = model.get_expanded_tied_weights_keys(all_submodels=True)
    except Exception:  # a model without the library's tying (open_clip), or a mapping it cannot expand
        return None
    untied = []
    for target, source in sorted(wanted.items()):
        try:
            t, s = model.get_parameter(target), model.get_parameter(source)
        except AttributeError:
            continue
        if t is not s and "meta" not in (t.device.type, s.device.type):
            untied.append(f"{target} and {source}")
    if not untied:
        return None
    return (
        f"{config_field} {'are' if ' and ' in config_field else 'is'} true, but {where} holds {_listed(untied)} as different tensors, so they are not tied: "
        "the model computes with the checkpoint's own output layer (set tie_word_embeddings to false to say so)"
    )


def check_finite(where: Path, model) -> None:
    """Refuse NaN or Inf in any floating-point parameter or persistent buffer
    (what the weights provide; buffers the code computes, such as attention
    masks of -inf, are not in the state dict). One reduction per tensor and
    one device sync per device: a sum is finite unless an element is NaN / Inf
    or the sum overflows, which an exact ``isfinite`` then tells apart."""
    import torch

    sums: dict = {}  # device -> [(name, tensor, sum)]
    seen = set()
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if not t.is_floating_point() or t.device.type == "meta" or t.numel() == 0:
                continue
            key = (t.data_ptr(), t.dtype, tuple(t.shape))
            if key in seen:  # tied weights: one tensor under two names
                continue
            seen.add(key)
            try:
                total = t.sum(dtype=torch.float32)
            except RuntimeError:  # float8 types have no sum kernel on some devices
                total = t.float().sum()
            sums.setdefault(t.device, []).append((name, t, total))
        bad = []
        for entries in sums.values():
            finite = torch.isfinite(torch.stack([total for _, _, total in entries])).tolist()
            for (name, t, _), ok in zip(entries, finite):
                if not ok and not bool(torch.isfinite(t).all()):
                    bad.append(f"{name}: {'NaN' if bool(torch.isnan(t).any()) else 'Inf'}")
    if bad:
        half = any(t.dtype == torch.float16 for e in sums.values() for _, t, _ in e)
        hint = " (in float16, whose largest value is 65504: load in float32 to tell an overflow apart)" if half else ""
        raise ModelLoadError(
            f"{where}: {_count(len(bad), 'weight tensor')} hold{'s' if len(bad) == 1 else ''} non-finite values, "
            f"NaN or Inf ({_listed(bad)}){hint}; the read-outs would be NaN"
        )
