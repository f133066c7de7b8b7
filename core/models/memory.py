"""Whether a model and a read-out fit in memory, decided before anything is
allocated, and the dtype ``--dtype auto`` loads a model in.

The figures: the weights' bytes at the chosen dtype (counted from the
safetensors headers, no tensor read), plus the working set of a read-out at
the prompt's length (what the capture keeps per block, one chunk of
recomputed pattern rows, the logits, an estimate of the forward's own
activations), against the memory available: ``MemAvailable`` on the CPU, the
free memory of each CUDA device. ``VLM_READOUT_MEMORY_AVAILABLE`` (bytes, or
"21.7GB", "8GiB") replaces the reported figure, for tests and for a user who
wants to keep memory for something else.

A model that does not fit is refused in one line (:class:`ModelTooLargeError`)
naming both numbers and the dtype that would fit::

    models/llava-7b: needs ~28.1 GB in float32 and 21.7 GB is available; --dtype bfloat16 needs ~14.1 GB

(GB = 10^9 bytes; MB below 0.1 GB.) The figures are estimates (the ``~``): the working set is
modelled, not measured, and leaves out the vision tower's own activations.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from core.errors import ModelLoadError, ModelTooLargeError
from core.forward.attention_rows import ROW_CHUNK
from core.models.config_fields import config_value
from core.shell.precision import dtype_name, dtype_of, is_half, placement

MEMORY_ENV = "VLM_READOUT_MEMORY_AVAILABLE"
GB = 1e9  # the messages' unit (decimal, as disk and RAM sizes are sold)
# Over this many parameters a float32 checkpoint loads in bfloat16 on a GPU under "auto".
LARGE_MODEL_PARAMETERS = 1_000_000_000
# The load-time check's nominal prompt: one image's visual tokens plus this much text.
NOMINAL_TEXT_TOKENS = 64
# Visual tokens of one image when the config does not say (dynamic-resolution families).
DEFAULT_VISUAL_TOKENS = 1024
# What a read-out keeps: "forward" (answer, generate: the logits only) or "capture"
# (a Trace: per block resid_pre, z, mlp_out, the pattern rows, the logits).
READOUTS = ("forward", "capture")
# Activation-sized tensors a decoder layer holds at once during its forward (MLP
# gate, up and product, norm output, residual, attention output), each T x max(d_model, d_mlp).
_FORWARD_ACTIVATIONS = 6

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9})

# Bytes per element of each safetensors dtype code.
_CODE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
_CODE_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def parse_bytes(text: str) -> int:
    """``"21.7GB"``, ``"8 GiB"``, ``"1MB"``, ``"123456"`` -> bytes; ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if unit not in _UNITS:
        raise ValueError(f"{text!r}: expected a number of bytes, optionally with a unit (e.g. 21.7GB, 8GiB)")
    return int(float(match.group(1)) * _UNITS[unit])


def _override() -> int | None:
    """The :data:`MEMORY_ENV` figure, if set; a malformed one is a one-line error."""
    text = os.environ.get(MEMORY_ENV)
    if not text:
        return None
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise ModelTooLargeError(f"{MEMORY_ENV}: {e}") from None


def is_cuda(device) -> bool:
    """Whether ``device`` ("cpu", "cuda:1", "auto", None, a torch.device) puts the
    model on a GPU; "auto" does when one is present."""
    name = str(device) if device is not None else "cpu"
    if name == "auto":
        return torch.cuda.is_available()
    return name.startswith("cuda")


def _cpu_available() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # no /proc: free pages (an underestimate)


def _cuda_free(index: int) -> int:
    """Free memory of a CUDA device, counting what torch's allocator holds but does not use."""
    free, _ = torch.cuda.mem_get_info(index)
    return free + torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)


def available_bytes(device) -> int:
    """The memory a model on ``device`` may use now: the CPU's ``MemAvailable``;
    a CUDA device's free memory; for "auto" with GPUs, their free memory summed
    (the model is spread over them). :data:`MEMORY_ENV` replaces the figure."""
    override = _override()
    if override is not None:
        return override
    if not is_cuda(device):
        return _cpu_available()
    name = str(device)
    if name in ("auto", "cuda"):
        indices = range(torch.cuda.device_count()) if name == "auto" else [torch.cuda.current_device()]
        return sum(_cuda_free(i) for i in indices)
    return _cuda_free(torch.device(name).index or 0)


# ---------------------------------------------------------------- weights


