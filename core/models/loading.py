"""``load_model(spec)``: built-in names, local folders, cached repo ids and
open_clip ``name:checkpoint`` specs, loaded offline and safely.

Safety rules: weights are read with safetensors; a pickle checkpoint is
refused unless ``allow_pickle=True`` (unpickling runs code); a model whose
config asks for remote code is refused unless ``trust_remote_code=True``;
nothing is downloaded unless ``allow_download=True``. Every failure is a
:class:`core.errors.ModelLoadError` with a one-line message.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import ModelLoadError, UnsafeCheckpointError
from core.models import registry
from core.models.adapter import Adapter

BUILTIN = ("shapes-llava", "shapes-coca")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


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
        fingerprint: hash of the config and weight files (to match lenses,
            sessions and results to the exact weights).
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


def _fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}:".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(-(1 << 20), os.SEEK_END)
                h.update(fh.read())
    return h.hexdigest()[:16]


def _check_safetensors(files: list[Path]) -> None:
    """Open every safetensors file and touch every tensor's extent, so a corrupt
    header or a truncated file fails here with a clear message."""
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                keys = list(st.keys())
                if not keys:
                    raise ModelLoadError(f"{f}: weights file holds no tensors")
                for k in keys:
                    st.get_slice(k)  # validates offsets against the header
            _check_safetensors_extent(f)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise ModelLoadError(f"{f}: corrupt or truncated weights ({type(e).__name__}: {e})") from None


def _check_safetensors_extent(f: Path) -> None:
    """The header's data offsets must end exactly at the file's end."""
    import struct

    with open(f, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ModelLoadError(f"{f}: corrupt or truncated weights (no header)")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(fh.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != f.stat().st_size:
        raise ModelLoadError(
            f"{f}: corrupt or truncated weights (header says {8 + n + end} bytes, file has {f.stat().st_size})"
        )


def _weights(directory: Path, allow_pickle: bool) -> tuple[list[Path], bool]:
    """(weight files, use_safetensors)."""
    safetensors = sorted(directory.glob("*.safetensors"))
    if safetensors:
        return safetensors, True
    pickles = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        if not allow_pickle:
            raise UnsafeCheckpointError(
                f"{directory}: only pickle checkpoints ({', '.join(p.name for p in pickles)}); "
                "unpickling can run arbitrary code, so they are refused unless allow_pickle=True "
                "(--allow-pickle); convert them to safetensors instead"
            )
        return pickles, False
    raise ModelLoadError(f"{directory}: no weights found (expected *.safetensors)")


def load_model(
    spec: str | os.PathLike,
    *,
    device: str | None = None,
    dtype: Any = None,
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
        dtype: torch dtype (default float32).
        allow_pickle: accept pickle checkpoints (they can run code).
        trust_remote_code: accept models whose code lives in the model repo.
        allow_download: allow fetching a repo id that is not cached.

    Raises:
        ModelLoadError: and its subclasses, with a one-line reason.
    """
    import torch

    dtype = dtype or torch.float32
    spec_str = str(spec)
    if spec_str in BUILTIN:
        path = resources_dir() / "models" / spec_str
        if not path.is_dir():
            raise ModelLoadError(f"built-in model {spec_str} is missing from {path}; reinstall the project")
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
    loaded.spec = spec_str
    return loaded


def _looks_like_repo_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def _looks_like_open_clip(spec: str) -> bool:
    if ":" not in spec or spec.startswith(("/", ".")):
        return False
    name = spec.split(":", 1)[0]
    return "/" not in name and len(name) > 1


def _cached_repo(repo_id: str, allow_download: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=not allow_download))
    except Exception as e:
        hint = "" if allow_download else " (not in the local cache; pass allow_download=True / --allow-download)"
        raise ModelLoadError(f"{repo_id}: cannot load{hint}: {type(e).__name__}") from None


def _load_dir(path: Path, device, dtype, allow_pickle: bool, trust_remote_code: bool) -> LoadedModel:
    path = path.resolve()
    if not path.is_dir():
        raise ModelLoadError(f"{path}: no such folder")
    if not any(path.iterdir()):
        raise ModelLoadError(f"{path}: folder is empty (expected config.json or open_clip_config.json)")
    if (path / "open_clip_config.json").is_file():
        return _load_open_clip_dir(path, device, dtype, allow_pickle)
    if (path / "config.json").is_file():
        return _load_hf_dir(path, device, dtype, allow_pickle, trust_remote_code)
    raise ModelLoadError(
        f"{path}: not a model folder (no config.json for Hugging Face, no open_clip_config.json for open_clip)"
    )


def _read_json(f: Path) -> dict:
    try:
        data = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{f}: unreadable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{f}: expected a JSON object")
    return data


def _single_device(device) -> str:
    """open_clip models are not sharded: "auto" means the GPU if there is one."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device or "cpu"


def _check_config_before_weights(path: Path, adapter_cls, trust_remote_code: bool) -> None:
    """Let the adapter refuse an unsupported variant before gigabytes of weights load."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelLoadError(
            f"{path}: unreadable config ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
        ) from None
    adapter_cls.check_config(config)


