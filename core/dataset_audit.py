"""Dataset-scale audits: run read-outs over many image-question pairs.

``vlm-readout audit --model SPEC --dataset DIR_OR_JSONL --methods answer,lens,attention,dla,rollout --out DIR``
runs one capture per batch of samples and, for each sample, the read-outs
that ``analyze`` gives for one (the answer, the logit lens at the answer
position, each head's mass on the visual tokens / the sink / the target
region, the residual stream's largest frozen-scale DLA components, rollout
mass) and, with ``counterfactual``, the answer effect of filling each
sample's target mask (one batched forward of the edited images; the routing
mass of the same region sits beside it). Methods are pluggable: an
:class:`AuditMethod` subclass given to :func:`register_method`; an unknown
name is a one-line error. The run writes to ``DIR``:

* ``samples.csv`` (one flat row per sample) and ``samples.jsonl`` (one JSON
  object per sample, every number the read-outs gave); long tables
  ``heads.csv`` (attention), ``lens.csv`` (lens), ``components.csv``
  (DLA top components); ``samples.parquet`` too when pyarrow is importable;
* ``summary.json`` / ``summary.md``: distributions (quantiles, histograms)
  over the samples the model got right, got wrong, and all of them; error
  counts;
* ``audit.csv`` / ``audit.md`` / ``audit.json``: one audit row per method,
  with this run's parameters (docs/METHODS.md §4.13);
* ``run.json``: how the run went (processes, device, time, completed or
  cancelled). It is the only file that differs between a one-process run
  and a sharded one.

Every file is written atomically (temporary file, then ``os.replace``). The
first Ctrl-C stops the run after the current batch and writes what is done
(``summary.json``: ``cancelled``; ``run.json``: ``complete: false``; exit 130);
a second one aborts.

Dataset: a JSONL file, or a folder holding ``dataset.jsonl`` (as
:mod:`core.zoo.dataset` writes it) or exactly one ``*.jsonl``. Each line is
``{"image": PATH, "question": TEXT}`` plus optional ``answer``, ``foil``,
``kind``, ``template``, ``target_mask`` (a PNG, white = the region; same size
as the image) and ``id``. Relative paths are relative to the JSONL file.
A sample whose image or mask cannot be read, or whose question or answer does
not fit the model, becomes an error row (``status = "error"``) and the run
goes on; the summary counts the errors.

Target: the lens, DLA and answer numbers track the dataset's ``answer``
(minus its ``foil`` where given); without an answer, the model's own top
token. ``correct`` is whether the model's top token is the dataset's answer.

Scaling out: ``--device auto`` loads one model across the GPUs with
``device_map="auto"`` (Hugging Face families; needs the ``accelerate``
package), in one process (refused under a launcher). Launched by ``torchrun`` or
``accelerate launch`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set), the same
command shards the work: the samples are cut into consecutive batches of
``--batch-size`` and process ``rank`` takes batches ``k`` with
``k % world_size == rank`` (with batch size 1: samples ``i % world == rank``),
so every batch is the one a single process would run. Rank 0 gathers the
records (``gather_object``) and writes the outputs a single process would
write, in the same sample order. Backend: NCCL when the model runs on CUDA
(``--device cuda``: rank r takes ``cuda:LOCAL_RANK``), gloo on CPU. With the
same batch size, device type and thread settings the merged files are
byte-identical to a one-process run.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib
import importlib.util
import io
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.audit import AuditRecord
from core.errors import ImageLoadError, InputFileError, QuestionError, ReadoutError

if TYPE_CHECKING:
    import torch

SCHEMA_VERSION = 1
DEFAULT_METHODS = ("answer", "lens", "attention", "dla", "rollout")


class DatasetError(InputFileError):
    """The dataset file or folder cannot be read (a bad line is an
    :class:`core.errors.InputFileError` naming the file, the line and the field)."""


# ---------------------------------------------------------------- dataset


@dataclass
class DatasetItem:
    """One image-question pair of an audit dataset.

    Attributes:
        index: 0-based line number among the dataset's samples (the order of
            every output).
        image: the image path as the dataset wrote it; ``image_path`` resolved.
        target_mask: resolved path of the region mask, or None.
    """

    index: int
    id: str | None
    image: str
    image_path: Path
    question: str
    answer: str | None = None
    foil: str | None = None
    kind: str | None = None
    template: str | None = None
    target_mask: Path | None = None


def dataset_file(path: str | Path) -> Path:
    """The JSONL file of a dataset given as a file or a folder."""
    p = Path(path)
    if p.is_dir():
        if (p / "dataset.jsonl").is_file():
            return p / "dataset.jsonl"
        found = sorted(p.glob("*.jsonl"))
        if len(found) != 1:
            raise DatasetError(f"{p}: expected dataset.jsonl or exactly one *.jsonl, found {len(found)}")
        return found[0]
    if not p.is_file():
        raise DatasetError(f"{p}: no such dataset file or folder")
    return p


def _opt(row: dict, key: str) -> str | None:
    """A free-text label (id, kind, template): any JSON scalar, as text."""
    v = row.get(key)
    return None if v is None else str(v)


def read_dataset(path: str | Path, limit: int | None = None) -> list[DatasetItem]:
    """Read a dataset JSONL (see the module docstring); ``limit``: the first N
    samples (later lines are not checked). Lines are read by
    :func:`core.pairs.read_jsonl` and their fields checked by
    :func:`core.pairs.text_field`, as every pairs file is."""
    from core.pairs import read_jsonl, resolve_beside, text_field

    f = dataset_file(path)
    items: list[DatasetItem] = []
    for n, row in read_jsonl(f, "dataset file"):
        if limit is not None and len(items) >= limit:
            break
        where = f"{f}:{n}"
        image = text_field(row, "image", where)
        question = text_field(row, "question", where)
        answer = text_field(row, "answer", where, required=False)
        foil = text_field(row, "foil", where, required=False)
        mask = text_field(row, "target_mask", where, required=False)
        items.append(
            DatasetItem(
                len(items),
                _opt(row, "id"),
                image,
                resolve_beside(f, image),
                question,
                answer,
                foil,
                _opt(row, "kind"),
                _opt(row, "template"),
                resolve_beside(f, mask) if mask else None,
            )
        )
    if not items:
        raise DatasetError(f"{f}: no samples")
    return items


def load_mask(path: Path, size: tuple[int, int]) -> np.ndarray:
    """A region mask PNG -> ``(H, W)`` bool: white (luminance >= 128, and
    alpha >= 128 where the PNG has alpha) is inside, as
    ``core.methods.counterfactual.mask_from_png`` reads it; it must have the
    image's ``size = (width, height)``. An empty mask is allowed (its region
    mass is 0; a counterfactual skips it)."""
    from core.images import load_mask as read_mask_file

    mask = read_mask_file(path)
    if (mask.shape[1], mask.shape[0]) != tuple(size):
        raise ImageLoadError(
            f"{path}: mask is {mask.shape[1]}x{mask.shape[0]}, the image is {size[0]}x{size[1]}; they must match"
        )
    return mask


def token_cover(tokens, mask: np.ndarray) -> np.ndarray:
    """``(n_tokens,)``: the share of each visual token's box (its in-image
    part, pixels as :func:`core.geometry.region_tokens` counts them) that
    ``mask`` covers; 0 for tokens without a patch (newline, CLS)."""
    h, w = mask.shape
    out = np.zeros(len(tokens))
    for i, t in enumerate(tokens):
        if t.col < 0:
            continue
        x0, y0, x1, y1 = t.box
        xa, ya = max(0, int(np.floor(x0))), max(0, int(np.floor(y0)))
        xb, yb = min(w, int(np.ceil(x1))), min(h, int(np.ceil(y1)))
        if xb > xa and yb > ya:
            out[i] = float(mask[ya:yb, xa:xb].mean())
    return out


# ---------------------------------------------------------------- per-sample context


@dataclass
class AuditOptions:
    """What every method of one run is run with."""

    rollout_alpha: float = 0.5
    region_min_cover: float = 0.25
    dla_top_k: int = 10
    lens_top_k: int = 1
    answer_top_k: int = 5
    counterfactual_fill: str = "mean"


@dataclass
class SampleContext:
    """One sample inside a batch, as the methods see it.

    Attributes:
        trace: the batch's :class:`core.capture.Trace` (None when no method
            needs one); ``batch`` is this sample's row in it.
        query_index: where the answer position sits in ``trace.query_positions``.
        logits: ``(vocab,)`` float32 logits at the answer position.
        tokens: the visual tokens (:class:`core.geometry.VisualToken`).
        cover: ``(n_tokens,)`` share of each token's box inside the target
            mask (None without a mask); ``region``: the token indices
            :func:`core.geometry.region_tokens` keeps.
    """

    loaded: Any
    item: DatasetItem
    image: Any
    mask: np.ndarray | None
    trace: Any
    batch: int
    query_index: int | None
    full_patterns: bool
    logits: torch.Tensor
    answer_id: int
    foil_id: int | None
    predicted_id: int
    options: AuditOptions
    tokens: list = field(default_factory=list)
    cover: np.ndarray | None = None
    region: list[int] | None = None


# ---------------------------------------------------------------- methods


def _dist(values, value_range=None) -> dict | None:
    """:class:`core.methods.patterns.Distribution` of the non-missing values, as a dict (None if none)."""
    from core.methods.patterns import Distribution

    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    return Distribution.of(v, value_range=value_range).to_dict() if v else None


class AuditMethod:
    """One read-out of the audit. Subclass it and :func:`register_method` it.

    Attributes:
        name: the ``--methods`` name.
        audit_method: its row of :data:`core.audit.METHOD_TABLE`.
        patterns: which attention rows the capture must keep: "none",
            "answer" (the answer position) or "full" (every query row).
        needs_capture: whether it reads a Trace (else logits suffice).
    """

    name = ""
    audit_method = ""
    patterns = "none"
    needs_capture = True
    batched = False  # True: run_batch handles a whole batch at once
    long_table: tuple[str, list[str]] | None = None  # (file name, columns)

    def available(self) -> str | None:
        """None when usable, else why not (one line)."""
        return None

    def run(self, ctx: SampleContext) -> tuple[dict, AuditRecord | None]:
        """The sample's section of the record (JSON-ready) and the method's own audit row."""
        raise NotImplementedError

    def run_batch(self, contexts: list[SampleContext]) -> list[tuple[dict, AuditRecord | None]]:
        """Every sample of a batch at once (for methods that run forwards of
        their own); a :class:`ReadoutError` here reruns the samples one by one."""
        return [self.run(c) for c in contexts]

    def csv_columns(self) -> list[str]:
        return []

    def csv_values(self, section: dict) -> dict:
        return {}

    def long_rows(self, index: int, section: dict) -> list[dict]:
        return []

    def summarize(self, sections: list[dict]) -> dict:
        return {}

    def controls(self) -> list[str]:
        return []

    def parameters(self, options: AuditOptions) -> dict:
        return {}

    def notes(self) -> list[str]:
        return []


class AnswerReadout(AuditMethod):
    name = "answer"
    audit_method = "model output"
    needs_capture = False

    def run(self, ctx):
        probs = ctx.logits.softmax(-1)
        adapter = ctx.loaded.adapter
        a, f = ctx.answer_id, ctx.foil_id
        values, ids = probs.topk(min(ctx.options.answer_top_k, probs.shape[-1]))
        section = {
            "predicted_prob": float(probs[ctx.predicted_id]),
            "answer_id": a,
            "foil_id": f,
            "answer_logit": float(ctx.logits[a]),
            "answer_prob": float(probs[a]),
            "logit_diff": float(ctx.logits[a] - ctx.logits[f]) if f is not None else None,
            "top": [[adapter.token_str(int(i)), float(p)] for p, i in zip(values, ids)],
        }
        return section, None

    def csv_columns(self):
        return ["predicted_prob", "answer_prob", "answer_logit", "logit_diff"]

    def csv_values(self, s):
        return {k: s[k] for k in self.csv_columns()}

    def summarize(self, sections):
        return {
            "answer_prob": _dist([s["answer_prob"] for s in sections], (0.0, 1.0)),
            "predicted_prob": _dist([s["predicted_prob"] for s in sections], (0.0, 1.0)),
            "answer_logit": _dist([s["answer_logit"] for s in sections]),
            "logit_diff": _dist([s["logit_diff"] for s in sections]),
        }

    def controls(self):
        return ["dataset answer and foil as the target", "correct = top token equals the dataset answer"]

    def parameters(self, options):
        return {"top_k": options.answer_top_k}

    def notes(self):
        return ["accuracy and margins describe behaviour on this sample set; they name no internal route"]


class LensReadout(AuditMethod):
    name = "lens"
    audit_method = "logit lens"
    long_table = ("lens.csv", ["index", "layer", "answer_rank", "answer_logit", "logit_diff", "kl_to_final", "top1"])

    def run(self, ctx):
        from core.methods.logit_lens import logit_lens

        lens = logit_lens(
            ctx.loaded.adapter, ctx.trace, ctx.answer_id, ctx.foil_id, top_k=ctx.options.lens_top_k, batch=ctx.batch
        )
        rows = [
            {
                "layer": r.layer,
                "answer_rank": r.answer_rank,
                "answer_logit": r.answer_logit,
                "logit_diff": r.logit_diff,
                "kl_to_final": r.kl_to_final,
                "top1": r.top[0][0],
            }
            for r in lens.rows
        ]
        top1_from = None  # first layer from which the answer stays the lens's top token
        for r in reversed(rows):
            if r["answer_rank"] != 0:
                break
            top1_from = r["layer"]
        return {"position": lens.position, "top1_from_layer": top1_from, "rows": rows}, lens.audit

    def csv_columns(self):
        return ["lens_top1_from_layer"]

    def csv_values(self, s):
        return {"lens_top1_from_layer": s["top1_from_layer"]}

    def long_rows(self, index, s):
        return [{"index": index, **r} for r in s["rows"]]

    def summarize(self, sections):
        if not sections:
            return {"layers": []}
        layers = list(zip(*[s["rows"] for s in sections]))
        return {
            "layers": [
                {
                    "layer": rows[0]["layer"],
                    "answer_rank": _dist([r["answer_rank"] for r in rows]),
                    "logit_diff": _dist([r["logit_diff"] for r in rows]),
                    "answer_logit": _dist([r["answer_logit"] for r in rows]),
                    "kl_to_final": _dist([r["kl_to_final"] for r in rows]),
                    "top1_rate": sum(r["answer_rank"] == 0 for r in rows) / len(rows),
                }
                for rows in layers
            ],
            "top1_from_layer": _dist([s["top1_from_layer"] for s in sections]),
        }

    def controls(self):
        return ["success/failure samples compared"]

    def parameters(self, options):
        return {"position": "answer position", "top_k": options.lens_top_k}


class AttentionReadout(AuditMethod):
    name = "attention"
    audit_method = "pattern analysis"
    patterns = "answer"
    long_table = (
        "heads.csv",
        [
            "index",
            "block",
            "head",
            "name",
            "visual_mass",
            "sink_mass",
            "entropy",
            "argmax_source",
            "region_mass",
            "region_hit",
        ],
    )

    def run(self, ctx):
        import torch

        from core.methods.patterns import summarize_heads

        tr, b = ctx.trace, ctx.batch
        summary = summarize_heads(ctx.loaded.adapter, tr, ctx.tokens, query_index=ctx.query_index, batch=b)
        patches = [i for i, t in enumerate(ctx.tokens) if t.col >= 0]
        region = set(ctx.region or ())
        vis_by_block = {}
        for block in sorted(tr.patterns):
            pat = tr.patterns[block][b, :, ctx.query_index].double()  # (heads, keys)
            if tr.block_kinds[block] == "cross":
                vis_by_block[block] = pat
            elif tr.visual_positions.shape[1]:
                vis_by_block[block] = pat[:, tr.visual_positions[b]]
            else:
                vis_by_block[block] = None  # a text-only block: no visual key
        cover = torch.as_tensor(ctx.cover) if ctx.cover is not None else None
        heads = []
        for h in summary.heads:
            vis = vis_by_block[h.layer]
            region_mass = region_hit = None
            if vis is not None and cover is not None:
                region_mass = float(vis[h.head].cpu() @ cover)
                if patches:
                    best = patches[int(vis[h.head, patches].argmax())]
                    region_hit = best in region
            heads.append(
                {
                    "block": h.layer,
                    "head": h.head,
                    "name": f"{h.block}.H{h.head}",
                    "visual_mass": h.visual_mass,
                    "sink_mass": h.bos_mass,
                    "other_mass": h.other_mass,
                    "entropy": h.entropy,
                    "argmax_source": h.argmax_source,
                    "has_visual_keys": vis is not None,
                    "region_mass": region_mass,
                    "region_hit": region_hit,
                }
            )
        return {"query_position": summary.query_position, "heads": heads}, summary.audit

    def csv_columns(self):
        return [
            "attn_max_visual_mass",
            "attn_max_visual_head",
            "attn_mean_visual_mass",
            "attn_mean_sink_mass",
            "attn_max_region_mass",
            "attn_max_region_head",
        ]

    def csv_values(self, s):
        vis = [h for h in s["heads"] if h["has_visual_keys"]]
        reg = [h for h in vis if h["region_mass"] is not None]
        top = max(vis, key=lambda h: h["visual_mass"]) if vis else None
        top_r = max(reg, key=lambda h: h["region_mass"]) if reg else None
        return {
            "attn_max_visual_mass": top["visual_mass"] if top else None,
            "attn_max_visual_head": top["name"] if top else None,
            "attn_mean_visual_mass": sum(h["visual_mass"] for h in vis) / len(vis) if vis else None,
            "attn_mean_sink_mass": sum(h["sink_mass"] for h in s["heads"]) / len(s["heads"]),
            "attn_max_region_mass": top_r["region_mass"] if top_r else None,
            "attn_max_region_head": top_r["name"] if top_r else None,
        }

    def long_rows(self, index, s):
        cols = self.long_table[1][1:]
        return [{"index": index, **{k: h[k] for k in cols}} for h in s["heads"]]

    def summarize(self, sections):
        if not sections:
            return {"heads": []}
        per_head = list(zip(*[s["heads"] for s in sections]))
        out = []
        for rows in per_head:
            hits = [r["region_hit"] for r in rows if r["region_hit"] is not None]
            out.append(
                {
                    "block": rows[0]["block"],
                    "head": rows[0]["head"],
                    "name": rows[0]["name"],
                    "has_visual_keys": rows[0]["has_visual_keys"],
                    "visual_mass": _dist([r["visual_mass"] for r in rows], (0.0, 1.0)),
                    "sink_mass": _dist([r["sink_mass"] for r in rows], (0.0, 1.0)),
                    "entropy": _dist([r["entropy"] for r in rows]),
                    "region_mass": _dist([r["region_mass"] for r in rows], (0.0, 1.0)),
                    "region_hit_rate": sum(hits) / len(hits) if hits else None,
                    "n_region_samples": len(hits),
                }
            )
        return {"heads": out}

    def controls(self):
        return ["region mass weighted by each token's overlap with the target mask"]

    def parameters(self, options):
        return {"query": "answer position", "region_min_cover": options.region_min_cover}

    def notes(self):
        return [
            "per-head patch grids are left out at dataset scale; run analyze on a sample for them",
            "the region hit rate's chance level is the region's share of patch tokens (summary: region_token_share)",
        ]


class DlaReadout(AuditMethod):
    name = "dla"
    audit_method = "residual DLA"
    long_table = ("components.csv", ["index", "rank", "name", "norm", "projection", "dla_frozen", "dla_jacobian"])
    CSV_TOP = 3

    def run(self, ctx):
        from core.methods.residual import decompose

        res = decompose(ctx.loaded.adapter, ctx.trace, ctx.answer_id, ctx.foil_id, batch=ctx.batch)
        order = sorted(range(len(res.components)), key=lambda i: (-abs(res.components[i].dla_frozen), i))
        top = [res.components[i].to_dict() for i in order[: ctx.options.dla_top_k]]
        return {
            "position": res.position,
            "reconstruction_max_abs_err": res.reconstruction_max_abs_err,
            "target_logit": res.target_logit,
            "frozen_sum_expected": res.frozen_sum_expected,
            "top": top,
            "dla_frozen": {c.name: c.dla_frozen for c in res.components},
        }, res.audit

    def csv_columns(self):
        cols = []
        for k in range(1, self.CSV_TOP + 1):
            cols += [f"dla_top{k}_name", f"dla_top{k}_frozen"]
        return [*cols, "dla_reconstruction_err"]

    def csv_values(self, s):
        out = {}
        for k in range(1, self.CSV_TOP + 1):
            c = s["top"][k - 1] if len(s["top"]) >= k else None
            out[f"dla_top{k}_name"] = c["name"] if c else None
            out[f"dla_top{k}_frozen"] = c["dla_frozen"] if c else None
        out["dla_reconstruction_err"] = s["reconstruction_max_abs_err"]
        return out

    def long_rows(self, index, s):
        return [{"index": index, "rank": r, **c} for r, c in enumerate(s["top"])]

    def summarize(self, sections):
        if not sections:
            return {"components": []}
        names = list(sections[0]["dla_frozen"])
        return {
            "reconstruction_max_abs_err": max(s["reconstruction_max_abs_err"] for s in sections),
            "components": [{"name": n, "dla_frozen": _dist([s["dla_frozen"].get(n) for s in sections])} for n in names],
        }

    def parameters(self, options):
        return {"position": "answer position", "top_k_written": options.dla_top_k}


class RolloutReadout(AuditMethod):
    name = "rollout"
    audit_method = "rollout / flow"
    patterns = "full"

    def run(self, ctx):
        import torch

        from core.methods.patterns import FULL_PATTERN_LIMIT, rollout, rollout_audit

        alpha = ctx.options.rollout_alpha
        if not ctx.full_patterns:
            return {"alpha": alpha, "skipped": f"prompt longer than {FULL_PATTERN_LIMIT} tokens"}, None
        tr, b = ctx.trace, ctx.batch
        # this sample's patterns on the CPU (rollout builds its identity matrices there)
        one = dataclasses.replace(
            tr,
            input_ids=tr.input_ids[b : b + 1].cpu(),
            answer_positions=tr.answer_positions[b : b + 1].cpu(),
            visual_positions=tr.visual_positions[b : b + 1].cpu(),
            patterns={k: v[b : b + 1].cpu() for k, v in tr.patterns.items()},
            query_positions=tr.query_positions.cpu(),
        )
        r = rollout(one, alpha, batch=0)[int(one.answer_positions[0])].double()
        n = one.input_ids.shape[1]
        vis_idx = one.visual_positions[0] if one.visual_positions.shape[1] else torch.arange(n, r.shape[0])
        vis = r[vis_idx].cpu()
        patches = [i for i, t in enumerate(ctx.tokens) if t.col >= 0]
        best = patches[int(vis[patches].argmax())] if patches else None
        section = {
            "alpha": alpha,
            "skipped": None,
            "visual_mass": float(vis.sum()),
            "region_mass": float(vis @ torch.as_tensor(ctx.cover)) if ctx.cover is not None else None,
            "argmax_patch": [ctx.tokens[best].row, ctx.tokens[best].col] if best is not None else None,
        }
        return section, rollout_audit(alpha, "mean")

    def csv_columns(self):
        return ["rollout_visual_mass", "rollout_region_mass"]

    def csv_values(self, s):
        return {"rollout_visual_mass": s.get("visual_mass"), "rollout_region_mass": s.get("region_mass")}

    def summarize(self, sections):
        return {
            "n_skipped": sum(1 for s in sections if s.get("skipped")),
            "visual_mass": _dist([s.get("visual_mass") for s in sections], (0.0, 1.0)),
            "region_mass": _dist([s.get("region_mass") for s in sections], (0.0, 1.0)),
        }

    def controls(self):
        return ["head-mean patterns", "answer-position row"]

    def parameters(self, options):
        from core.methods.patterns import FULL_PATTERN_LIMIT  # one limit for analyze and the audit

        return {"alpha": options.rollout_alpha, "heads": "mean", "full_pattern_limit": FULL_PATTERN_LIMIT}


class CounterfactualReadout(AuditMethod):
    """Fill each sample's target mask and re-run the model (one batched
    forward of the edited images); the answer effect beside the routing
    read-outs of the same region (attention / rollout region mass)."""

    name = "counterfactual"
    audit_method = "region counterfactual"
    needs_capture = False
    batched = True

    def available(self):
        try:
            cf = importlib.import_module("core.methods.counterfactual")
        except ImportError as e:
            return f"core.methods.counterfactual cannot be imported ({e})"
        missing = [n for n in ("as_fill", "answer_numbers", "answer_effect") if not hasattr(cf, n)]
        return f"core.methods.counterfactual lacks {', '.join(missing)}" if missing else None

    def run_batch(self, contexts):
        import torch

        from core.errors import oom_guard
        from core.methods import counterfactual as cf

        if not contexts:
            return []
        fill = cf.as_fill(contexts[0].options.counterfactual_fill)
        adapter = contexts[0].loaded.adapter
        todo = [c for c in contexts if c.mask is not None and c.mask.any()]
        edited_logits = {}
        if todo:
            edited = [fill.apply(c.image, c.mask) for c in todo]
            with oom_guard(f"running a batch of {len(todo)} edited images"), torch.no_grad():
                inputs = adapter.prepare(edited, [c.item.question for c in todo])
                out = adapter.next_token_logits(inputs).float().cpu()
            edited_logits = {id(c): out[k] for k, c in enumerate(todo)}
        results = []
        for c in contexts:
            if id(c) not in edited_logits:
                why = "no target mask" if c.mask is None else "the target mask is empty"
                results.append(({"fill": fill.kind, "skipped": why}, None))
                continue
            original = cf.answer_numbers(adapter, c.logits, c.answer_id, c.foil_id)
            after = cf.answer_numbers(adapter, edited_logits[id(c)], c.answer_id, c.foil_id)
            effect = cf.answer_effect(original, after)
            section = {
                "fill": fill.kind,
                "skipped": None,
                "mask_area_px": int(c.mask.sum()),
                "original": original.to_dict(),
                "edited": after.to_dict(),
                "effect": {**effect.to_dict(), "drop": effect.drop},
            }
            audit = (
                cf.counterfactual_audit(fill, {"region": "target_mask"})
                if hasattr(cf, "counterfactual_audit")
                else None
            )
            results.append((section, audit))
        return results

    def csv_columns(self):
        return ["cf_drop", "cf_logit_diff_change", "cf_prob_change", "cf_flipped"]

    def csv_values(self, s):
        e = s.get("effect") or {}
        return {
            "cf_drop": e.get("drop"),
            "cf_logit_diff_change": e.get("logit_diff_change"),
            "cf_prob_change": e.get("prob_change"),
            "cf_flipped": e.get("flipped"),
        }

    def summarize(self, sections):
        done = [s for s in sections if not s.get("skipped")]
        return {
            "n_skipped": len(sections) - len(done),
            "drop": _dist([s["effect"]["drop"] for s in done]),
            "logit_diff_change": _dist([s["effect"]["logit_diff_change"] for s in done]),
            "prob_change": _dist([s["effect"]["prob_change"] for s in done]),
            "flip_rate": sum(s["effect"]["flipped"] for s in done) / len(done) if done else None,
            "share_drop_positive": sum(s["effect"]["drop"] > 0 for s in done) / len(done) if done else None,
        }

    def controls(self):
        return ["the same fill for every sample", "original and edited numbers side by side"]

    def parameters(self, options):
        return {"region": "each sample's target_mask", "fill": options.counterfactual_fill}

    def notes(self):
        return [
            "the routing read-outs of the same region (attention / rollout region mass) sit beside the effect; "
            "summary.routing_vs_effect says how well they rank the effect across samples",
        ]


METHODS: dict[str, AuditMethod] = {}


def register_method(method: AuditMethod) -> None:
    """Make ``method`` available to ``--methods`` under ``method.name``."""
    METHODS[method.name] = method


for _m in (AnswerReadout(), LensReadout(), AttentionReadout(), DlaReadout(), RolloutReadout(), CounterfactualReadout()):
    register_method(_m)


def parse_methods(spec: str | Sequence[str]) -> list[AuditMethod]:
    """``"answer,lens"`` -> the registered methods, in the given order; an
    unknown or unavailable name is a one-line :class:`ReadoutError`."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not names:
        raise ReadoutError(f"no methods given; available: {', '.join(METHODS)}")
    out = []
    for n in names:
        if n not in METHODS:
            raise ReadoutError(f"unknown method {n!r}; available: {', '.join(METHODS)}")
        why = METHODS[n].available()
        if why:
            raise ReadoutError(f"method {n!r} is not available: {why}")
        if METHODS[n] not in out:
            out.append(METHODS[n])
    return out