def parameter_counts(stored: Mapping[str, tuple[str, list[int]]]) -> dict[str, int]:
    """``{safetensors dtype code: elements}`` of the tensors a header lists
    (:func:`core.models.weights_check.check_safetensors`'s result)."""
    counts: dict[str, int] = {}
    for code, shape in stored.values():
        n = 1
        for s in shape:
            n *= int(s)
        counts[code] = counts.get(code, 0) + n
    return counts


def module_parameter_counts(module) -> dict[torch.dtype, int]:
    """``{dtype: elements}`` of a module's state (tied tensors once); a meta-device skeleton costs nothing."""
    unique = {id(t): t for t in module.state_dict(keep_vars=True).values()}
    counts: dict[torch.dtype, int] = {}
    for t in unique.values():
        counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return counts


def _is_floating(kind) -> bool:
    return kind.is_floating_point if isinstance(kind, torch.dtype) else str(kind).startswith(("F", "BF"))


def _itemsize(kind) -> int:
    return kind.itemsize if isinstance(kind, torch.dtype) else _CODE_BYTES.get(str(kind), 4)


def floating_parameters(counts: Mapping) -> int:
    """How many floating-point values ``counts`` holds (what a dtype applies to)."""
    return sum(n for kind, n in counts.items() if _is_floating(kind))


def weights_bytes(counts: Mapping, dtype: torch.dtype) -> int:
    """Bytes of the weights loaded in ``dtype``: floating tensors take ``dtype``'s
    size, integer and boolean buffers keep theirs. ``counts``: elements by
    safetensors code or torch dtype (:func:`parameter_counts`, :func:`module_parameter_counts`)."""
    return sum(n * (dtype.itemsize if _is_floating(kind) else _itemsize(kind)) for kind, n in counts.items())


def checkpoint_dtype(config_dtype, counts: Mapping) -> torch.dtype | None:
    """The dtype a checkpoint was saved in: its config's (``dtype`` / ``torch_dtype``),
    else the floating dtype holding most of its values; None if neither says."""
    try:
        if config_dtype is not None:
            return dtype_of(config_dtype)
    except ValueError:
        pass  # "auto" or a dtype we do not run (float8): the files tell
    floating = {k: n for k, n in counts.items() if _is_floating(k)}
    if not floating:
        return None
    kind = max(floating, key=floating.get)
    return kind if isinstance(kind, torch.dtype) else _CODE_DTYPES.get(kind)


# ---------------------------------------------------------------- working set


