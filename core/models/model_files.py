"""The files a model load reads, their fingerprint, and the manifest
(``MANIFEST.sha256``) a folder may ship: every file the load reads must match
it. Also which weight files a folder holds (safetensors; pickles only when
allowed).

Every file here is opened as a regular file only (:func:`check_folder_entries`
refuses a FIFO, socket or device in a model folder before anything, including
the libraries, opens one; :func:`open_regular` and :func:`read_json` open
non-blocking and check again), so a model folder can never hang a load."""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from pathlib import Path

from core.errors import ModelLoadError, UnsafeCheckpointError
from core.files.atomic import write_text_atomic
from core.files.input_files import MAX_JSON_DEPTH, json_depth_exceeds, open_regular_file, read_regular_bytes

MANIFEST = "MANIFEST.sha256"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# Files besides the weights that change what a model computes from an image
# and a question: config, tokenizer, processor, chat template, generation
# settings (glob patterns, relative to the model folder).
MODEL_FILE_PATTERNS = (
    "config.json",
    "open_clip_config.json",
    "generation_config.json",
    "adapter_config.json",
    "*.safetensors.index.json",
    "*processor_config.json",  # preprocessor_config.json, processor_config.json, video_preprocessor_config.json
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "*.tiktoken",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",
)


# Entries a model folder (or a folder inside it the load reads) may hold; more is
# not a model folder (sharded checkpoints have hundreds of files).
MAX_FOLDER_ENTRIES = 100_000
# Subfolders whose files the load reads (the libraries read them by name).
_READ_SUBFOLDERS = ("additional_chat_templates",)


def check_folder_entries(directory: Path) -> None:
    """Refuse a model folder holding anything but regular files and folders:
    the load, and the libraries it calls, open files by name (config.json,
    tokenizer files, weights, any chat template), and a FIFO among them would
    wait forever for a writer. Symbolic links to regular files (a Hugging Face
    cache snapshot) are fine; a broken one is refused. Also the subfolders the
    load reads (``additional_chat_templates``)."""
    folders = [directory, *(directory / name for name in _READ_SUBFOLDERS)]
    for folder in folders:
        if folder != directory and not folder.is_dir():
            continue
        try:
            with os.scandir(folder) as entries:
                for n, entry in enumerate(entries):
                    if n >= MAX_FOLDER_ENTRIES:
                        raise ModelLoadError(f"{folder}: over {MAX_FOLDER_ENTRIES:,} entries; not a model folder")
                    _check_entry(Path(entry.path))
        except OSError as e:
            raise ModelLoadError(f"{folder}: cannot list the folder ({e.strerror or e})") from None


def _check_entry(path: Path) -> None:
    try:
        mode = os.stat(path).st_mode  # follows a symbolic link to what it names
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: a broken symbolic link (what it names does not exist)") from None
    except OSError as e:  # ELOOP, EACCES, ...
        raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ModelLoadError(
            f"{path}: not a regular file (a FIFO, socket or device); a model folder holds regular files only"
        )


def open_regular(f: Path):
    """``f`` opened for binary reading if it is a regular file (never waiting on
    a FIFO: :func:`core.files.input_files.open_regular_file`); else a ModelLoadError line."""
    return open_regular_file(f, ModelLoadError, max_bytes=None)


def model_files(directory: Path, weights: list[Path], tokenizer_dir: Path | None = None) -> list[Path]:
    """Every file a load of ``directory`` reads: ``weights`` plus the files
    matching :data:`MODEL_FILE_PATTERNS` in the folder (and in ``tokenizer_dir``,
    an open_clip model's Hugging Face tokenizer folder inside it)."""
    found = set(weights)
    for folder in {directory, tokenizer_dir or directory}:
        for pattern in MODEL_FILE_PATTERNS:
            found.update(f for f in folder.glob(pattern) if f.is_file())
    return sorted(found)


def _relative(f: Path, root: Path) -> str:
    try:
        return f.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return f.name