# ---------------------------------------------------------------- running


def _base_record(item: DatasetItem) -> dict:
    return {
        "index": item.index,
        "id": item.id,
        "image": item.image,
        "question": item.question,
        "answer": item.answer,
        "foil": item.foil,
        "kind": item.kind,
        "template": item.template,
        "status": "ok",
        "error": None,
        "predicted": None,
        "correct": None,
        "region": None,
        "readouts": {},
    }


def _error_record(item: DatasetItem, err: Exception) -> dict:
    rec = _base_record(item)
    rec["status"] = "error"
    rec["error"] = str(err)
    return rec


@dataclass
class _Prepared:
    item: DatasetItem
    image: Any
    mask: np.ndarray | None
    answer_id: int | None
    foil_id: int | None


def _prepare_item(loaded, item: DatasetItem) -> _Prepared:
    from core.images import load_image

    adapter = loaded.adapter
    image = load_image(item.image_path)
    mask = load_mask(item.target_mask, image.size) if item.target_mask is not None else None
    adapter.check_question(item.question)
    a = adapter.token_id(item.answer) if item.answer is not None else None
    f = adapter.token_id(item.foil) if item.foil is not None else None
    if f is not None and f == a:
        raise QuestionError(f"the foil {item.foil!r} is the same token as the answer")
    return _Prepared(item, image, mask, a, f)