def _load_hf_dir(path: Path, device, dtype, allow_pickle: bool, trust_remote_code: bool) -> LoadedModel:
    config = _read_json(path / "config.json")
    needs_remote = "auto_map" in config or any(
        f.suffix == ".py" and f.name.startswith(("modeling_", "configuration_", "processing_")) for f in path.iterdir()
    )
    if needs_remote and not trust_remote_code:
        raise UnsafeCheckpointError(
            f"{path}: this model needs code from its own folder (auto_map / modeling_*.py), which runs on load; "
            "refused unless trust_remote_code=True (--trust-remote-code)"
        )
    architectures = config.get("architectures") or [None]
    adapter_cls = registry.adapter_for_hf(architectures[0])
    _check_config_before_weights(path, adapter_cls, trust_remote_code)
    files, use_safetensors = _weights(path, allow_pickle)
    if use_safetensors:
        _check_safetensors(files)
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    kwargs: dict[str, Any] = dict(
        local_files_only=True,
        trust_remote_code=trust_remote_code,
        use_safetensors=use_safetensors,
        dtype=dtype,
    )
    if device == "auto":
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            raise ModelLoadError(
                "device 'auto' spreads the model over devices with the accelerate package, which is not installed (pip install accelerate)"
            )
        kwargs["device_map"] = "auto"
    try:
        model = AutoModelForImageTextToText.from_pretrained(str(path), **kwargs)
        processor = AutoProcessor.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except ModelLoadError:
        raise
    except ImportError as e:
        raise ModelLoadError(f"{path}: a package is missing ({e})") from None
    except torch.cuda.OutOfMemoryError:
        raise ModelLoadError(f"{path}: out of GPU memory while loading; try dtype=bfloat16 or device='cpu'") from None
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot load ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
    if device not in (None, "auto"):
        model.to(device)
    model.eval()
    tokenizer = getattr(processor, "tokenizer", processor)
    adapter = adapter_cls(model, processor, tokenizer)
    fp = _fingerprint([path / "config.json", *files])
    return LoadedModel(str(path), adapter.family, model, processor, tokenizer, adapter, path, fp)


def _load_open_clip_dir(path: Path, device, dtype, allow_pickle: bool) -> LoadedModel:
    cfg = _read_json(path / "open_clip_config.json")
    model_cfg = cfg.get("model_cfg")
    if not isinstance(model_cfg, dict):
        raise ModelLoadError(f"{path / 'open_clip_config.json'}: missing 'model_cfg'")
    files, use_safetensors = _weights(path, allow_pickle)
    if use_safetensors:
        _check_safetensors(files)
    model_class = "CoCa" if "multimodal_cfg" in model_cfg else "CLIP"
    adapter_cls = registry.adapter_for_open_clip(model_class)
    import open_clip

    try:
        model, preprocess = open_clip.create_model_from_pretrained(
            f"local-dir:{path}", device=_single_device(device), weights_only=not allow_pickle
        )
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot load ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
    model = model.to(dtype=dtype).eval()
    tokenizer = _open_clip_tokenizer(path, model_cfg)
    extra = cfg.get("vlm_readout", {})
    adapter = adapter_cls(model, preprocess, tokenizer, extra)
    fp = _fingerprint([path / "open_clip_config.json", *files])
    return LoadedModel(str(path), adapter.family, model, preprocess, tokenizer, adapter, path, fp, {"open_clip": cfg})


def _open_clip_tokenizer(path: Path, model_cfg: dict):
    name = model_cfg.get("text_cfg", {}).get("hf_tokenizer_name")
    if name:
        from transformers import AutoTokenizer

        local = (path / name).resolve()
        try:
            return AutoTokenizer.from_pretrained(str(local), local_files_only=True)
        except Exception as e:
            raise ModelLoadError(f"{local}: cannot load the tokenizer ({type(e).__name__})") from None
    import open_clip

    return open_clip.get_tokenizer(f"local-dir:{path}")


def _load_open_clip_spec(spec: str, device, dtype, allow_pickle: bool, allow_download: bool) -> LoadedModel:
    """``model_name:checkpoint`` where checkpoint is a local file (or, with
    allow_download, an open_clip pretrained tag)."""
    import open_clip

    name, checkpoint = spec.split(":", 1)
    if name not in open_clip.list_models():
        raise ModelLoadError(f"{name}: not an open_clip model name (see open_clip.list_models())")
    ckpt = Path(checkpoint).expanduser()
    if ckpt.is_file():
        if ckpt.suffix != ".safetensors":
            if not allow_pickle:
                raise UnsafeCheckpointError(
                    f"{ckpt}: pickle checkpoint; unpickling can run arbitrary code, so it is refused "
                    "unless allow_pickle=True (--allow-pickle)"
                )
        else:
            _check_safetensors([ckpt])
    elif not allow_download:
        raise ModelLoadError(f"{checkpoint}: no such checkpoint file (downloads need allow_download=True)")
    model_class = "CoCa" if name.lower().startswith("coca") else "CLIP"
    adapter_cls = registry.adapter_for_open_clip(model_class)
    try:
        model, _, preprocess = open_clip.create_model_and_transforms(
            name,
            pretrained=str(ckpt) if ckpt.is_file() else checkpoint,
            device=_single_device(device),
            weights_only=not allow_pickle,
        )
    except Exception as e:
        raise ModelLoadError(f"{spec}: cannot load ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
    model = model.to(dtype=dtype).eval()
    tokenizer = open_clip.get_tokenizer(name)
    adapter = adapter_cls(model, preprocess, tokenizer, {})
    fp = _fingerprint([ckpt]) if ckpt.is_file() else hashlib.sha256(spec.encode()).hexdigest()[:16]
    return LoadedModel(
        spec, adapter.family, model, preprocess, tokenizer, adapter, ckpt if ckpt.is_file() else None, fp
    )
