"""``load_model(spec)``: built-in names, local folders, cached repo ids and
open_clip ``name:checkpoint`` specs, loaded offline and safely.

Safety rules: weights are read with safetensors; a pickle checkpoint is
refused unless ``allow_pickle=True`` (unpickling runs code); a model whose
config asks for remote code is refused unless ``trust_remote_code=True``;
nothing is downloaded unless ``allow_download=True``. Every failure is a
:class:`core.errors.ModelLoadError` with a one-line message.

Trust rules (a wrong model must not answer as if it were right):

* weights: a tensor the model needs that the files lack (the library would
  fill it with random values), a tensor of the wrong shape, a tensor stored
  as integers or booleans where the model has floating-point weights, and
  NaN or Inf in any loaded weight are refused, naming the first few tensors;
  tensors the model does not use are a :class:`ModelLoadWarning`. Tied
  weights and buffers the library recomputes are not "missing".
* a config describing far more weights than the files hold (over 1 GiB of
  them) is refused before the model is built: the library would allocate
  and randomly fill memory the weights never provide.
* a model that would not fit in the memory available (its weights at the
  chosen dtype, from the safetensors headers, plus a read-out of one image
  and a short question) is refused before anything is allocated, naming the
  dtype that would fit (core/models/memory.py).
* tokenizer: its files must agree with each other (added and post-processor
  token ids, a BPE / Unigram vocabulary's training order) and with the
  model's config (the special tokens' ids, the vocabulary size against the
  embedding rows), so a shuffled or foreign ``tokenizer.json`` is refused.
* configs and processors (core/models/config_check.py): every number of
  config.json / open_clip_config.json / the processor that would crash the
  forward or make it NaN, and a processor that disagrees with the model (the
  image tokens it writes against the features the tower gives), are refused
  naming the file and field; an empty chat template is refused.
* a model folder holding anything but regular files and folders (a FIFO, a
  socket, a broken link) is refused before anything opens a file of it.
* a folder holding ``MANIFEST.sha256`` (the built-in models ship one) is
  refused if any file the load reads differs from it, is missing or is not in it.
* the fingerprint covers every file the load reads (config, weights,
  tokenizer, processor, chat template, generation config), so a lens or a
  session made with one tokenizer is not applied with another.
* the libraries' progress bars and load reports never reach the terminal.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import stat
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import ModelLoadError, ReadoutError, UnsafeCheckpointError, UnsupportedArchitectureError
from core.models import registry
from core.models.adapter import Adapter
from core.models.config_check import (
    check_chat_templates,
    check_config_consistency,
    check_config_json,
    check_open_clip_config,
    check_processor,
    probe_image_processor,
)
from core.models.memory import (
    ModelSizes,
    available_bytes,
    checkpoint_dtype,
    floating_parameters,
    module_parameter_counts,
    parameter_counts,
    plan_memory,
    resolve_dtype,
)
from core.models.model_files import (
    MANIFEST,
    PICKLE_SUFFIXES,
    check_folder_entries,
    fingerprint,
    model_files,
    open_clip_checkpoint,
    open_clip_model_cfg,
    open_clip_tokenizer_dir,
    read_json,
    verify_manifest,
    weight_files,
    write_manifest,
)
from core.models.tokenizer_check import check_tokenizer, check_tokenizer_json, check_vocabulary_fits, token_id_fields
from core.models.weights_check import (
    check_finite,
    check_loaded_weights,
    check_safetensors,
    check_size,
    dtype_name,
    integer_tensors_in_floating_slots,
    untied_weights_warning,
)
from core.shell import offline
from core.shell.precision import check_device, placement
from core.shell.precision import dtype_name as precision_dtype_name

# Importable from here as before the split (the CLI, the zoo's build and the tests use them).
_check_tokenizer_json = check_tokenizer_json
__all__ = [
    "BUILTIN",
    "MANIFEST",
    "PICKLE_SUFFIXES",
    "LoadedModel",
    "ModelLoadWarning",
    "load_model",
    "model_files",
    "resources_dir",
    "write_manifest",
]

BUILTIN = ("shapes-llava", "shapes-coca")


class ModelLoadWarning(UserWarning):
    """The model loaded, but its files hold something worth a look (one line),
    e.g. tensors the model does not use. Also kept in ``LoadedModel.info["warnings"]``."""


def resources_dir() -> Path:
    """The bundled resources (models, samples); ``VLM_READOUT_RESOURCES`` overrides."""
    env = os.environ.get("VLM_READOUT_RESOURCES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "resources"


@dataclass
class LoadedModel:
    """A model ready to run.

    Attributes:
        spec: what the user asked for.
        family: the adapter family.
        model: the torch module (eval mode).
        processor: the image processor / transform (and tokenizer for HF).
        tokenizer: the tokenizer.
        adapter: the canonical view of the model.
        path: the folder or file the weights came from.
        fingerprint: hash of every file the load read (config, weights,
            tokenizer, processor, chat template), to match lenses, sessions
            and results to the exact model.
        info: extra facts; ``info["warnings"]`` lists the load's warnings,
            ``info["dtype"]`` the dtype the weights were loaded in ("bfloat16"),
            ``info["device"]`` where they sit ("cpu", "cuda:0+cuda:1").
    """

    spec: str
    family: str
    model: Any
    processor: Any
    tokenizer: Any
    adapter: Adapter
    path: Path | None = None
    fingerprint: str = ""
    info: dict = field(default_factory=dict)


def _note_warning(loaded: LoadedModel, message: str | None) -> None:
    """Keep a warning of the load; :func:`load_model` issues them when the load succeeded."""
    if message:
        loaded.info.setdefault("warnings", []).append(message)


# ---------------------------------------------------------------- loading


@contextlib.contextmanager
def _quiet_libraries():
    """Keep the libraries' progress bars ("Loading weights"), load reports,
    log lines and Python warnings off the terminal while a model loads; the
    load's own findings are raised or warned in one line each. Restored after."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.get_verbosity()  # configures transformers' logger now, not inside the block
    bars = hf_logging.is_progress_bar_enabled()
    disabled = logging.root.manager.disable
    # open_clip logs through the root logger, whose module-level helpers add a
    # stderr handler for good when the root has none: give it one for the block.
    guard = logging.NullHandler() if not logging.root.handlers else None
    if guard is not None:
        logging.root.addHandler(guard)
    hf_logging.disable_progress_bar()
    logging.disable(max(disabled, logging.WARNING))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(disabled)
        if guard is not None:
            logging.root.removeHandler(guard)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _library_errors(where):
    """A library's failure while loading ``where`` as one ModelLoadError line."""
    import torch

    try:
        yield
    except ReadoutError:  # already one line: an adapter's ModelLoadError, ...
        raise
    except ImportError as e:
        raise ModelLoadError(f"{where}: a package is missing ({e})") from None
    except torch.cuda.OutOfMemoryError:
        raise ModelLoadError(f"{where}: out of GPU memory while loading; try dtype=bfloat16 or device='cpu'") from None
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:300]
        raise ModelLoadError(f"{where}: cannot load ({type(e).__name__}: {first})") from None