def _run_batch(loaded, batch: list[_Prepared], methods: list[AuditMethod], options: AuditOptions):
    """One forward (or capture) for the batch, then every method.
    Returns ``[(record, {method: audit dict})]`` in batch order. A
    :class:`ReadoutError` of one sample's method makes that sample an error
    row; one from a batched method (or the forward) propagates."""
    import torch

    from core.capture import capture
    from core.errors import oom_guard
    from core.geometry import region_tokens
    from core.methods.patterns import FULL_PATTERN_LIMIT

    adapter = loaded.adapter
    inputs = adapter.prepare([p.image for p in batch], [p.item.question for p in batch])
    answer_pos = [int(x) for x in inputs.answer_positions.tolist()]
    n_tokens = inputs.input_ids.shape[1]
    want = {m.patterns for m in methods}
    full = "full" in want and n_tokens <= FULL_PATTERN_LIMIT
    trace = None
    if any(m.needs_capture for m in methods):
        qpos = list(range(n_tokens)) if full else sorted(set(answer_pos))
        layers = None if (want & {"answer", "full"}) else []
        trace = capture(loaded, None, "", inputs=inputs, query_positions=qpos, pattern_layers=layers)
        logits = trace.logits[torch.arange(len(batch)), torch.as_tensor(answer_pos)].float().cpu()
    else:
        with oom_guard(f"running a batch of {len(batch)}"), torch.no_grad():
            logits = adapter.next_token_logits(inputs).float().cpu()
    records: list[dict] = []
    audits: list[dict] = []
    contexts: list[SampleContext | None] = []
    token_cache: dict[tuple, list] = {}
    for b, p in enumerate(batch):
        rec = _base_record(p.item)
        ctx = None
        try:
            row = logits[b]
            predicted = int(row.argmax())
            rec["predicted"] = adapter.token_str(predicted)
            rec["correct"] = (predicted == p.answer_id) if p.answer_id is not None else None
            tokens: list = []
            if trace is not None:
                vpos = tuple(trace.visual_positions[b].tolist())
                key = (tuple(p.image.size), vpos)
                if key not in token_cache:
                    token_cache[key] = adapter.visual_tokens(p.image.size, list(vpos))
                tokens = token_cache[key]
            cover = region = None
            if p.mask is not None:
                rec["region"] = {"area_px": int(p.mask.sum()), "n_tokens": None, "token_share": None}
                if tokens:
                    cover = token_cover(tokens, p.mask)
                    region = region_tokens(tokens, p.mask, options.region_min_cover)
                    n_patch = sum(1 for t in tokens if t.col >= 0)
                    rec["region"]["n_tokens"] = len(region)
                    rec["region"]["token_share"] = len(region) / n_patch if n_patch else None
            if trace is None:
                query_index = None
            else:
                query_index = answer_pos[b] if full else trace.query_positions.tolist().index(answer_pos[b])
            ctx = SampleContext(
                loaded,
                p.item,
                p.image,
                p.mask,
                trace,
                b,
                query_index,
                full,
                row,
                p.answer_id if p.answer_id is not None else predicted,
                p.foil_id,
                predicted,
                options,
                tokens,
                cover,
                region,
            )
        except ReadoutError as e:
            rec = _error_record(p.item, e)
        records.append(rec)
        audits.append({})
        contexts.append(ctx)
    for m in methods:
        live = [b for b in range(len(batch)) if records[b]["status"] == "ok"]
        if not live:
            break
        if m.batched:
            results = m.run_batch([contexts[b] for b in live])
        else:
            results = []
            for b in live:
                try:
                    results.append(m.run(contexts[b]))
                except ReadoutError as e:
                    records[b] = _error_record(batch[b].item, e)
                    audits[b] = {}
                    results.append(None)
        for b, res in zip(live, results):
            if res is None:
                continue
            section, audit = res
            records[b]["readouts"][m.name] = section
            if audit is not None:
                audits[b][m.name] = audit.to_dict()
    return list(zip(records, audits))