def fingerprint(root: Path, files: list[Path], extra: str = "") -> str:
    """16 hex digits over every file's name (relative to ``root``), size and
    content. Weight files are read in part (their header, the first and the
    last MiB: gigabytes would take seconds on every load); every other file in full."""
    h = hashlib.sha256(extra.encode())
    for f in sorted(files, key=lambda p: _relative(p, root)):
        size = f.stat().st_size
        h.update(f"{_relative(f, root)}:{size}:".encode())
        with open_regular(f) as fh:
            if f.suffix == ".safetensors" or f.suffix in PICKLE_SUFFIXES:
                head = 8 + _header_length(fh) if f.suffix == ".safetensors" else 0
                fh.seek(0)
                h.update(fh.read(head + (1 << 20)))
                if size > head + (2 << 20):
                    fh.seek(-(1 << 20), os.SEEK_END)
                    h.update(fh.read())
            else:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


def _header_length(fh) -> int:
    raw = fh.read(8)
    return struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0


def _sha256(f: Path) -> str:
    h = hashlib.sha256()
    with open_regular(f) as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _folder_files(directory: Path) -> list[Path]:
    """The files a load of ``directory`` reads (weights found as :func:`weight_files` finds them)."""
    if (directory / "open_clip_config.json").is_file():
        cfg = read_json(directory / "open_clip_config.json")
        model_cfg = open_clip_model_cfg(directory, cfg)
        weights = [open_clip_checkpoint(directory, allow_pickle=True)]
        return model_files(directory, weights, open_clip_tokenizer_dir(directory, model_cfg))
    return model_files(directory, weight_files(directory, allow_pickle=True)[0])


def write_manifest(model_dir: Path | str) -> Path:
    """Write ``MANIFEST.sha256`` (``sha256sum`` format, so ``sha256sum -c``
    checks it too) listing the SHA-256 of every file a load of ``model_dir``
    reads; :func:`load_model` then refuses the folder if one of them changes.
    Called by the zoo when it saves a built-in model."""
    model_dir = Path(model_dir)
    lines = [f"{_sha256(f)}  {_relative(f, model_dir)}\n" for f in _folder_files(model_dir)]
    out = model_dir / MANIFEST

    write_text_atomic(out, "".join(sorted(lines, key=lambda line: line[66:])))
    return out


_MAX_MANIFEST_BYTES = 16 << 20  # 100,000 files' lines


def read_manifest(path: Path) -> dict[str, str]:
    """``{relative name: sha256}``; a malformed line is a one-line error with its number."""
    listed: dict[str, str] = {}
    raw = read_regular_bytes(path / MANIFEST, ModelLoadError, _MAX_MANIFEST_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path / MANIFEST}: not UTF-8 text (byte {e.start})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        name = name.strip()
        if not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest) or not name:
            raise ModelLoadError(f"{path / MANIFEST}:{n}: expected '<sha256>  <file name>'")
        if name.startswith("/") or ".." in name.split("/"):
            raise ModelLoadError(f"{path / MANIFEST}:{n}: {name!r} is not a file inside the model folder")
        listed[name] = digest
    return listed


def verify_manifest(path: Path, files: list[Path]) -> None:
    """Refuse the folder if a file it lists is missing or differs, or a file
    the load reads is not listed: the folder is not the model it was shipped as."""
    listed = read_manifest(path)
    hint = (
        f"the folder no longer holds the files its {MANIFEST} lists (delete {MANIFEST} if you changed them on purpose)"
    )
    unlisted = sorted({_relative(f, path) for f in files} - set(listed))
    if unlisted:
        raise ModelLoadError(f"{path / unlisted[0]}: not listed in {MANIFEST}; {hint}")
    for name, digest in sorted(listed.items()):
        f = path / name
        if not f.is_file():
            raise ModelLoadError(f"{f}: listed in {MANIFEST} but missing; {hint}")
        if _sha256(f) != digest:
            raise ModelLoadError(f"{f}: edited (its SHA-256 differs from {MANIFEST}); {hint}")


# ---------------------------------------------------------------- weights


def weight_files(directory: Path, allow_pickle: bool) -> tuple[list[Path], bool]:
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