def _offline_unless_allowed(load):
    """``load_model`` fetches nothing unless ``allow_download=True``: the hub
    libraries stay offline for the whole load, in any process (the command line
    and the app are offline already: core/shell/offline.py)."""

    @functools.wraps(load)
    def guarded(*args, allow_download: bool = False, **kwargs):
        with offline.offline(not allow_download):
            return load(*args, allow_download=allow_download, **kwargs)

    return guarded


@_offline_unless_allowed
def load_model(
    spec: str | os.PathLike,
    *,
    device: str | None = None,
    dtype: Any = "auto",
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    allow_download: bool = False,
) -> LoadedModel:
    """Load a model for read-out.

    Args:
        spec: a built-in name (``shapes-llava``, ``shapes-coca``), a local
            Hugging Face model folder, an open_clip folder (with
            ``open_clip_config.json``), a Hugging Face repo id already in the
            local cache, or an open_clip ``name:checkpoint``.
        device: "cpu", "cuda", "cuda:1"...; "auto" spreads a large model over
            the available devices with accelerate's ``device_map="auto"``.
        dtype: "auto" (the default; None too), a name ("float32",
            "bfloat16", "float16") or a torch dtype. "auto": float32 on the CPU
            when the model fits in float32, else bfloat16; on a GPU the
            checkpoint's own dtype, bfloat16 for a float32 checkpoint of over
            1B parameters (:func:`core.models.memory.resolve_dtype`).
        allow_pickle: accept pickle checkpoints (they can run code).
        trust_remote_code: accept models whose code lives in the model repo.
        allow_download: allow fetching a repo id that is not cached.

    Raises:
        ModelLoadError: and its subclasses, with a one-line reason (see the
            module's trust rules); :class:`core.errors.ModelTooLargeError`
            when the model would not fit in the memory available (before
            anything is allocated; ``VLM_READOUT_MEMORY_AVAILABLE`` replaces the figure).

    Warns:
        ModelLoadWarning: one line each (also in ``info["warnings"]``), e.g.
            weights the model does not use.
    """
    device = check_device(device)  # a misspelled device or a missing GPU: one line, before any file is read
    spec_str = str(spec)
    if spec_str in BUILTIN:
        path = resources_dir() / "models" / spec_str
        if not path.is_dir():
            raise ModelLoadError(f"built-in model {spec_str} is missing from {path}; reinstall the project")
        if not (path / MANIFEST).is_file():
            raise ModelLoadError(f"built-in model {spec_str}: {path / MANIFEST} is missing; reinstall the project")
        loaded = _load_dir(path, device, dtype, allow_pickle, trust_remote_code)
    else:
        path = Path(spec_str).expanduser()
        if path.is_dir():
            loaded = _load_dir(path, device, dtype, allow_pickle, trust_remote_code)
        elif path.exists():
            raise ModelLoadError(f"{path}: is a file; give the model's folder (or name:checkpoint for open_clip)")
        elif _looks_like_open_clip(spec_str):
            loaded = _load_open_clip_spec(spec_str, device, dtype, allow_pickle, allow_download)
        elif _looks_like_repo_id(spec_str):
            loaded = _load_dir(_cached_repo(spec_str, allow_download), device, dtype, allow_pickle, trust_remote_code)
        else:
            raise ModelLoadError(
                f"{spec_str}: no such folder, built-in model ({', '.join(BUILTIN)}), "
                "cached repo id or open_clip name:checkpoint"
            )
    loaded.spec = loaded.adapter.spec = spec_str
    loaded.info["dtype"] = precision_dtype_name(loaded.adapter.parameters_dtype)
    loaded.info["device"] = placement(loaded.model)
    for message in loaded.info.get("warnings", []):
        warnings.warn(message, ModelLoadWarning, stacklevel=2)
    return loaded