def _run_chunk(loaded, chunk: list[DatasetItem], methods, options) -> list[tuple[dict, dict]]:
    """Records for one batch of dataset items; unreadable samples become error rows."""
    results: dict[int, tuple[dict, dict]] = {}
    ready: list[_Prepared] = []
    for item in chunk:
        try:
            ready.append(_prepare_item(loaded, item))
        except ReadoutError as e:
            results[item.index] = (_error_record(item, e), {})
    if ready:
        try:
            for rec, audits in _run_batch(loaded, ready, methods, options):
                results[rec["index"]] = (rec, audits)
        except ReadoutError as e:
            if len(ready) == 1:
                results[ready[0].item.index] = (_error_record(ready[0].item, e), {})
            else:  # one sample broke the batch (too long, out of memory): run each alone
                for p in ready:
                    try:
                        results[p.item.index] = _run_batch(loaded, [p], methods, options)[0]
                    except ReadoutError as e1:
                        results[p.item.index] = (_error_record(p.item, e1), {})
    return [results[item.index] for item in chunk]


def shard_chunks(n_items: int, batch_size: int, rank: int, world: int) -> list[range]:
    """The batches (index ranges) process ``rank`` of ``world`` runs: the
    consecutive batches of ``batch_size`` with ``k % world == rank``."""
    chunks = [range(s, min(n_items, s + batch_size)) for s in range(0, n_items, batch_size)]
    return [c for k, c in enumerate(chunks) if k % world == rank]


