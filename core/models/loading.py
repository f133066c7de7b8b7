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
* tokenizer: its files must agree with each other (added and post-processor
  token ids, a BPE / Unigram vocabulary's training order) and with the
  model's config (the special tokens' ids, the vocabulary size against the
  embedding rows), so a shuffled or foreign ``tokenizer.json`` is refused.
* a folder holding ``MANIFEST.sha256`` (the built-in models ship one) is
  refused if any file the load reads differs from it, is missing or is not in it.
* the fingerprint covers every file the load reads (config, weights,
  tokenizer, processor, chat template, generation config), so a lens or a
  session made with one tokenizer is not applied with another.
* the libraries' progress bars and load reports never reach the terminal.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import ModelLoadError, ReadoutError, UnsafeCheckpointError, UnsupportedArchitectureError
from core.models import registry
from core.models.adapter import Adapter

BUILTIN = ("shapes-llava", "shapes-coca")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MANIFEST = "MANIFEST.sha256"

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
_SHOWN = 4  # tensor names a message lists before "+N more"


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
        info: extra facts; ``info["warnings"]`` lists the load's warnings.
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


# ---------------------------------------------------------------- files, fingerprint, manifest


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


def _fingerprint(root: Path, files: list[Path], extra: str = "") -> str:
    """16 hex digits over every file's name (relative to ``root``), size and
    content. Weight files are read in part (their header, the first and the
    last MiB: gigabytes would take seconds on every load); every other file in full."""
    h = hashlib.sha256(extra.encode())
    for f in sorted(files, key=lambda p: _relative(p, root)):
        size = f.stat().st_size
        h.update(f"{_relative(f, root)}:{size}:".encode())
        with open(f, "rb") as fh:
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
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _folder_files(directory: Path) -> list[Path]:
    """The files a load of ``directory`` reads (weights found as :func:`_weights` finds them)."""
    if (directory / "open_clip_config.json").is_file():
        cfg = _read_json(directory / "open_clip_config.json")
        model_cfg = _open_clip_model_cfg(directory, cfg)
        weights = [_open_clip_checkpoint(directory, allow_pickle=True)]
        return model_files(directory, weights, _open_clip_tokenizer_dir(directory, model_cfg))
    return model_files(directory, _weights(directory, allow_pickle=True)[0])


def write_manifest(model_dir: Path | str) -> Path:
    """Write ``MANIFEST.sha256`` (``sha256sum`` format, so ``sha256sum -c``
    checks it too) listing the SHA-256 of every file a load of ``model_dir``
    reads; :func:`load_model` then refuses the folder if one of them changes.
    Called by the zoo when it saves a built-in model."""
    model_dir = Path(model_dir)
    lines = [f"{_sha256(f)}  {_relative(f, model_dir)}\n" for f in _folder_files(model_dir)]
    out = model_dir / MANIFEST
    from core.atomic import write_text_atomic

    write_text_atomic(out, "".join(sorted(lines, key=lambda line: line[66:])))
    return out


def _read_manifest(path: Path) -> dict[str, str]:
    """``{relative name: sha256}``; a malformed line is a one-line error with its number."""
    listed: dict[str, str] = {}
    try:
        text = (path / MANIFEST).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path / MANIFEST}: unreadable ({e})") from None
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