def _looks_like_repo_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def _looks_like_open_clip(spec: str) -> bool:
    if ":" not in spec or spec.startswith(("/", ".")):
        return False
    name = spec.split(":", 1)[0]
    return "/" not in name and len(name) > 1


def _not_cached(allow_download: bool) -> str:
    """Why something the load needs from the Hugging Face hub was not fetched."""
    if not allow_download:
        return "not in the local cache; downloads need allow_download=True (--allow-download)"
    switch = offline.users_offline_switch()
    if switch and offline.is_offline():
        return f"not in the local cache, and {switch} is set in the environment (no downloads)"
    return ""


def _cached_repo(repo_id: str, allow_download: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=not allow_download))
    except Exception as e:
        why = _not_cached(allow_download)
        hint = f" ({why})" if why else f" ({(str(e).splitlines() or [''])[0][:200]})"
        raise ModelLoadError(f"{repo_id}: cannot load{hint}: {type(e).__name__}") from None


def _load_dir(path: Path, device, dtype, allow_pickle: bool, trust_remote_code: bool) -> LoadedModel:
    path = path.resolve()
    if not path.is_dir():
        raise ModelLoadError(f"{path}: no such folder")
    if not any(path.iterdir()):
        raise ModelLoadError(f"{path}: folder is empty (expected config.json or open_clip_config.json)")
    check_folder_entries(path)  # before anything, the libraries included, opens a file of it
    if (path / "open_clip_config.json").is_file():
        loaded = _load_open_clip_dir(path, device, dtype, allow_pickle)
    elif (path / "config.json").is_file():
        loaded = _load_hf_dir(path, device, dtype, allow_pickle, trust_remote_code)
    else:
        raise ModelLoadError(
            f"{path}: not a model folder (no config.json for Hugging Face, no open_clip_config.json for open_clip)"
        )
    # Last, so a damaged copy of a built-in model is named by its own problem first.
    files = loaded.info.pop("files")
    if (path / MANIFEST).exists():
        verify_manifest(path, files)
    loaded.fingerprint = fingerprint(path, files)
    return loaded