@dataclass
class ShardResult:
    """What one process computed: records in index order, the method audit
    rows of its first successful sample, and whether it stopped early."""

    records: list[dict]
    first_audits: dict[str, dict] | None
    first_index: int | None
    cancelled: bool


def run_shard(
    loaded,
    items: list[DatasetItem],
    methods: list[AuditMethod],
    options: AuditOptions | None = None,
    *,
    batch_size: int = 8,
    rank: int = 0,
    world: int = 1,
    progress: Callable[[int, int, str], None] | None = None,
    cancel: Callable[[], bool] | None = None,
) -> ShardResult:
    """Run the audit on this process's share of ``items``.

    Args:
        progress: ``progress(done, total, message)`` after each batch (this shard's counts).
        cancel: polled between batches; True stops early, keeping what is done.
    """
    options = options or AuditOptions()
    if batch_size < 1:
        raise ReadoutError("--batch-size must be at least 1")
    mine = shard_chunks(len(items), batch_size, rank, world)
    total = sum(len(c) for c in mine)
    records: list[dict] = []
    first_audits = None
    first_index = None
    done = 0
    cancelled = False
    for c in mine:
        if cancel is not None and cancel():
            cancelled = True
            break
        for rec, audits in _run_chunk(loaded, [items[i] for i in c], methods, options):
            records.append(rec)
            if first_audits is None and rec["status"] == "ok":
                first_audits, first_index = audits, rec["index"]
        done += len(c)
        if progress is not None:
            progress(done, total, "auditing")
    return ShardResult(records, first_audits, first_index, cancelled)