def _verify_manifest(path: Path, files: list[Path]) -> None:
    """Refuse the folder if a file it lists is missing or differs, or a file
    the load reads is not listed: the folder is not the model it was shipped as."""
    listed = _read_manifest(path)
    hint = (
        f"the folder no longer holds the files its {MANIFEST} lists "
        f"(delete {MANIFEST} if you changed them on purpose)"
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


def _safetensors_header(f: Path) -> dict:
    """The header of a safetensors file, checked against the file's size: the
    tensors' data offsets must end exactly at the end of the file."""
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
    return header


def _check_safetensors(files: list[Path]) -> dict[str, tuple[str, list[int]]]:
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
            with safe_open(str(f), framework="pt") as st:
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
        stored.update({k: (str(v.get("dtype")), list(v.get("shape", []))) for k, v in header.items() if k != "__metadata__"})
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


def _dtype_name(dtype) -> str:
    """A torch dtype or a safetensors dtype code as torch names it ("int32")."""
    code = str(dtype).removeprefix("torch.")
    return _TORCH_NAMES.get(code, code)


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


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _listed(items: list[str], by_layer: bool = False) -> str:
    """The first few of ``items`` (naturally sorted: layers.2 before layers.10),
    then "+N more". ``by_layer``: names under one numbered module (a whole
    layer) are shown once, as ``model.layers.3.* (9 tensors)``."""
    import re

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


def _integer_tensors_in_floating_slots(model, stored: dict[str, tuple[str, list[int]]]) -> list[str]:
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
                    found.append(f"{key}: {_dtype_name(code)}")
                break
    return found


_UNBACKED_LIMIT = 1 << 30  # bytes of weights a config may describe beyond what the files hold


def _check_size(config_file: Path, skeleton, stored: int, dtype) -> None:
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


def _check_loaded_weights(
    where: Path,
    *,
    missing: list[str],
    unexpected: list[str],
    mismatched: list[tuple[str, Any, Any]],
    integer: list[str],
) -> str | None:
    """Refuse weights that would make the model compute something other than
    the checkpoint: tensors it needs that the files lack (the library fills them
    with random values), tensors of the wrong shape, integer or boolean tensors
    in floating-point slots. One line, naming the first few of each.

    Returns:
        the warning for tensors the model does not use (None if there are none).
    """
    problems = []
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


def _check_finite(where: Path, model) -> None:
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


def _note_warning(loaded: LoadedModel, message: str | None) -> None:
    """Keep a warning of the load; :func:`load_model` issues them when the load succeeded."""
    if message:
        loaded.info.setdefault("warnings", []).append(message)


# ---------------------------------------------------------------- tokenizer

# Config fields naming a special token's id -> the tokenizer attribute holding
# that token (image / video token ids are the adapters' check: core.models.adapter).
_TOKEN_ID_ROLES = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "pad", "sep_token_id": "sep"}


def _token_id_fields(source: str, config: dict) -> list[tuple[str, str, Any]]:
    """``[(label, role, value)]`` of the special token ids a config states, at
    its top level and in its ``text_config`` (label: ``"config.json text_config.eos_token_id"``)."""
    out = []
    for prefix, section in (("", config), ("text_config.", config.get("text_config"))):
        if isinstance(section, dict):
            out += [(f"{source} {prefix}{k}", role, section[k]) for k, role in _TOKEN_ID_ROLES.items() if k in section]
    return out


def _post_processor_ids(pp) -> list[tuple[str, int]]:
    """``[(token, id)]`` a tokenizer.json post-processor inserts (TemplateProcessing,
    Bert / Roberta processing, nested in Sequence)."""
    if not isinstance(pp, dict):
        return []
    kind = pp.get("type")
    if kind == "Sequence":
        return [x for p in pp.get("processors") or [] for x in _post_processor_ids(p)]
    if kind == "TemplateProcessing" and isinstance(pp.get("special_tokens"), dict):
        out = []
        for spec in pp["special_tokens"].values():
            if isinstance(spec, dict):
                out += list(zip(spec.get("tokens") or [], spec.get("ids") or []))
        return out
    if kind in ("BertProcessing", "RobertaProcessing"):
        return [tuple(pp[k]) for k in ("sep", "cls") if isinstance(pp.get(k), list) and len(pp[k]) == 2]
    return []


# Trained vocabularies keep their ids in training order (~100% of consecutive
# pairs in order); a shuffled one has about half in order.
_ORDERED_SHARE = 0.75
_ORDER_EVIDENCE = 32  # fewer merges / pieces than this tell nothing