def _single_device(device) -> str:
    """open_clip models are not sharded: "auto" means the GPU if there is one."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device or "cpu"


def _plan_load(name, requested, device, counts: dict, sizes: ModelSizes, config_dtype=None):
    """The dtype to load model ``name`` in (``requested``, "auto" resolved), after checking that
    the weights (``counts``: elements by dtype, from the headers) and a read-out
    of the nominal prompt fit in the memory available; before anything is allocated."""
    import torch

    available = available_bytes(device)

    def plan(dtype):
        return plan_memory(counts, sizes, sizes.nominal_tokens, dtype, available, name=str(name))

    dtype = resolve_dtype(
        "auto" if requested is None else requested,
        device=device,
        config_dtype=checkpoint_dtype(config_dtype, counts),
        n_params=floating_parameters(counts),
        need_bytes_by_dtype={torch.float32: plan(torch.float32).need},
        available=available,
    )
    plan(dtype).check()
    return dtype


def _architecture(config_file: Path, config: dict) -> str:
    """``architectures[0]``; ``architectures`` must be a non-empty list of class names."""
    if "architectures" not in config or config["architectures"] is None:
        raise UnsupportedArchitectureError(
            f"{config_file}: no 'architectures' field (the model class to build); supported: "
            f"{', '.join(registry.supported())}"
        )
    value = config["architectures"]
    if not isinstance(value, list) or not value or not all(isinstance(a, str) and a for a in value):
        shown = json.dumps(value)[:80]
        raise ModelLoadError(
            f"{config_file} architectures: expected a non-empty list of class names, got {type(value).__name__} {shown}"
        )
    return value[0]


def _check_config_before_weights(path: Path, adapter_cls, trust_remote_code: bool):
    """The model's config, once the adapter has had its say: an unsupported
    variant is refused before gigabytes of weights load."""
    from transformers import AutoConfig

    try:
        with _quiet_libraries():
            config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelLoadError(
            f"{path}: unreadable config ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]})"
        ) from None
    check_config_consistency(path / "config.json", config)
    with _library_errors(path / "config.json"):
        adapter_cls.check_config(config)
    return config


def _load_hf_dir(path: Path, device, dtype, allow_pickle: bool, trust_remote_code: bool) -> LoadedModel:
    config = read_json(path / "config.json")
    check_config_json(path / "config.json", config)  # before the library reads it
    needs_remote = "auto_map" in config or any(
        f.suffix == ".py" and f.name.startswith(("modeling_", "configuration_", "processing_")) for f in path.iterdir()
    )
    if needs_remote and not trust_remote_code:
        raise UnsafeCheckpointError(
            f"{path}: this model needs code from its own folder (auto_map / modeling_*.py), which runs on load; "
            "refused unless trust_remote_code=True (--trust-remote-code)"
        )
    adapter_cls = registry.adapter_for_hf(_architecture(path / "config.json", config))
    model_config = _check_config_before_weights(path, adapter_cls, trust_remote_code)
    files, use_safetensors = weight_files(path, allow_pickle)
    stored = check_safetensors(files) if use_safetensors else {}
    generation = path / "generation_config.json"
    fields = token_id_fields("config.json", config)
    if generation.is_file():
        fields += token_id_fields("generation_config.json", read_json(generation))
    from transformers import AutoModelForImageTextToText, AutoProcessor

    for f in sorted(path.glob("*processor_config.json")):
        read_json(f)  # a non-finite setting, named (the library would read NaN as a number)
    check_chat_templates(path)
    with _library_errors(path), _quiet_libraries():
        processor = AutoProcessor.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    check_processor(path, processor, model_config)
    probe_image_processor(path, processor)
    tokenizer = getattr(processor, "tokenizer", processor)
    check_tokenizer(path, tokenizer, fields, padded=True)
    import torch

    with torch.device("meta"), _library_errors(path), _quiet_libraries():
        skeleton = AutoModelForImageTextToText.from_config(model_config, trust_remote_code=trust_remote_code)
    # the skeleton's counts for a pickle (no header to read): what the library will allocate
    counts = parameter_counts(stored) if use_safetensors else module_parameter_counts(skeleton)
    config_dtype = config.get("dtype", config.get("torch_dtype"))
    dtype = _plan_load(path, dtype, device, counts, ModelSizes.from_hf_config(model_config), config_dtype)
    if use_safetensors:
        n_stored = sum(math.prod(shape) for _, shape in stored.values())
    else:
        n_stored = sum(f.stat().st_size for f in files)
    check_size(path / "config.json", skeleton, n_stored, dtype)

    kwargs: dict[str, Any] = dict(
        local_files_only=True,
        trust_remote_code=trust_remote_code,
        use_safetensors=use_safetensors,
        dtype=dtype,
        output_loading_info=True,  # missing / unexpected / mis-shaped tensors, after the library's renames and ties
        ignore_mismatched_sizes=True,  # report a wrong shape here, in one line, not as the library's table
    )
    if device == "auto":
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            raise ModelLoadError(
                "device 'auto' spreads the model over devices with the accelerate package, which is not installed (pip install accelerate)"
            )
        kwargs["device_map"] = "auto"
    with _library_errors(path), _quiet_libraries():
        model, info = AutoModelForImageTextToText.from_pretrained(str(path), **kwargs)
    where = files[0] if len(files) == 1 else path
    unexpected = check_loaded_weights(
        where,
        missing=sorted(info["missing_keys"]),
        unexpected=sorted(info["unexpected_keys"]),
        mismatched=sorted(info["mismatched_keys"]),
        integer=integer_tensors_in_floating_slots(model, stored),
        expected=list(model.state_dict()),
    )
    untied = untied_weights_warning(_tie_field(path / "config.json", config), where, model)
    if device not in (None, "auto"):
        model.to(device)
    model.eval()
    check_finite(where, model)
    with _library_errors(path):  # an adapter reading a malformed config field
        adapter = adapter_cls(model, processor, tokenizer)
    check_vocabulary_fits(path, tokenizer, model, adapter)
    loaded = LoadedModel(str(path), adapter.family, model, processor, tokenizer, adapter, path)
    loaded.info["files"] = model_files(path, files)
    _note_warning(loaded, unexpected)
    _note_warning(loaded, untied)
    return loaded


def _tie_field(config_file: Path, config: dict) -> str:
    """The config.json field(s) asking for tied weights, for a warning."""
    fields = [
        name
        for name, section in (
            ("tie_word_embeddings", config),
            ("text_config.tie_word_embeddings", config.get("text_config")),
        )
        if isinstance(section, dict) and section.get("tie_word_embeddings") is True
    ]
    return f"{config_file} {' and '.join(fields) or 'tie_word_embeddings (its default)'}"


# ---------------------------------------------------------------- open_clip


def _open_clip_tokenizer(path: Path, tokenizer_dir: Path | None):
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        try:
            with _quiet_libraries():
                return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        except Exception as e:
            raise ModelLoadError(f"{tokenizer_dir}: cannot load the tokenizer ({type(e).__name__})") from None
    import open_clip

    with _library_errors(path), _quiet_libraries():
        return open_clip.get_tokenizer(f"local-dir:{path}")


def _open_clip_counts(checkpoint: Path) -> dict:
    """Elements by dtype of an open_clip checkpoint, from its safetensors header
    (checked); a pickle's are not readable without unpickling it, so its size
    is counted as float32 values."""
    if checkpoint.suffix == ".safetensors":
        return parameter_counts(check_safetensors([checkpoint]))
    return {"F32": checkpoint.stat().st_size // 4}


def _open_clip_state(checkpoint: Path, allow_pickle: bool) -> dict:
    """``{name: tensor}`` of an open_clip checkpoint (safetensors, or a pickle with ``allow_pickle``)."""
    import torch
    from open_clip.factory import load_state_dict

    with _library_errors(checkpoint):
        state = load_state_dict(str(checkpoint), device="cpu", weights_only=not allow_pickle)
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise ModelLoadError(f"{checkpoint}: not a state dict of tensors")
    return state


def _load_open_clip_weights(model, checkpoint: Path, state: dict) -> str | None:
    """Load ``state`` (read from ``checkpoint``) into ``model`` (built without
    weights) under the same rules as the Hugging Face path: missing,
    mis-shaped and integer tensors refused, unused ones returned as a warning.
    (open_clip's own load would refuse extra tensors too, cast integers
    silently and interpolate a positional embedding of another length.)"""
    expected = model.state_dict()
    both = [k for k in state if k in expected]
    warning = check_loaded_weights(
        checkpoint,
        missing=[k for k in expected if k not in state],
        unexpected=[k for k in state if k not in expected],
        mismatched=[(k, state[k].shape, expected[k].shape) for k in both if state[k].shape != expected[k].shape],
        integer=[
            f"{k}: {dtype_name(state[k].dtype)}"
            for k in both
            if expected[k].is_floating_point() and not state[k].is_floating_point()
        ],
    )
    model.load_state_dict({k: state[k] for k in both}, strict=True)
    return warning


def _text_cfg_field(where, field: str) -> str:
    """``field`` of an open_clip config's text_cfg, named where the user wrote it."""
    if isinstance(where, Path) and (where / "open_clip_config.json").is_file():
        return f"{where / 'open_clip_config.json'} model_cfg.text_cfg.{field}"
    return f"{where} text_cfg.{field}"