def merge_shards(shards: list[ShardResult]) -> ShardResult:
    """Rank 0's merge: records placed by their dataset index (the order of a
    one-process run), the audit rows of the lowest-index successful sample."""
    records = [r for s in shards for r in s.records]
    by_index = {r["index"]: r for r in records}
    ordered = [by_index[i] for i in sorted(by_index)]
    firsts = [(s.first_index, s.first_audits) for s in shards if s.first_index is not None]
    first_index, first_audits = min(firsts, key=lambda x: x[0]) if firsts else (None, None)
    return ShardResult(ordered, first_audits, first_index, any(s.cancelled for s in shards))


# ---------------------------------------------------------------- outputs


def _clean(x):
    """JSON-ready: non-finite floats become None (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ""
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


def csv_text(columns: list[str], rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow([_cell(r.get(c)) for c in columns])
    return buf.getvalue()


BASE_COLUMNS = [
    "index",
    "id",
    "image",
    "question",
    "answer",
    "foil",
    "kind",
    "template",
    "status",
    "error",
    "predicted",
    "correct",
    "region_area_px",
    "region_n_tokens",
]


def sample_rows(records: list[dict], methods: list[AuditMethod]) -> tuple[list[str], list[dict]]:
    """The flat per-sample table: columns and one dict per record."""
    columns = list(BASE_COLUMNS)
    for m in methods:
        columns += m.csv_columns()
    rows = []
    for r in records:
        row = {k: r.get(k) for k in BASE_COLUMNS}
        region = r.get("region") or {}
        row["region_area_px"] = region.get("area_px")
        row["region_n_tokens"] = region.get("n_tokens")
        if r["status"] == "ok":
            for m in methods:
                if m.name in r["readouts"]:
                    row.update(m.csv_values(r["readouts"][m.name]))
        rows.append(row)
    return columns, rows


def summarize(records: list[dict], methods: list[AuditMethod], n_requested: int, cancelled: bool) -> dict:
    """Counts and distributions, split into correct / incorrect samples."""
    ok = [r for r in records if r["status"] == "ok"]
    groups = {
        "all": ok,
        "correct": [r for r in ok if r["correct"] is True],
        "incorrect": [r for r in ok if r["correct"] is False],
    }
    unlabelled = [r for r in ok if r["correct"] is None]
    if unlabelled:
        groups["unlabelled"] = unlabelled
    labelled = len(groups["correct"]) + len(groups["incorrect"])
    by_kind: dict[str, dict] = {}
    for kind in sorted({r["kind"] for r in ok if r["kind"] is not None and r["correct"] is not None}):
        rs = [r for r in ok if r["kind"] == kind and r["correct"] is not None]
        by_kind[kind] = {"n": len(rs), "accuracy": sum(r["correct"] for r in rs) / len(rs)}
    shares = [r["region"]["token_share"] for r in ok if r.get("region") and r["region"]["token_share"] is not None]
    doc = {
        "n_requested": n_requested,
        "n_samples": len(records),
        "cancelled": cancelled,
        "n_ok": len(ok),
        "n_errors": len(records) - len(ok),
        "errors": [{"index": r["index"], "image": r["image"], "error": r["error"]} for r in records if r["error"]],
        "n_correct": len(groups["correct"]),
        "n_incorrect": len(groups["incorrect"]),
        "n_unlabelled": len(unlabelled),
        "accuracy": len(groups["correct"]) / labelled if labelled else None,
        "by_kind": by_kind,
        "region_token_share": _dist(shares, (0.0, 1.0)),
        "groups": {
            g: {"n": len(rs), **{m.name: m.summarize([r["readouts"][m.name] for r in rs]) for m in methods}}
            for g, rs in groups.items()
        },
    }
    names = {m.name for m in methods}
    if "counterfactual" in names and names & {"attention", "rollout"}:
        doc["routing_vs_effect"] = routing_vs_effect(ok)
    return doc


def _ranks(x: list[float]) -> np.ndarray:
    """Ranks 0..n-1, ties given their mean rank."""
    a = np.asarray(x, dtype=np.float64)
    order = np.argsort(a, kind="stable")
    ranks = np.empty(len(a))
    ranks[order] = np.arange(len(a), dtype=np.float64)
    for v in np.unique(a):
        tie = a == v
        ranks[tie] = ranks[tie].mean()
    return ranks


def _spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rank correlation (None below 3 pairs or with a constant side)."""
    if len(x) < 3:
        return None
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float(np.linalg.norm(rx) * np.linalg.norm(ry))
    return float(rx @ ry) / den if den > 0 else None


