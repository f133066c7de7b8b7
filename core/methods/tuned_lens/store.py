"""A tuned lens on disk: :func:`save_lens` / :func:`load_lens` of a lens folder
(``lens.safetensors``, ``lens.json``) and its human-readable ``REPORT.md``
(:func:`report_markdown`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from core.files import json_fields as jf
from core.files.atomic import write_bytes_atomic, write_text_atomic
from core.files.input_files import checked_path, read_json_file
from core.methods.tuned_lens.lens import _EQUATIONS, FORMS, POSITION_SETS, SCHEMA_VERSION, LensError, TunedLens
from core.models.memory import available_bytes

LENS_CONFIG = "lens.json"
LENS_TENSORS = "lens.safetensors"
LENS_REPORT = "REPORT.md"
# The dtypes a lens is saved in, and their safetensors codes.
LENS_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
_DTYPE_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}
# Bounds a lens.json must keep before anything is built from it: above every model
# served (hundreds of blocks, widths up to ~30k), far below what would ask the
# allocator for terabytes. The tensors file's header is then checked against them.
MAX_LENS_BLOCKS = 4096
MAX_LENS_WIDTH = 2**17
MAX_LENS_CONFIG_BYTES = 64 * 2**20


def save_lens(lens: TunedLens, directory: Path | str) -> Path:
    """Write ``lens.safetensors`` (translators + mean states), ``lens.json``
    (schema version, model fingerprint, form, training, capacity, report) and
    ``REPORT.md`` into ``directory``; each file atomically."""
    from safetensors.torch import save

    directory = Path(directory)
    tensors = {k: v.detach().cpu().contiguous() for k, v in lens.state_dict().items()}
    blob = save(tensors, metadata={"fingerprint": lens.meta.get("fingerprint", ""), "form": lens.form})
    write_bytes_atomic(directory / LENS_TENSORS, blob)
    config = {
        "schema_version": SCHEMA_VERSION,
        "kind": "vlm-readout tuned lens",
        "model": lens.meta,
        "translator": {
            "form": lens.form,
            "rank": lens.rank,
            "hidden": lens.hidden,
            "seed": lens.seed,
            "n_blocks": lens.n_blocks,
            "d_model": lens.d_model,
            "dtype": str(lens.mean.dtype).removeprefix("torch."),
            "parameters": lens.n_parameters,
            "equation": _EQUATIONS[lens.form],
            "stronger_reader": lens.form == "mlp",
            "final_row": "row n_blocks reads x_L with the identity (no translator)",
        },
        "training": lens.training_info,
        "capacity": lens.capacity,
        "report": lens.report,
        "tensors": LENS_TENSORS,
    }
    write_text_atomic(directory / LENS_CONFIG, json.dumps(config, indent=1) + "\n")
    write_text_atomic(directory / LENS_REPORT, report_markdown(lens))
    lens.path = directory
    return directory


def load_lens(directory: Path | str, loaded=None) -> TunedLens:
    """Read a lens saved by :func:`save_lens`; with ``loaded``, refuse a lens
    trained for other weights or another shape of model (:class:`LensMismatchError`).

    Every field of ``lens.json`` is checked (:func:`_lens_config`) and the
    tensors file's header (names, dtypes, shapes, total size against the
    memory available) against it before any tensor is read; the tensors must
    be finite. Anything else is one :class:`LensError` naming the file and the field."""
    from safetensors import safe_open

    directory = Path(directory)
    if not directory.is_dir():
        raise LensError(f"{directory}: not a folder (a tuned lens is a folder with {LENS_CONFIG} and {LENS_TENSORS})")
    cfg_path = directory / LENS_CONFIG
    if not os.path.lexists(cfg_path):
        raise LensError(f"{directory}: no {LENS_CONFIG} (not a tuned-lens folder)")
    config = read_json_file(cfg_path, LensError, max_bytes=MAX_LENS_CONFIG_BYTES)
    try:
        tr, tensors_name = _lens_config(config)
    except ValueError as e:
        raise LensError(f"{cfg_path}: {e}") from None
    with torch.device("meta"):  # the shapes the config implies, nothing allocated
        lens = TunedLens(
            tr["n_blocks"],
            tr["d_model"],
            tr["form"],
            rank=tr.get("rank"),
            hidden=tr.get("hidden"),
            seed=tr.get("seed", 0),
            dtype=LENS_DTYPES[tr.get("dtype", "float32")],
        )
    lens.meta = dict(config.get("model", {}))
    lens.path = directory
    if loaded is not None:  # the model's fingerprint and shape, before the tensors are read
        lens.check_model(loaded)
    tpath = directory / tensors_name
    if not os.path.lexists(tpath):
        raise LensError(f"{directory}: {tpath.name} is missing")
    try:
        # the checked file itself (a FIFO is refused, never waited on by safe_open)
        with checked_path(tpath, LensError) as held, safe_open(held, framework="pt") as f:
            _check_header(f, lens, tpath, tr.get("dtype", "float32"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            meta_fp = (f.metadata() or {}).get("fingerprint", "")
    except LensError:
        raise
    except Exception as e:  # the safetensors parser's own errors: a bad header, a truncated file, mmap
        raise LensError(
            f"{tpath}: unreadable safetensors ({type(e).__name__}: {' '.join(str(e).split())[:160]})"
        ) from None
    bad = [k for k, t in tensors.items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise LensError(f"{tpath}: tensors that are not finite floating-point numbers: {', '.join(sorted(bad)[:4])}")
    lens.load_state_dict(tensors, assign=True)  # the tensors read become the lens's (no second copy)
    if meta_fp and lens.meta.get("fingerprint") != meta_fp:
        raise LensError(f"{directory}: the config and the tensors name different model fingerprints")
    lens.training_info = config.get("training", {})
    lens.capacity = config.get("capacity", {})
    lens.report = config.get("report", {})
    if loaded is not None:
        lens.to(loaded.adapter.device)
    return lens


# ---- what load_lens checks


def _lens_config(config: dict) -> tuple[dict, str]:
    """``(translator entry, tensors file name)`` of a ``lens.json`` document,
    every field the loader reads checked; ValueError naming the first bad one."""
    version = config.get("schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise ValueError(f"schema version {repr(version)[:40]}, this build reads {SCHEMA_VERSION}")
    tr = jf.obj(jf.required(config, "translator"), "translator")
    for key in ("model", "training", "capacity", "report"):
        jf.obj(config.get(key, {}), key)
    form = jf.one_of(jf.required(tr, "form", "translator."), "translator.form", FORMS)
    n = jf.integer(jf.required(tr, "n_blocks", "translator."), "translator.n_blocks", 1, MAX_LENS_BLOCKS)
    d = jf.integer(jf.required(tr, "d_model", "translator."), "translator.d_model", 1, MAX_LENS_WIDTH)
    jf.one_of(tr.get("dtype", "float32"), "translator.dtype", tuple(LENS_DTYPES))
    jf.integer(tr.get("seed", 0), "translator.seed", 0, 2**63 - 1)
    for key, used_by in (("rank", "lowrank"), ("hidden", "mlp")):
        value = tr.get(key)
        if form == used_by and (value is not None or key == "rank"):
            jf.integer(value, f"translator.{key}", 1, d if key == "rank" else MAX_LENS_WIDTH)
        elif form != used_by and value is not None:
            raise ValueError(f'"translator.{key}" must be null for the {form} form, got {jf.json_kind(value)}')
    model = config.get("model", {})
    for key in ("fingerprint", "spec", "dtype"):
        if model.get(key) is not None:
            jf.text(model[key], f"model.{key}")
    names = model.get("block_names")
    if names is not None:
        for i, name in enumerate(jf.array(names, "model.block_names", most=n)):
            jf.text(name, f"model.block_names[{i}]")
    training = config.get("training", {})
    for key in ("config", "data"):
        jf.obj(training.get(key, {}), f"training.{key}")
    positions = training.get("config", {}).get("positions")
    if positions is not None:
        jf.one_of(positions, "training.config.positions", POSITION_SETS)
    jf.obj(config.get("report", {}).get("evaluations", {}), "report.evaluations")
    tensors_name = config.get("tensors", LENS_TENSORS)
    if not isinstance(tensors_name, str) or not tensors_name or Path(tensors_name).name != tensors_name:
        raise ValueError(f'"tensors" must name a file inside the lens folder, got {jf.shown(tensors_name, 60)}')
    return tr, tensors_name


def _check_header(f, lens: TunedLens, tpath: Path, dtype: str) -> None:
    """The tensors file's header (``f``: an open ``safe_open``) against the
    meta-device ``lens`` the config describes: the same names, each of the
    config's dtype and shape, in all no more than the memory available; read
    before any tensor is."""
    want = {k: tuple(v.shape) for k, v in lens.state_dict().items()}
    have = set(f.keys())
    if have != set(want):
        raise LensError(f"{tpath}: tensors {sorted(have)[:8]} do not match a {lens.form} lens ({sorted(want)})")
    total = 0
    for key, shape in want.items():
        stored = f.get_slice(key)
        code, got = stored.get_dtype(), tuple(stored.get_shape())
        if code != _DTYPE_CODES[dtype]:
            raise LensError(f"{tpath}: tensor {key!r} is {code}; {LENS_CONFIG} says {dtype} ({_DTYPE_CODES[dtype]})")
        if got != shape:
            raise LensError(f"{tpath}: tensor {key!r} has shape {list(got)}; {LENS_CONFIG} implies {list(shape)}")
        total += math.prod(shape) * LENS_DTYPES[dtype].itemsize
    available = available_bytes("cpu")
    if total > available:
        raise LensError(f"{tpath}: the lens needs {total:,} bytes of memory and {available:,} are available")


def report_markdown(lens: TunedLens) -> str:
    """A human-readable report: capacity, training, and the KL tables of the evaluations."""
    t, c, m = lens.training_info, lens.capacity, lens.meta
    lines = [
        f"# Tuned lens for {m.get('spec', '?')} (fingerprint {m.get('fingerprint', '?')})",
        "",
        f"Form: **{lens.form}** ({_EQUATIONS[lens.form]})"
        + (f", rank {lens.rank}" if lens.rank else "")
        + (f", hidden {lens.hidden}" if lens.hidden else "")
        + f"; {lens.n_parameters} parameters over {lens.n_blocks} translators"
        + ("; a STRONGER (non-linear) reader" if lens.form == "mlp" else "")
        + ".",
        "",
        f"Data: {json.dumps(t.get('data', {}))}",
        f"Objective: {t.get('objective')}",
        f"Regularisation: {t.get('regularisation')}",
        f"Optimizer: {t.get('optimizer')}",
        f"Steps: {t.get('steps_done')} of {t.get('steps_planned')}; {t.get('seconds')} s on {t.get('threads')} "
        "thread(s), model forwards included.",
        "",
        "Reading: decodability by this reader, not evidence that the model already holds explicit logits. "
        "Row `final` reads x_L (no translator; identity = trained = the model's own distribution).",
        "",
        "## Distance from the identity",
        "",
        "| layer | block | ‖A‖/‖I‖ | σ min | σ max | σ spread | off scaled-orthogonal | ‖b‖/mean‖x‖ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in c.get("layers", []):
        lines.append(
            f"| {r['layer']} | {r['block']} | {r['rel_frobenius']:.4f} | {r['sv_min']:.4f} | {r['sv_max']:.4f} | "
            f"{r['sv_spread']:.4f} | {r['orthogonal_residual_share']:.4f} | "
            + (f"{r['bias_relative']:.4f}" if r.get("bias_relative") is not None else "-")
            + " |"
        )
    for name, ev in lens.report.get("evaluations", {}).items():
        lines += ["", f"## KL(final || lens) in bits: {name}", "", f"Data: {json.dumps(ev.get('data', {}))}", ""]
        for group, table in ev.get("kl_tables", {}).items():
            readers = [k for k in table if k not in ("layer", "block")]
            lines += [f"Positions: **{group}**", "", "| layer | block | " + " | ".join(readers) + " |"]
            lines.append("|---|---|" + "---|" * len(readers))
            for i, layer in enumerate(table["layer"]):
                cells = ["-" if table[r][i] is None else f"{table[r][i]:.4f}" for r in readers]
                lines.append(f"| {layer} | {table['block'][i]} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines) + "\n"