def _check_hub_name(where, field: str, name) -> None:
    """``text_cfg.<field>`` names a Hugging Face model: a name or a folder; a
    folder's config.json, which the library reads, must be a regular file (a
    FIFO would hang the load)."""
    if name is None:
        return
    if not isinstance(name, str) or not name.strip():
        shown = json.dumps(name)[:80] if isinstance(name, (str, int, float, bool, list, dict)) else repr(name)[:80]
        raise ModelLoadError(
            f"{_text_cfg_field(where, field)}: expected a Hugging Face model name or folder, "
            f"got {type(name).__name__} {shown}"
        )
    if not Path(name).expanduser().is_dir():
        return
    config = Path(name).expanduser() / "config.json"
    try:
        mode = os.stat(config).st_mode
    except OSError:
        raise ModelLoadError(f"{_text_cfg_field(where, field)}: {config} is missing") from None
    if not stat.S_ISREG(mode):
        raise ModelLoadError(f"{_text_cfg_field(where, field)}: {config} is not a regular file")


@contextlib.contextmanager
def _hub_model(where, what: str, field: str, name, allow_download: bool):
    """A failure inside the block, where it came from the Hugging Face model
    ``name`` (``text_cfg.<field>`` of an open_clip config: its HF text tower or
    tokenizer) being fetched while the hub is offline, as the one line that says
    so; any other failure is left to :func:`_library_errors`."""
    _check_hub_name(where, field, name)
    try:
        yield
    except ReadoutError:
        raise
    except Exception:
        remote = isinstance(name, str) and name and not Path(name).expanduser().is_dir()
        why = _not_cached(allow_download) if remote and offline.is_offline() else ""
        if not why:
            raise
        raise ModelLoadError(
            f"{where}: the {what} is the Hugging Face model {name!r} (text_cfg.{field}), {why}"
        ) from None