def _vocabulary_order(model: dict, ids: dict) -> tuple[str, float] | None:
    """(what, share in order) for a BPE or Unigram vocabulary: the share of
    consecutive merges whose merged token has a higher id than the previous
    one's (BPE trainers and tiktoken give a merge's token the next id; the
    SentencePiece converter lists merges by their token's id), or of consecutive scored Unigram pieces whose
    score does not rise (SentencePiece sorts them). None: nothing to tell."""
    if model.get("type") == "BPE" and isinstance(model.get("merges"), list):
        merged = []
        for m in model["merges"]:
            pair = m if isinstance(m, list) else str(m).split(" ", 1)
            i = ids.get("".join(pair)) if all(isinstance(p, str) for p in pair) else None
            if isinstance(i, int) and (not merged or merged[-1] != i):  # one token merged several ways: once
                merged.append(i)
        pairs = list(zip(merged, merged[1:]))
        if len(pairs) >= _ORDER_EVIDENCE:
            return "merges", sum(b > a for a, b in pairs) / len(pairs)
    if model.get("type") == "Unigram" and isinstance(model.get("vocab"), list):
        scores = [e[1] for e in model["vocab"] if isinstance(e, list) and len(e) == 2 and e[1] not in (0, 0.0)]
        pairs = [(a, b) for a, b in zip(scores, scores[1:]) if isinstance(a, int | float) and isinstance(b, int | float)]
        if len(pairs) >= _ORDER_EVIDENCE:
            return "scores", sum(b <= a for a, b in pairs) / len(pairs)
    return None


def _check_tokenizer_json(f: Path) -> None:
    """A reordered or edited vocabulary no longer agrees with the rest of
    tokenizer.json: each id must name one token, the added tokens and the
    post-processor's special tokens must keep the ids the vocabulary gives
    them, and a BPE / Unigram vocabulary must keep its training order."""
    data = _read_json(f)
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        ids = vocab
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the position
        ids = {e[0]: i for i, e in enumerate(vocab) if isinstance(e, list) and e and isinstance(e[0], str)}
    else:
        return
    owner: dict = {}
    for token, i in ids.items():
        if not isinstance(i, int):
            continue
        if i in owner:
            raise ModelLoadError(f"{f}: the vocabulary gives id {i} to both {owner[i]!r} and {token!r}")
        owner[i] = token
    known = dict(ids)
    added = data.get("added_tokens") if isinstance(data.get("added_tokens"), list) else []
    for a in added:
        content, i = (a.get("content"), a.get("id")) if isinstance(a, dict) else (None, None)
        if not isinstance(content, str):
            continue
        if content in ids and ids[content] != i:
            raise ModelLoadError(
                f"{f}: added token {content!r} has id {i} in added_tokens but id {ids[content]} in the "
                "vocabulary: the vocabulary was reordered or edited"
            )
        known.setdefault(content, i)
    for token, i in _post_processor_ids(data.get("post_processor")):
        if isinstance(token, str) and token in known and known[token] != i:
            raise ModelLoadError(
                f"{f}: the post-processor inserts {token!r} as id {i}, the vocabulary has it at id {known[token]}: "
                "the vocabulary was reordered or edited"
            )
    order = _vocabulary_order(model, ids)
    if order is not None and order[1] < _ORDERED_SHARE:
        what, share = order
        raise ModelLoadError(
            f"{f}: the vocabulary's ids do not follow its {what} ({share:.0%} of consecutive {what} in order; "
            "a trained vocabulary has nearly all): the vocabulary was reordered"
        )


def _check_added_tokens_decoder(f: Path, tokenizer) -> None:
    """tokenizer_config.json's ``added_tokens_decoder`` (id -> token) must be
    what the loaded tokenizer does."""
    decoder = _read_json(f).get("added_tokens_decoder")
    if decoder is None:
        return
    if not isinstance(decoder, dict):
        raise ModelLoadError(
            f"{f} added_tokens_decoder: expected an object of id -> token, got {type(decoder).__name__}"
        )
    vocab = tokenizer.get_vocab()
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or not str(key).isdigit():
            raise ModelLoadError(f"{f} added_tokens_decoder[{key!r}]: expected a token id and an object with 'content'")
        if vocab.get(content) != int(key):
            have = vocab.get(content)
            raise ModelLoadError(
                f"{f}: added_tokens_decoder gives {content!r} id {key}, the tokenizer "
                + (f"has it at id {have}" if have is not None else "does not have it")
                + ": the tokenizer files disagree (a reordered or edited vocabulary)"
            )


