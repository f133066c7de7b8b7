"""A tuned lens on disk: :func:`save_lens` / :func:`load_lens` of a lens folder
(``lens.safetensors``, ``lens.json``) and its human-readable ``REPORT.md``
(:func:`report_markdown`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from core.atomic import write_bytes_atomic, write_text_atomic
from core.methods.tuned_lens.lens import _EQUATIONS, SCHEMA_VERSION, LensError, TunedLens

LENS_CONFIG = "lens.json"
LENS_TENSORS = "lens.safetensors"
LENS_REPORT = "REPORT.md"


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
    trained for other weights (:class:`LensMismatchError`)."""
    from safetensors import safe_open

    directory = Path(directory)
    cfg_path = directory / LENS_CONFIG
    if not cfg_path.is_file():
        raise LensError(f"{directory}: no {LENS_CONFIG} (not a tuned-lens folder)")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except OSError as e:
        raise LensError(f"{cfg_path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise LensError(f"{cfg_path}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise LensError(f"{cfg_path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(config, dict):
        raise LensError(f"{cfg_path}: expected a JSON object, got {type(config).__name__}")
    if config.get("schema_version") != SCHEMA_VERSION:
        raise LensError(
            f"{cfg_path}: schema version {config.get('schema_version')!r}, this build reads {SCHEMA_VERSION}"
        )
    tr = config.get("translator", {})
    if not isinstance(tr, dict):
        raise LensError(f"{cfg_path}: 'translator' must be an object, got {type(tr).__name__}")
    for key in ("model", "training", "capacity", "report"):
        if not isinstance(config.get(key, {}), dict):
            raise LensError(f"{cfg_path}: '{key}' must be an object, got {type(config[key]).__name__}")
    tensors_name = config.get("tensors", LENS_TENSORS)
    if not isinstance(tensors_name, str) or Path(tensors_name).name != tensors_name:
        raise LensError(f"{cfg_path}: 'tensors' must name a file inside the lens folder, got {tensors_name!r}")
    try:
        dtype = getattr(torch, tr.get("dtype", "float32"))
        lens = TunedLens(
            int(tr["n_blocks"]),
            int(tr["d_model"]),
            tr["form"],
            rank=tr.get("rank"),
            hidden=tr.get("hidden"),
            seed=int(tr.get("seed", 0)),
            dtype=dtype,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise LensError(f"{cfg_path}: incomplete translator entry ({e})") from None
    tpath = directory / tensors_name
    if not tpath.is_file():
        raise LensError(f"{directory}: {tpath.name} is missing")
    try:
        with safe_open(str(tpath), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            meta_fp = (f.metadata() or {}).get("fingerprint", "")
    except Exception as e:
        raise LensError(f"{tpath}: unreadable safetensors ({type(e).__name__})") from None
    bad = [k for k, t in tensors.items() if not t.is_floating_point() or not bool(torch.isfinite(t).all())]
    if bad:
        raise LensError(f"{tpath}: tensors that are not finite floating-point numbers: {', '.join(sorted(bad)[:4])}")
    want = set(lens.state_dict())
    if set(tensors) != want:
        raise LensError(f"{tpath}: tensors {sorted(tensors)} do not match a {tr['form']} lens ({sorted(want)})")
    try:
        lens.load_state_dict(tensors)
    except RuntimeError as e:
        raise LensError(f"{tpath}: tensor shapes do not match the config ({str(e).splitlines()[0]})") from None
    lens.meta = dict(config.get("model", {}))
    if meta_fp and lens.meta.get("fingerprint") != meta_fp:
        raise LensError(f"{directory}: the config and the tensors name different model fingerprints")
    lens.training_info = config.get("training", {})
    lens.capacity = config.get("capacity", {})
    lens.report = config.get("report", {})
    lens.path = directory
    if loaded is not None:
        lens.check_model(loaded)
        lens.to(loaded.adapter.device)
    return lens


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