def _open_clip_model(
    name: str,
    where,
    *,
    state: dict | None = None,
    pretrained: str | None = None,
    text_cfg: dict | None = None,
    allow_download: bool = False,
):
    """(model, preprocess) of open_clip architecture ``name`` on the CPU, in
    float32, without weights unless ``pretrained`` (an open_clip tag) is given.
    With the checkpoint's ``state``, its size is first checked against the
    architecture built on the meta device (:func:`check_size`). A Hugging Face
    text tower (``text_cfg.hf_model_name``) is built from its config alone: its
    weights come from the checkpoint, so the library's own are never fetched."""
    import open_clip
    import torch

    def from_hub():
        return _hub_model(where, "text tower", "hf_model_name", (text_cfg or {}).get("hf_model_name"), allow_download)

    if state is not None:
        with torch.device("meta"), _library_errors(where), from_hub(), _quiet_libraries():
            skeleton = open_clip.create_model(name, load_weights=False, pretrained_text=False, device="meta")
        config = (
            Path(name.removeprefix("local-dir:")) / "open_clip_config.json" if name.startswith("local-dir:") else name
        )
        check_size(config, skeleton, sum(v.numel() for v in state.values()), torch.float32)
    with _library_errors(where), from_hub(), _quiet_libraries():
        model, _, preprocess = open_clip.create_model_and_transforms(
            name, pretrained=pretrained, load_weights=pretrained is not None, pretrained_text=False, device="cpu"
        )
    return model, preprocess