def _check_special_token_ids(tokenizer, fields: list[tuple[str, str, Any]]) -> None:
    """Each special token id the model's config states (bos, eos, pad, sep)
    must be the id the tokenizer gives its token of that role, or at least one
    of the tokenizer's special tokens (configs list extra end tokens): else the
    model would start, stop or pad on an ordinary word."""
    special = set(getattr(tokenizer, "added_tokens_decoder", None) or {}) | set(
        getattr(tokenizer, "all_special_ids", None) or []
    )
    n_tokens = len(tokenizer)
    for label, role, value in fields:
        values = value if role == "eos" and isinstance(value, list) else [value]
        for v in values:
            if v is None:
                continue
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int):
                more = " or a list of them" if role == "eos" else ""
                raise ModelLoadError(f"{label}: expected a token id (an integer{more}), got {value!r}")
            declared = getattr(tokenizer, f"{role}_token", None)
            if v < 0 or not isinstance(declared, str) or v in special:
                continue  # -1 means "none" in some configs; nothing to compare without a declared token
            declared_id = tokenizer.convert_tokens_to_ids(declared)
            if v == declared_id:
                continue
            token = tokenizer.convert_ids_to_tokens(v) if v < n_tokens else None
            reads = f"reads id {v} as {token!r}" if token is not None else f"has no id {v} ({n_tokens} tokens)"
            raise ModelLoadError(
                f"{label} is {v}, but the tokenizer {reads} and gives its {role} token {declared!r} id {declared_id}: "
                "the tokenizer does not belong to this model (a reordered vocabulary or another model's tokenizer)"
            )


def _check_tokenizer(folder: Path, tokenizer, fields: list[tuple[str, str, Any]]) -> None:
    """The tokenizer files in ``folder`` agree with each other and with the
    model's config (before the weights load: a wrong tokenizer costs no
    gigabytes). open_clip's own tokenizers have no files to check."""
    if not hasattr(tokenizer, "get_vocab"):
        return
    if (folder / "tokenizer.json").is_file():
        _check_tokenizer_json(folder / "tokenizer.json")
    if (folder / "tokenizer_config.json").is_file():
        _check_added_tokens_decoder(folder / "tokenizer_config.json", tokenizer)
    _check_special_token_ids(tokenizer, fields)