def routing_vs_effect(records: list[dict]) -> dict:
    """Across samples with a counterfactual: Spearman correlation of each
    routing read-out of the target region with the causal drop (answer
    minus foil logit difference, original minus edited). A low value is where
    attention and the cause disagree."""
    out: dict[str, Any] = {
        "effect": "drop of the answer-minus-foil logit difference when the target region is filled",
        "note": "routing mass ranks regions by co-occurrence only; the counterfactual is the causal read-out",
    }
    pairs: dict[str, tuple[list, list]] = {"rollout_region_mass": ([], []), "mean_head_region_mass": ([], [])}
    for r in records:
        cfs = r["readouts"].get("counterfactual") or {}
        if cfs.get("skipped") is not None or "effect" not in cfs:
            continue
        drop = cfs["effect"]["drop"]
        ro = r["readouts"].get("rollout") or {}
        if ro.get("region_mass") is not None:
            pairs["rollout_region_mass"][0].append(ro["region_mass"])
            pairs["rollout_region_mass"][1].append(drop)
        heads = [h["region_mass"] for h in (r["readouts"].get("attention") or {}).get("heads", [])]
        heads = [v for v in heads if v is not None]
        if heads:
            pairs["mean_head_region_mass"][0].append(sum(heads) / len(heads))
            pairs["mean_head_region_mass"][1].append(drop)
    for name, (x, y) in pairs.items():
        out[name] = {"n": len(x), "spearman": _spearman(x, y)}
    return out


DATASET_CONTROLS = [
    "distributions over samples (quantiles, histogram), not only means",
    "correct and incorrect samples summarised apart",
    "error samples counted and left out of every distribution",
]


def audit_table(methods: list[AuditMethod], first_audits: dict | None, run_params: dict, options) -> list[AuditRecord]:
    """One row per method: the chapter's columns, the controls this run applied
    (the method's own, as its first successful sample recorded them, plus the
    dataset-level ones) and the run's parameters."""
    rows = []
    for m in methods:
        first = (first_audits or {}).get(m.name)
        controls = list(first["controls"]) if first else []
        notes = list(first["notes"]) if first else []
        for c in [*m.controls(), *DATASET_CONTROLS]:
            if c not in controls:
                controls.append(c)
        for n in m.notes():
            if n not in notes:
                notes.append(n)
        params = {"readout": m.name, **m.parameters(options), **run_params}
        rows.append(AuditRecord.for_method(m.audit_method, controls=controls, parameters=params, notes=notes))
    return rows


def _md_cell(v) -> str:
    text = v if isinstance(v, str) else json.dumps(v)
    return text.replace("|", "\\|").replace("\n", " ")


AUDIT_COLUMNS = ["method", "question", "operation", "controls", "supports", "cannot_support", "parameters", "notes"]


def audit_csv(rows: list[AuditRecord]) -> str:
    out = []
    for r in rows:
        d = r.to_dict()
        d["controls"] = "; ".join(d["controls"])
        d["notes"] = "; ".join(d["notes"])
        d["parameters"] = json.dumps(d["parameters"], sort_keys=True)
        out.append(d)
    return csv_text(AUDIT_COLUMNS, out)