def _load_open_clip_dir(path: Path, device, dtype, allow_pickle: bool) -> LoadedModel:
    cfg = read_json(path / "open_clip_config.json")
    model_cfg = open_clip_model_cfg(path, cfg)
    check_open_clip_config(path / "open_clip_config.json", cfg, model_cfg)
    checkpoint = open_clip_checkpoint(path, allow_pickle)
    model_class = "CoCa" if "multimodal_cfg" in model_cfg else "CLIP"
    adapter_cls = registry.adapter_for_open_clip(model_class)
    tokenizer_dir = open_clip_tokenizer_dir(path, model_cfg)
    if tokenizer_dir is not None and tokenizer_dir != path:
        check_folder_entries(tokenizer_dir)
    tokenizer = _open_clip_tokenizer(path, tokenizer_dir)
    text_cfg = model_cfg.get("text_cfg", {})
    pad = [("open_clip_config.json model_cfg.text_cfg.pad_id", "pad", text_cfg.get("pad_id"))]
    check_tokenizer(tokenizer_dir or path, tokenizer, pad)
    device = _single_device(device)
    dtype = _plan_load(path, dtype, device, _open_clip_counts(checkpoint), ModelSizes.from_open_clip(model_cfg))
    state = _open_clip_state(checkpoint, allow_pickle)
    model, preprocess = _open_clip_model(f"local-dir:{path}", path, state=state, text_cfg=model_cfg.get("text_cfg"))
    probe_image_processor(path, preprocess)
    unexpected = _load_open_clip_weights(model, checkpoint, state)
    del state  # copied into the model: not held through the cast
    model = model.to(device=device, dtype=dtype).eval()
    check_finite(checkpoint, model)
    with _library_errors(path):
        adapter = adapter_cls(model, preprocess, tokenizer, cfg.get("vlm_readout", {}))
    check_vocabulary_fits(path, tokenizer, model, adapter)
    loaded = LoadedModel(
        str(path), adapter.family, model, preprocess, tokenizer, adapter, path, info={"open_clip": cfg}
    )
    loaded.info["files"] = model_files(path, [checkpoint], tokenizer_dir)
    _note_warning(loaded, unexpected)
    return loaded