def _check_vocabulary_fits(where: Path, tokenizer, model, adapter: Adapter) -> None:
    """Every token id must have an embedding row, and every ordinary (not
    added) token a row of the output layer: a tokenizer of another model
    reads ids the model does not have. (Added tokens such as Mllama's
    ``<|image|>`` may be input-only.)"""
    import torch

    if not hasattr(tokenizer, "get_vocab"):
        return
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    try:
        if isinstance(embedding, torch.nn.Embedding):
            rows = embedding.num_embeddings
        else:  # open_clip: the adapter knows where the token embeddings are
            rows = int(adapter.input_embeddings().shape[0])
    except (AttributeError, NotImplementedError, TypeError):
        rows = None
    try:
        out_rows = int(adapter.W_U.shape[1])
    except (AttributeError, NotImplementedError, TypeError):
        out_rows = None
    vocab = tokenizer.get_vocab()
    if not vocab:
        raise ModelLoadError(f"{where}: the tokenizer has no tokens")
    token, top = max(vocab.items(), key=lambda kv: kv[1])
    if rows is not None and top >= rows:
        raise ModelLoadError(
            f"{where}: the tokenizer's ids reach {top} ({token!r}) but the model embeds {rows} tokens: "
            "the tokenizer is not this model's"
        )
    added = set(getattr(tokenizer, "added_tokens_decoder", None) or {})
    ordinary = [(t, i) for t, i in vocab.items() if i not in added]
    if out_rows is not None and ordinary:
        token, top = max(ordinary, key=lambda kv: kv[1])
        if top >= out_rows:
            raise ModelLoadError(
                f"{where}: the tokenizer's vocabulary reaches id {top} ({token!r}) but the model's output layer "
                f"scores {out_rows} tokens: the tokenizer is not this model's"
            )


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
        ModelLoadError: and its subclasses, with a one-line reason (see the
            module's trust rules).

    Warns:
        ModelLoadWarning: one line each (also in ``info["warnings"]``), e.g.
            weights the model does not use.
    """
    import torch

    dtype = dtype or torch.float32
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
    loaded.spec = spec_str
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
        _verify_manifest(path, files)
    loaded.fingerprint = _fingerprint(path, files)
    return loaded


def _read_json(f: Path) -> dict:
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelLoadError(f"{f}: unreadable JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{f}: expected a JSON object")
    return data


def _single_device(device) -> str:
    """open_clip models are not sharded: "auto" means the GPU if there is one."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device or "cpu"


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
    with _library_errors(path / "config.json"):
        adapter_cls.check_config(config)
    return config


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
    adapter_cls = registry.adapter_for_hf(_architecture(path / "config.json", config))
    model_config = _check_config_before_weights(path, adapter_cls, trust_remote_code)
    files, use_safetensors = _weights(path, allow_pickle)
    stored = _check_safetensors(files) if use_safetensors else {}
    generation = path / "generation_config.json"
    fields = _token_id_fields("config.json", config)
    if generation.is_file():
        fields += _token_id_fields("generation_config.json", _read_json(generation))
    from transformers import AutoModelForImageTextToText, AutoProcessor

    with _library_errors(path), _quiet_libraries():
        processor = AutoProcessor.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    tokenizer = getattr(processor, "tokenizer", processor)
    _check_tokenizer(path, tokenizer, fields)
    import torch

    with torch.device("meta"), _library_errors(path), _quiet_libraries():
        skeleton = AutoModelForImageTextToText.from_config(model_config, trust_remote_code=trust_remote_code)
    if use_safetensors:
        n_stored = sum(math.prod(shape) for _, shape in stored.values())
    else:
        n_stored = sum(f.stat().st_size for f in files)
    _check_size(path / "config.json", skeleton, n_stored, dtype)

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
    unexpected = _check_loaded_weights(
        where,
        missing=sorted(info["missing_keys"]),
        unexpected=sorted(info["unexpected_keys"]),
        mismatched=sorted(info["mismatched_keys"]),
        integer=_integer_tensors_in_floating_slots(model, stored),
    )
    if device not in (None, "auto"):
        model.to(device)
    model.eval()
    _check_finite(where, model)
    with _library_errors(path):  # an adapter reading a malformed config field
        adapter = adapter_cls(model, processor, tokenizer)
    _check_vocabulary_fits(path, tokenizer, model, adapter)
    loaded = LoadedModel(str(path), adapter.family, model, processor, tokenizer, adapter, path)
    loaded.info["files"] = model_files(path, files)
    _note_warning(loaded, unexpected)
    return loaded


# ---------------------------------------------------------------- open_clip

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


def _open_clip_model_cfg(path: Path, cfg: dict) -> dict:
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


def _open_clip_checkpoint(path: Path, allow_pickle: bool) -> Path:
    """The one weights file open_clip reads in ``path``."""
    files, _ = _weights(path, allow_pickle)
    for name in _OPEN_CLIP_CHECKPOINTS:
        if path / name in files:
            return path / name
    if len(files) == 1:
        return files[0]
    raise ModelLoadError(
        f"{path}: several weight files ({', '.join(f.name for f in files)}) and open_clip reads one: "
        "name it open_clip_model.safetensors"
    )


def _open_clip_tokenizer_dir(path: Path, model_cfg: dict) -> Path | None:
    """The Hugging Face tokenizer folder ``text_cfg.hf_tokenizer_name`` names, inside the model folder."""
    name = model_cfg.get("text_cfg", {}).get("hf_tokenizer_name")
    if not name:
        return None
    local = (path / name).resolve()
    if local != path.resolve() and path.resolve() not in local.parents:
        raise ModelLoadError(
            f"{path / 'open_clip_config.json'} model_cfg.text_cfg.hf_tokenizer_name: {name!r} "
            "is outside the model folder"
        )
    return local


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
    warning = _check_loaded_weights(
        checkpoint,
        missing=[k for k in expected if k not in state],
        unexpected=[k for k in state if k not in expected],
        mismatched=[(k, state[k].shape, expected[k].shape) for k in both if state[k].shape != expected[k].shape],
        integer=[
            f"{k}: {_dtype_name(state[k].dtype)}"
            for k in both
            if expected[k].is_floating_point() and not state[k].is_floating_point()
        ],
    )
    model.load_state_dict({k: state[k] for k in both}, strict=True)
    return warning


def _open_clip_model(name: str, where, *, state: dict | None = None, pretrained: str | None = None):
    """(model, preprocess) of open_clip architecture ``name`` on the CPU, in
    float32, without weights unless ``pretrained`` (an open_clip tag) is given.
    With the checkpoint's ``state``, its size is first checked against the
    architecture built on the meta device (:func:`_check_size`)."""
    import open_clip
    import torch

    if state is not None:
        with torch.device("meta"), _library_errors(where), _quiet_libraries():
            skeleton = open_clip.create_model(name, load_weights=False, device="meta")
        config = Path(name.removeprefix("local-dir:")) / "open_clip_config.json" if name.startswith("local-dir:") else name
        _check_size(config, skeleton, sum(v.numel() for v in state.values()), torch.float32)
    with _library_errors(where), _quiet_libraries():
        model, _, preprocess = open_clip.create_model_and_transforms(
            name, pretrained=pretrained, load_weights=pretrained is not None, device="cpu"
        )
    return model, preprocess


def _load_open_clip_dir(path: Path, device, dtype, allow_pickle: bool) -> LoadedModel:
    cfg = _read_json(path / "open_clip_config.json")
    model_cfg = _open_clip_model_cfg(path, cfg)
    checkpoint = _open_clip_checkpoint(path, allow_pickle)
    if checkpoint.suffix == ".safetensors":
        _check_safetensors([checkpoint])
    model_class = "CoCa" if "multimodal_cfg" in model_cfg else "CLIP"
    adapter_cls = registry.adapter_for_open_clip(model_class)
    tokenizer_dir = _open_clip_tokenizer_dir(path, model_cfg)
    tokenizer = _open_clip_tokenizer(path, tokenizer_dir)
    text_cfg = model_cfg.get("text_cfg", {})
    pad = [("open_clip_config.json model_cfg.text_cfg.pad_id", "pad", text_cfg.get("pad_id"))]
    _check_tokenizer(tokenizer_dir or path, tokenizer, pad)
    state = _open_clip_state(checkpoint, allow_pickle)
    model, preprocess = _open_clip_model(f"local-dir:{path}", path, state=state)
    unexpected = _load_open_clip_weights(model, checkpoint, state)
    model = model.to(device=_single_device(device), dtype=dtype).eval()
    _check_finite(checkpoint, model)
    with _library_errors(path):
        adapter = adapter_cls(model, preprocess, tokenizer, cfg.get("vlm_readout", {}))
    _check_vocabulary_fits(path, tokenizer, model, adapter)
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
    unexpected = None
    if ckpt.is_file():
        state = _open_clip_state(ckpt, allow_pickle)
        model, preprocess = _open_clip_model(name, spec, state=state)
        unexpected = _load_open_clip_weights(model, ckpt, state)
    else:
        model, preprocess = _open_clip_model(name, spec, pretrained=checkpoint)
    model = model.to(device=_single_device(device), dtype=dtype).eval()
    _check_finite(ckpt if ckpt.is_file() else Path(spec), model)
    tokenizer = open_clip.get_tokenizer(name)
    adapter = adapter_cls(model, preprocess, tokenizer, {})
    _check_vocabulary_fits(Path(spec), tokenizer, model, adapter)
    if ckpt.is_file():
        fp = _fingerprint(ckpt.parent, [ckpt], extra=name)  # the architecture's name: open_clip builds it from it
    else:
        fp = hashlib.sha256(spec.encode()).hexdigest()[:16]
    loaded = LoadedModel(
        spec, adapter.family, model, preprocess, tokenizer, adapter, ckpt if ckpt.is_file() else None, fp
    )
    _note_warning(loaded, unexpected)
    return loaded