def audit_markdown(rows: list[AuditRecord]) -> str:
    lines = ["| " + " | ".join(AUDIT_COLUMNS) + " |", "|" + "---|" * len(AUDIT_COLUMNS)]
    for r in rows:
        d = r.to_dict()
        d["controls"] = "; ".join(d["controls"])
        d["notes"] = "; ".join(d["notes"])
        d["parameters"] = json.dumps(d["parameters"], sort_keys=True)
        lines.append("| " + " | ".join(_md_cell(d[c]) for c in AUDIT_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    return "" if x is None else f"{x:.4g}"


def _median_table(
    title: str, column: str, top: list[dict], names: list[str], by_group: dict[str, dict[str, dict]], key: str
) -> list[str]:
    """Markdown lines: one row per entry of ``top``, one column per group, each
    cell the median of that entry's ``key`` distribution in the group (blank
    when the group lacks the entry)."""
    lines = [title, "", f"| {column} | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for item in top:
        cells = [_median(by_group[n][item["name"]][key]) if item["name"] in by_group[n] else "" for n in names]
        lines.append(f"| {item['name']} | " + " | ".join(cells) + " |")
    return lines + [""]


def _median(d: dict | None) -> str:
    return _fmt(d["quantiles"]["0.5"]) if d else ""


def summary_markdown(summary: dict, run_params: dict) -> str:
    s = summary
    lines = [
        f"# Audit of {run_params['model']} on {run_params['dataset']}",
        "",
        f"samples {s['n_samples']} (requested {s['n_requested']}{', cancelled' if s['cancelled'] else ''}); "
        f"ok {s['n_ok']}, errors {s['n_errors']}; correct {s['n_correct']}, incorrect {s['n_incorrect']}, "
        f"unlabelled {s['n_unlabelled']}; accuracy {_fmt(s['accuracy'])}",
        "",
    ]
    if s["by_kind"]:
        lines += ["| kind | n | accuracy |", "|---|---|---|"]
        lines += [f"| {k} | {v['n']} | {_fmt(v['accuracy'])} |" for k, v in s["by_kind"].items()]
        lines.append("")
    g = s["groups"]
    names = [n for n in ("all", "correct", "incorrect", "unlabelled") if n in g]
    scalar = []
    if "answer" in g["all"]:
        scalar += [("answer prob", "answer", "answer_prob"), ("logit diff", "answer", "logit_diff")]
    if "rollout" in g["all"]:
        scalar += [("rollout visual mass", "rollout", "visual_mass"), ("rollout region mass", "rollout", "region_mass")]
    if "counterfactual" in g["all"]:
        scalar += [("drop when the target is filled", "counterfactual", "drop")]
    if scalar:
        lines += ["Medians (n per group: " + ", ".join(f"{n} {g[n]['n']}" for n in names) + ")", ""]
        lines += ["| quantity | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for label, m, k in scalar:
            lines.append(f"| {label} | " + " | ".join(_median(g[n][m][k]) for n in names) + " |")
        lines.append("")
    if "attention" in g["all"] and g["all"]["attention"]["heads"]:
        heads = {h["name"]: h for h in g["all"]["attention"]["heads"]}
        top = sorted(heads.values(), key=lambda h: -(h["visual_mass"] or {"mean": 0})["mean"])[:5]
        by_group = {n: {x["name"]: x for x in g[n]["attention"]["heads"]} for n in names}
        title = "Heads with the most answer-row visual mass (median by group)"
        lines += _median_table(title, "head", top, names, by_group, "visual_mass")
    if "dla" in g["all"] and g["all"]["dla"]["components"]:
        comps = [c for c in g["all"]["dla"]["components"] if c["dla_frozen"]]
        top = sorted(comps, key=lambda c: -abs(c["dla_frozen"]["quantiles"]["0.5"]))[:5]
        by_group = {n: {x["name"]: x for x in g[n]["dla"]["components"]} for n in names}
        title = "Components with the largest median frozen-scale DLA"
        lines += _median_table(title, "component", top, names, by_group, "dla_frozen")
    rve = s.get("routing_vs_effect")
    if rve:
        lines += ["Does routing onto the target region rank the causal drop? (Spearman across samples)", ""]
        for k in ("rollout_region_mass", "mean_head_region_mass"):
            lines.append(f"- {k}: {_fmt(rve[k]['spearman'])} (n {rve[k]['n']})")
        lines.append("")
    if s["errors"]:
        lines += ["Errors", ""] + [f"- sample {e['index']} ({e['image']}): {e['error']}" for e in s["errors"][:20]]
        if len(s["errors"]) > 20:
            lines.append(f"- ... {len(s['errors']) - 20} more in summary.json")
        lines.append("")
    lines.append("Read-outs show routing and readability, not causes; see audit.md for what each can support.")
    return "\n".join(lines) + "\n"


def write_outputs(
    out: str | Path,
    merged: ShardResult,
    methods: list[AuditMethod],
    run_params: dict,
    options: AuditOptions,
    n_requested: int,
) -> list[str]:
    """Write every output file except run.json; returns their names."""
    from core.atomic import make_folder, write_bytes_atomic, write_text_atomic

    out = make_folder(out)
    records = [_clean(r) for r in merged.records]
    written = []

    def put(name: str, text: str) -> None:
        write_text_atomic(out / name, text)
        written.append(name)

    columns, rows = sample_rows(records, methods)
    put("samples.csv", csv_text(columns, rows))
    put("samples.jsonl", "".join(json.dumps(r, allow_nan=False) + "\n" for r in records))
    for m in methods:
        if m.long_table is not None:
            name, cols = m.long_table
            long_rows = [
                x for r in records if r["status"] == "ok" for x in m.long_rows(r["index"], r["readouts"][m.name])
            ]
            put(name, csv_text(cols, long_rows))
    if importlib.util.find_spec("pyarrow") is not None:  # optional extra output
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:  # typed columns (numbers stay numbers) ...
                table = pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in rows])
            except (pa.ArrowInvalid, pa.ArrowTypeError):  # ... unless a column mixes types: then as CSV text
                table = pa.Table.from_pylist([{c: _cell(r.get(c)) for c in columns} for r in rows])
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink)
            write_bytes_atomic(out / "samples.parquet", sink.getvalue().to_pybytes())
            written.append("samples.parquet")
        except Exception as e:  # noqa: BLE001 - an optional extra must not sink the run
            print(f"warning: samples.parquet not written ({type(e).__name__})", file=sys.stderr)
    summary = summarize(records, methods, n_requested, merged.cancelled)
    audit = audit_table(methods, merged.first_audits, run_params, options)
    summary_doc = {
        "schema_version": SCHEMA_VERSION,
        "parameters": run_params,
        **summary,
        "audit": [a.to_dict() for a in audit],
    }
    put("summary.json", json.dumps(_clean(summary_doc), indent=1, allow_nan=False) + "\n")
    put("summary.md", summary_markdown(summary, run_params))
    put(
        "audit.json",
        json.dumps({"schema_version": SCHEMA_VERSION, "rows": [a.to_dict() for a in audit]}, indent=1) + "\n",
    )
    put("audit.csv", audit_csv(audit))
    put("audit.md", audit_markdown(audit))
    return written


# ---------------------------------------------------------------- distributed


def dist_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from the launcher's environment
    (torchrun, accelerate launch); ``(0, 1, 0)`` when not launched so."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise ReadoutError("RANK / WORLD_SIZE / LOCAL_RANK must be integers") from None
    if world < 1 or not 0 <= rank < world:
        raise ReadoutError(f"bad launcher environment: RANK={rank}, WORLD_SIZE={world}")
    return rank, world, local


def _gather(shard: ShardResult, rank: int, world: int) -> list[ShardResult] | None:
    import torch.distributed as dist

    gathered = [None] * world if rank == 0 else None
    dist.gather_object(shard, gathered, dst=0)
    return gathered