def read_json(f: Path) -> dict:
    """The JSON object in a model folder's file ``f`` (a regular file, UTF-8,
    nested at most 64 deep). A non-finite number (NaN, Infinity, 1e999) is
    refused naming its field: no config or tokenizer holds one, and a NaN
    epsilon or scale would make every read-out NaN."""
    raw = read_regular_bytes(f, ModelLoadError)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{f}: not UTF-8 text (byte {e.start})") from None
    if json_depth_exceeds(text, MAX_JSON_DEPTH):
        raise ModelLoadError(f"{f}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    non_finite = []

    def number(token: str) -> float:
        value = float(token)
        if not math.isfinite(value):
            non_finite.append(token)
        return value

    try:
        data = json.loads(text, parse_constant=number, parse_float=number)
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise ModelLoadError(f"{f}: unreadable JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{f}: expected a JSON object")
    if non_finite:
        field, value = _first_non_finite(data)
        shown = "NaN" if math.isnan(value) else ("-" if value < 0 else "") + "Infinity"
        raise ModelLoadError(f"{f} {field}: expected a finite number, got {shown}")
    return data


def _first_non_finite(doc) -> tuple[str, float]:
    """(dotted field, value) of the first non-finite number in ``doc`` (depth-first, no recursion)."""
    stack = [("", doc)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where or "(the document)", value
        if isinstance(value, dict):
            stack += [(f"{where}.{k}" if where else str(k), v) for k, v in reversed(list(value.items()))]
        elif isinstance(value, list):
            stack += [(f"{where}[{i}]", v) for i, v in reversed(list(enumerate(value)))]
    return "(the document)", math.nan


# ---- an open_clip folder's files

# The checkpoint names open_clip prefers in a folder, in its order.
_OPEN_CLIP_CHECKPOINTS = (
    "open_clip_model.safetensors",
    "open_clip_pytorch_model.safetensors",
    "model.safetensors",
    "open_clip_pytorch_model.bin",
    "open_clip_pytorch_model.pth",
    "pytorch_model.bin",
    "pytorch_model.pth",
    "model.pth",
)


def open_clip_model_cfg(path: Path, cfg: dict) -> dict:
    """``model_cfg``, with the sections and fields this loader reads checked."""
    where = path / "open_clip_config.json"
    model_cfg = cfg.get("model_cfg")
    if not isinstance(model_cfg, dict):
        if model_cfg is None:
            raise ModelLoadError(f"{where}: missing 'model_cfg'")
        raise ModelLoadError(f"{where} model_cfg: expected an object, got {type(model_cfg).__name__}")
    for section in ("text_cfg", "vision_cfg", "multimodal_cfg"):
        if section in model_cfg and not isinstance(model_cfg[section], dict):
            got = type(model_cfg[section]).__name__
            raise ModelLoadError(f"{where} model_cfg.{section}: expected an object, got {got}")
    name = model_cfg.get("text_cfg", {}).get("hf_tokenizer_name")
    if name is not None and (not isinstance(name, str) or not name):
        raise ModelLoadError(f"{where} model_cfg.text_cfg.hf_tokenizer_name: expected a folder name, got {name!r}")
    return model_cfg


def open_clip_checkpoint(path: Path, allow_pickle: bool) -> Path:
    """The one weights file open_clip reads in ``path``."""
    files, _ = weight_files(path, allow_pickle)
    for name in _OPEN_CLIP_CHECKPOINTS:
        if path / name in files:
            return path / name
    if len(files) == 1:
        return files[0]
    raise ModelLoadError(
        f"{path}: several weight files ({', '.join(f.name for f in files)}) and open_clip reads one: "
        "name it open_clip_model.safetensors"
    )


def open_clip_tokenizer_dir(path: Path, model_cfg: dict) -> Path | None:
    """The Hugging Face tokenizer folder ``text_cfg.hf_tokenizer_name`` names, inside the model folder."""
    name = model_cfg.get("text_cfg", {}).get("hf_tokenizer_name")
    if not name:
        return None
    field = f"{path / 'open_clip_config.json'} model_cfg.text_cfg.hf_tokenizer_name"
    try:
        local = (path / name).resolve()
    except (OSError, ValueError) as e:  # a NUL byte, a symbolic-link loop, a name too long
        raise ModelLoadError(
            f"{field}: {name[:80]!r} is not a folder name ({getattr(e, 'strerror', None) or e})"
        ) from None
    if local != path.resolve() and path.resolve() not in local.parents:
        raise ModelLoadError(f"{field}: {name!r} is outside the model folder")
    return local