@dataclass(frozen=True)
class ModelSizes:
    """The sizes the working set grows with: blocks the capture records, the
    residual width, heads, the MLP width, the vocabulary, and the visual tokens
    of one image (the load-time check's nominal prompt)."""

    n_blocks: int
    d_model: int
    n_heads: int
    d_mlp: int
    vocab: int
    n_visual: int = DEFAULT_VISUAL_TOKENS
    experts: bool = False  # mixture-of-experts MLPs: the capture also keeps each one's input

    @property
    def nominal_tokens(self) -> int:
        """One image and a short question: what the load-time check plans for."""
        return self.n_visual + NOMINAL_TEXT_TOKENS

    @classmethod
    def from_hf_config(cls, config) -> ModelSizes:
        """From a Hugging Face config (object or dict): the text model's sizes
        (``text_config`` where the model nests one) and the visual tokens the
        config names (``image_seq_length``, ``num_image_tokens``,
        ``mm_tokens_per_image``, else the vision tower's patch grid)."""
        text = config_value(config, "text_config") or config

        def size(*names, default=0):
            for name in names:
                value = config_value(text, name)
                if isinstance(value, list | tuple) and value:  # one per layer (Gemma 3n's MLP widths): the widest
                    value = max(value, key=lambda v: v if isinstance(v, int) else 0)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
            return default

        d_model = size("hidden_size", "d_model", "n_embd", default=4096)
        n_layers = size("num_hidden_layers", "num_layers", "n_layer", default=32)
        return cls(
            n_blocks=n_layers,
            d_model=d_model,
            n_heads=size("num_attention_heads", "n_head", default=max(1, d_model // 128)),
            d_mlp=size("intermediate_size", "ffn_dim", "n_inner", default=4 * d_model),
            vocab=size("vocab_size", default=32000),
            n_visual=_visual_tokens(config),
            experts=bool(size("num_experts", "num_local_experts", "n_routed_experts")),
        )

    @classmethod
    def from_open_clip(cls, model_cfg: dict) -> ModelSizes:
        """From an open_clip ``model_cfg``: the text tower, and CoCa's decoder
        (a self- and a cross-attention block per layer)."""
        text = model_cfg.get("text_cfg", {})
        decoder = model_cfg.get("multimodal_cfg", {})
        vision = model_cfg.get("vision_cfg", {})
        widest = decoder or text
        width = int(widest.get("width", 512))
        grid = int(vision.get("image_size", 224)) // max(1, int(vision.get("patch_size", 16)))
        return cls(
            n_blocks=int(text.get("layers", 12)) + 2 * int(decoder.get("layers", 0)),
            d_model=width,
            n_heads=int(widest.get("heads", 8)),
            d_mlp=int(width * float(widest.get("mlp_ratio", 4.0))),
            vocab=int(widest.get("vocab_size", 49408)),
            n_visual=grid * grid + 1,
        )

    @classmethod
    def of_adapter(cls, adapter) -> ModelSizes:
        """From a loaded model's adapter (blocks, widths, the unembedding's vocabulary)."""
        config = adapter.model_config
        hf = ModelSizes.from_hf_config(config) if config is not None and hasattr(config, "to_dict") else None
        try:
            vocab = int(adapter.W_U.shape[-1])
        except Exception:  # a family without an unembedding view: the config's figure
            vocab = hf.vocab if hf else 32000
        return cls(
            n_blocks=len(adapter.blocks),
            d_model=adapter.d_model,
            n_heads=adapter.n_heads,
            d_mlp=hf.d_mlp if hf else 4 * adapter.d_model,
            vocab=vocab,
            n_visual=hf.n_visual if hf else DEFAULT_VISUAL_TOKENS,
        )


def _visual_tokens(config) -> int:
    for path in ("image_seq_length", "text_config.num_image_tokens", "num_image_tokens", "mm_tokens_per_image"):
        value = config_value(config, path)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    image = config_value(config, "vision_config.image_size")
    patch = config_value(config, "vision_config.patch_size")
    if isinstance(image, int) and isinstance(patch, int) and patch > 0 and image >= patch:
        return (image // patch) ** 2
    return DEFAULT_VISUAL_TOKENS


def working_set_bytes(
    sizes: ModelSizes,
    n_tokens: int,
    dtype: torch.dtype,
    readout: str = "capture",
    *,
    batch: int = 1,
    eager: bool = False,
) -> int:
    """Bytes a read-out at ``n_tokens`` positions needs beside the weights.

    * the forward's own activations: a few ``T x max(d_model, d_mlp)`` of one
      layer at a time, the key / value cache (``2 x blocks x T x d_model``), and
      for eager attention one layer's ``heads x T x T`` weights (plus their
      float32 softmax); sdpa never materialises them;
    * the logits ``T x vocab`` in the model's dtype;
    * "capture" also: what the Trace keeps per block (resid_pre, z, mlp_out:
      ``3 x blocks x T x d_model`` in the model's dtype; a fourth, the MoE
      module's input, where the MLPs are mixtures of experts), one chunk of
      recomputed pattern rows (``heads x ROW_CHUNK x T`` float32) and a float32
      copy of the logits, which the lens read-outs upcast.
    """
    if readout not in READOUTS:
        raise ValueError(f"readout: {readout!r} is not one of {', '.join(READOUTS)}")
    s, T, size = sizes, int(n_tokens), dtype.itemsize
    total = _FORWARD_ACTIVATIONS * T * max(s.d_model, s.d_mlp) * size
    total += 2 * s.n_blocks * T * s.d_model * size
    if eager:
        total += s.n_heads * T * T * (size + 4)
    total += T * s.vocab * size
    if readout == "capture":
        total += (4 if s.experts else 3) * s.n_blocks * T * s.d_model * size
        total += s.n_heads * ROW_CHUNK * T * 4
        total += T * s.vocab * 4
    return batch * total


# ---------------------------------------------------------------- the plan


def _gb(n: float) -> str:
    """GB with one decimal; MB below 0.1 GB, where "0.0 GB" would say nothing."""
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"


@dataclass(frozen=True)
class MemoryPlan:
    """What a model (or a read-out of a loaded one) needs against what is available.

    Attributes:
        weights: bytes of the weights in ``dtype``.
        working_set: bytes of the read-out beside them (:func:`working_set_bytes`).
        available: bytes the model may use (:func:`available_bytes`; for a
            loaded model, plus what its own weights hold).
        dtype: the dtype planned for.
        smaller: the half-precision dtype to suggest and what it would need
            (None when ``dtype`` is already half precision).
        context: said after the dtype, e.g. "for 5,000 tokens" (empty at load).
        name: the model as the user named it (its folder, built-in name or spec).
    """

    weights: int
    working_set: int
    available: int
    dtype: torch.dtype
    smaller: tuple[torch.dtype, int] | None = None
    context: str = ""
    name: str = "the model"

    @property
    def need(self) -> int:
        return self.weights + self.working_set

    @property
    def fits(self) -> bool:
        return self.need <= self.available

    @property
    def fitting_dtype(self) -> torch.dtype | None:
        """The dtype that fits: the planned one, else the suggested one if it does, else None."""
        if self.fits:
            return self.dtype
        if self.smaller is not None and self.smaller[1] <= self.available:
            return self.smaller[0]
        return None

    def message(self) -> str:
        """``models/llava-7b: needs ~28.1 GB in float32 and 21.7 GB is available; --dtype bfloat16 needs ~14.1 GB``."""
        context = f" {self.context}" if self.context else ""
        name = dtype_name(self.dtype)
        head = f"{self.name}: needs ~{_gb(self.need)} in {name}{context} and {_gb(self.available)} is available"
        if self.smaller is None:
            return f"{head}; {name} is the smallest --dtype"
        smaller, need = self.smaller
        if need <= self.available:
            return f"{head}; --dtype {dtype_name(smaller)} needs ~{_gb(need)}"
        return f"{head}; even {dtype_name(smaller)} needs ~{_gb(need)}"

    def check(self) -> MemoryPlan:
        """Raise :class:`ModelTooLargeError` (one line) unless the plan fits; returns self."""
        if not self.fits:
            raise ModelTooLargeError(self.message())
        return self


def plan_memory(
    counts: Mapping,
    sizes: ModelSizes,
    n_tokens: int,
    dtype: torch.dtype,
    available: int,
    *,
    readout: str = "capture",
    batch: int = 1,
    eager: bool = False,
    context: str = "",
    name: str = "the model",
) -> MemoryPlan:
    """The plan of weights ``counts`` (elements by dtype, :func:`weights_bytes`)
    and a ``readout`` at ``n_tokens`` in ``dtype`` of model ``name``, with
    bfloat16 as the smaller alternative."""

    def need(dt):
        return weights_bytes(counts, dt), working_set_bytes(sizes, n_tokens, dt, readout, batch=batch, eager=eager)

    weights, working = need(dtype)
    smaller = None if is_half(dtype) else (torch.bfloat16, sum(need(torch.bfloat16)))
    return MemoryPlan(weights, working, available, dtype, smaller, context, name)


def resolve_dtype(
    requested,
    *,
    device,
    config_dtype=None,
    n_params: int = 0,
    need_bytes_by_dtype: Mapping[torch.dtype, int] | None = None,
    available: int | None = None,
) -> torch.dtype:
    """The dtype to load in. A name or torch dtype is taken as given (None is
    "auto"). "auto": on the CPU, float32 when the model fits in the memory
    available in float32 (``need_bytes_by_dtype[float32] <= available``), else
    bfloat16; on a GPU, the checkpoint's own dtype (``config_dtype``, see
    :func:`checkpoint_dtype`), but bfloat16 where a checkpoint of over
    :data:`LARGE_MODEL_PARAMETERS` parameters says float32 (or says nothing)."""
    if requested is not None and requested != "auto":
        try:
            return dtype_of(requested)
        except ValueError as e:
            raise ModelLoadError(f"dtype: {e}") from None
    if not is_cuda(device):
        need = (need_bytes_by_dtype or {}).get(torch.float32)
        fits = need is None or available is None or need <= available
        return torch.float32 if fits else torch.bfloat16
    own = dtype_of(config_dtype) if config_dtype is not None else torch.float32
    if own in (torch.float32, torch.float64) and n_params > LARGE_MODEL_PARAMETERS:
        return torch.bfloat16
    return own


def check_working_set(
    loaded, n_tokens: int, readout: str = "capture", *, batch: int = 1, eager: bool = False
) -> MemoryPlan:
    """Before a read-out of ``n_tokens`` positions: refuse, in one line, one that
    would not fit beside the loaded model (:class:`ModelTooLargeError`, in
    :meth:`MemoryPlan.message`'s form with "for N tokens"). The memory counted
    available is what is free plus what the model's own weights hold, so the
    suggested dtype is what a reload in it would need."""
    adapter = loaded.adapter
    model = adapter.model
    devices = placement(model).split("+")
    device = "auto" if len(devices) > 1 else devices[0]
    counts = module_parameter_counts(model)
    dtype = adapter.parameters_dtype
    return plan_memory(
        counts,
        ModelSizes.of_adapter(adapter),
        n_tokens,
        dtype,
        available_bytes(device) + weights_bytes(counts, dtype),
        readout=readout,
        batch=batch,
        eager=eager,
        context=f"for {n_tokens:,} tokens",
        name=loaded.spec,
    ).check()