def _load_open_clip_spec(spec: str, device, dtype, allow_pickle: bool, allow_download: bool) -> LoadedModel:
    """``model_name:checkpoint`` where checkpoint is a local file (or, with
    allow_download, an open_clip pretrained tag)."""
    import open_clip

    name, checkpoint = spec.split(":", 1)
    if name not in open_clip.list_models():
        raise ModelLoadError(f"{name}: not an open_clip model name (see open_clip.list_models())")
    ckpt = Path(checkpoint).expanduser()
    if os.path.lexists(ckpt) and not ckpt.is_file():  # never taken for a pretrained tag to fetch
        raise ModelLoadError(f"{ckpt}: not a regular file (a folder, FIFO, socket, device or broken link)")
    if ckpt.is_file():
        if ckpt.suffix != ".safetensors":
            if not allow_pickle:
                raise UnsafeCheckpointError(
                    f"{ckpt}: pickle checkpoint; unpickling can run arbitrary code, so it is refused "
                    "unless allow_pickle=True (--allow-pickle)"
                )
    elif not allow_download:
        raise ModelLoadError(f"{checkpoint}: no such checkpoint file (downloads need allow_download=True)")
    model_class = "CoCa" if name.lower().startswith("coca") else "CLIP"
    adapter_cls = registry.adapter_for_open_clip(model_class)
    model_cfg = open_clip.get_model_config(name) or {}
    text_cfg = model_cfg.get("text_cfg", {})
    # first: a Hugging Face tokenizer that is not cached is refused before the weights are read
    tokenizer_hub = _hub_model(
        spec, "tokenizer", "hf_tokenizer_name", text_cfg.get("hf_tokenizer_name"), allow_download
    )
    with _library_errors(spec), tokenizer_hub, _quiet_libraries():
        tokenizer = open_clip.get_tokenizer(name)
    # the library's own config, checked as a folder's is (its sizes plan the memory below)
    check_open_clip_config(Path(f"open_clip's {name} config"), {"model_cfg": model_cfg}, model_cfg)
    unexpected = None
    device = _single_device(device)
    tower = dict(text_cfg=text_cfg, allow_download=allow_download)
    if ckpt.is_file():
        dtype = _plan_load(spec, dtype, device, _open_clip_counts(ckpt), ModelSizes.from_open_clip(model_cfg))
        state = _open_clip_state(ckpt, allow_pickle)
        model, preprocess = _open_clip_model(name, spec, state=state, **tower)
        unexpected = _load_open_clip_weights(model, ckpt, state)
        del state  # copied into the model: not held through the cast
    else:  # a pretrained tag, downloaded: no header to plan from before the download
        dtype = resolve_dtype("auto" if dtype is None else dtype, device=device)
        model, preprocess = _open_clip_model(name, spec, pretrained=checkpoint, **tower)
    model = model.to(device=device, dtype=dtype).eval()
    check_finite(ckpt if ckpt.is_file() else Path(spec), model)
    adapter = adapter_cls(model, preprocess, tokenizer, {})
    check_vocabulary_fits(Path(spec), tokenizer, model, adapter)
    if ckpt.is_file():
        fp = fingerprint(ckpt.parent, [ckpt], extra=name)  # the architecture's name: open_clip builds it from it
    else:
        fp = hashlib.sha256(spec.encode()).hexdigest()[:16]
    loaded = LoadedModel(
        spec, adapter.family, model, preprocess, tokenizer, adapter, ckpt if ckpt.is_file() else None, fp
    )
    _note_warning(loaded, unexpected)
    return loaded
