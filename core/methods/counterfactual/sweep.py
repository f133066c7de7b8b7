"""The occlusion sweep: every patch (or k x k block of patches) of the
primary image filled in turn, batched, into a patch-grid map of the answer
effect (:class:`OcclusionMap`); an interpolated map only on request, always
flagged as visual smoothing (:class:`InterpolatedHeatmap`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from core.errors import InterventionError, oom_guard
from core.files.images import load_image
from core.forward.geometry import VisualToken
from core.methods.counterfactual.effect import (
    SCHEMA_VERSION,
    Cancel,
    Progress,
    answer_numbers,
    counterfactual_audit,
    fill_run_parameters,
    header_of,
    resolve_tokens,
)
from core.methods.counterfactual.fills import Fill, as_fill
from core.methods.counterfactual.regions import RegionError, mask_from_boxes
from core.methods.patterns import primary_image
from core.results.audit import AuditRecord
from core.results.readout import Target

INTERPOLATED_FLAG = "visual smoothing, not a causal pixel mask"


# ---------------------------------------------------------------- occlusion sweep


def _primary_grid(tokens) -> tuple[int, int, int, dict]:
    """``(image, rows, cols, {(row, col): token})`` of the primary image's patch grid."""

    im = primary_image(tokens)
    if im is None:
        raise InterventionError("the visual tokens cover no patch (a resampler's latents): there is no grid to occlude")
    cells = {(t.row, t.col): t for t in tokens if t.image == im and t.col >= 0}
    rows = max(r for r, _ in cells) + 1
    cols = max(c for _, c in cells) + 1
    return im, rows, cols, cells


def sweep_cells(tokens, image_size: tuple[int, int], k: int = 1) -> list[dict]:
    """The k x k blocks of the primary image's patch grid, row-major: each
    ``{"row", "col", "patches": [(r, c)...], "mask": (H, W) bool}``; a cell's
    mask is the pixels whose centre lies in one of its patches' boxes (cells
    on the grid's far edge may hold fewer than k x k patches)."""
    if int(k) != k or k < 1:
        raise RegionError(f"the sweep block size must be a positive integer, got {k}")
    k = int(k)
    _, rows, cols, cells = _primary_grid(tokens)
    out = []
    for R in range(math.ceil(rows / k)):
        for C in range(math.ceil(cols / k)):
            patches = [(r, c) for r in range(R * k, min(rows, R * k + k)) for c in range(C * k, min(cols, C * k + k))]
            boxes = [cells[p].box for p in patches if p in cells]
            out.append({"row": R, "col": C, "patches": patches, "mask": mask_from_boxes(image_size, boxes)})
    return out


@dataclass
class InterpolatedHeatmap:
    """An upsampled map, for display only. ``interpolated`` is always
    :data:`INTERPOLATED_FLAG`: it is visual smoothing, not a causal pixel mask."""

    values: np.ndarray  # (H, W)
    image_size: tuple[int, int]
    source: str
    method: str = "bilinear"
    interpolated: str = INTERPOLATED_FLAG

    def to_dict(self) -> dict:
        return {
            "interpolated": self.interpolated,
            "source": self.source,
            "method": self.method,
            "image_size": list(self.image_size),
            "values": np.where(np.isfinite(self.values), self.values, None).tolist(),
        }


@dataclass
class OcclusionMap:
    """The answer effect of filling each k x k block of patches, on the patch
    grid of the primary image (rows x cols of ``adapter.visual_tokens``,
    grouped by k). Patch-granular: no interpolation.

    Attributes:
        logit_diff_change, logit_change, prob_change: ``(grid_rows, grid_cols)``
            edited minus original (``logit_diff_change`` is None without a foil).
        flipped: ``(grid_rows, grid_cols)`` bool, the argmax changed.
        cells: per cell ``{"row", "col", "patches", "mask_area_px", "box"}``.
    """

    k: int
    fill: Fill
    image_size: tuple[int, int] | None  # None: restored from a JSON that does not state it
    original: Target
    logit_diff_change: np.ndarray | None
    logit_change: np.ndarray
    prob_change: np.ndarray
    flipped: np.ndarray
    cells: list[dict]
    complete: bool = True
    audit: list[AuditRecord] = field(default_factory=list, repr=False)
    answer_prefix: tuple[int, ...] = ()
    model: dict | None = None  # the command's header (core.methods.counterfactual.effect.HEADER)
    input: dict | None = None
    interpolated_map: dict | None = None  # an interpolated map a stored JSON holds (the command's --interpolated)

    kind = "sweep"  # the session's run kind (core.results.readout.Readout)

    def summary(self) -> str:
        return self.summary_of(self.to_dict())

    @staticmethod
    def summary_of(doc: Mapping) -> str:
        """The one line of a sweep JSON (:meth:`to_dict`): this result's, or a stored run's."""
        s = doc["sweep"]
        grid = s["logit_diff_change"] if s.get("logit_diff_change") is not None else s["logit_change"]
        cells = [(v, i, j) for i, row in enumerate(grid) for j, v in enumerate(row) if v is not None]
        n_flip = sum(bool(v) for row in s["flipped"] for v in row)
        line = f"occlusion sweep {s['grid_shape'][0]}x{s['grid_shape'][1]} cells (k={s['k']}, fill {s['fill']})"
        if cells:
            v, i, j = min(cells)
            line += f"; largest drop {-v:.3f} at cell [{i}, {j}]"
        return line + f"; {n_flip} cells flip the answer"

    def parameters(self) -> dict:
        return {**fill_run_parameters(self.original, self.fill, self.answer_prefix), "k": self.k}

    def audit_records(self) -> list[AuditRecord]:
        return list(self.audit)

    @property
    def effect(self) -> np.ndarray:
        """The map a user reads first: logit-difference change with a foil, else logit change."""
        return self.logit_diff_change if self.logit_diff_change is not None else self.logit_change

    def cell_boxes(self) -> list | None:
        """Each cell's box (original-image pixels) in row-major grid order; None unless every
        cell of the grid has one."""
        rows, cols = self.logit_change.shape
        if len(self.cells) != rows * cols:
            return None
        by_place = {(c["row"], c["col"]): c.get("box") for c in self.cells}
        boxes = [by_place.get((i, j)) for i in range(rows) for j in range(cols)]
        return boxes if all(b is not None for b in boxes) else None

    def cell_tokens(self) -> list[VisualToken]:
        """The cells as the tokens of one grid (row, col, box; no sequence position), to draw
        the map on: a cell without a box is left out."""
        cells = [c for c in self.cells if c.get("box") is not None]
        return [VisualToken(i, None, 0, c["row"], c["col"], c["box"]) for i, c in enumerate(cells)]

    def interpolated(self, image_size: tuple[int, int] | None = None) -> InterpolatedHeatmap:
        """The effect map upsampled (bilinear) to ``image_size`` (default: the
        image's). Only for display; it carries :data:`INTERPOLATED_FLAG`."""
        if image_size is None and self.image_size is None:
            raise ValueError("this map was restored from a JSON, which does not state the image size: pass image_size")
        w, h = image_size or self.image_size
        grid = np.asarray(self.effect, dtype=np.float32)
        up = Image.fromarray(grid, mode="F").resize((int(w), int(h)), Image.BILINEAR)
        name = "logit_diff_change" if self.logit_diff_change is not None else "logit_change"
        return InterpolatedHeatmap(np.asarray(up, dtype=np.float64), (int(w), int(h)), f"occlusion sweep {name}")

    def to_dict(self, *, interpolated: bool = False) -> dict:
        d = {
            "schema_version": SCHEMA_VERSION,
            "sweep": {
                "k": self.k,
                "fill": self.fill.kind,
                "fill_parameters": self.fill.parameters(),
                "grid_shape": list(self.logit_change.shape),
                "granularity": "patch grid (k x k patches per cell), not interpolated",
                "complete": self.complete,
                "logit_diff_change": _grid(self.logit_diff_change),
                "logit_change": _grid(self.logit_change),
                "prob_change": _grid(self.prob_change),
                "flipped": self.flipped.tolist(),
                "cells": self.cells,
            },
            "answer_prefix_ids": list(self.answer_prefix),
            "original": self.original.to_dict(),
            "audit": [a.to_dict() for a in self.audit],
        }
        if interpolated:
            d["interpolated_map"] = self.interpolated().to_dict()
        elif self.interpolated_map is not None:
            d["interpolated_map"] = self.interpolated_map
        return {**d, **header_of(self)}

    @classmethod
    def from_dict(cls, d: dict) -> OcclusionMap:
        """The map a sweep JSON (:meth:`to_dict`, a stored run's) describes: cells not run
        (null) are NaN; ``image_size`` is the command's ``input.image_size``, else None."""
        s = d["sweep"]
        size = (d.get("input") or {}).get("image_size")
        return cls(
            k=int(s["k"]),
            fill=Fill.recorded(s["fill"], s["fill_parameters"]),
            image_size=tuple(int(v) for v in size) if size is not None else None,
            original=Target.from_dict(d["original"]),
            logit_diff_change=_array(s["logit_diff_change"]),
            logit_change=_array(s["logit_change"]),
            prob_change=_array(s["prob_change"]),
            flipped=np.array(s["flipped"], dtype=bool),
            cells=list(s["cells"]),
            complete=bool(s["complete"]),
            audit=[AuditRecord.from_dict(a) for a in d.get("audit") or []],
            answer_prefix=tuple(int(t) for t in d.get("answer_prefix_ids") or ()),
            model=d.get("model"),
            input=d.get("input"),
            interpolated_map=d.get("interpolated_map"),
        )


def _grid(a: np.ndarray | None):
    return None if a is None else np.where(np.isfinite(a), a, None).tolist()


def _array(grid) -> np.ndarray | None:
    """A stored grid back as a float array, its nulls (cells not run) NaN (the inverse of :func:`_grid`)."""
    if grid is None:
        return None
    values = np.array([[np.nan if v is None else v for v in row] for row in grid], dtype=np.float64)
    if values.ndim != 2:
        raise ValueError(f"a sweep grid is (rows, cols), got {values.ndim} dimensions")
    return values


@torch.no_grad()
def occlusion_sweep(
    loaded,
    image,
    question: str,
    *,
    k: int = 1,
    fill: Fill | str = "mean",
    answer: str | int | None = None,
    foil: str | int | None = None,
    batch_size: int = 16,
    progress: Progress = None,
    cancel: Cancel = None,
    answer_prefix: Sequence[int] = (),
    **fill_options,
) -> OcclusionMap:
    """Fill every k x k block of patches in turn and run the edited images
    batched through ``adapter.prepare`` + the answer position's logits
    (``answer_prefix``: answer tokens after the prompt, :mod:`core.answer_text`).

    Returns:
        An :class:`OcclusionMap`; cells not run (cancelled) are NaN and
        ``complete`` is False.
    """

    adapter = loaded.adapter
    img = load_image(image)
    f = as_fill(fill, **fill_options)
    arr = np.asarray(img)
    fill_cell = f.bind(arr)
    tokens = adapter.visual_tokens(img.size)  # boxes only: the grid does not need sequence positions
    cells = sweep_cells(tokens, img.size, k)
    n_rows = max(c["row"] for c in cells) + 1
    n_cols = max(c["col"] for c in cells) + 1
    maps = {key: np.full((n_rows, n_cols), np.nan) for key in ("logit_diff", "logit", "prob")}
    flipped = np.zeros((n_rows, n_cols), dtype=bool)
    done = 0
    original = answer_id = foil_id = None
    for start in range(0, len(cells), batch_size):
        if start and cancel is not None and cancel():
            break
        chunk = cells[start : start + batch_size]
        edited = [fill_cell(c["mask"]) for c in chunk]
        if original is None:  # the original image rides in the first batch
            edited.insert(0, arr)
        with oom_guard(f"running a batch of {len(edited)} occluded images"):
            inputs = adapter.prepare(edited, [question] * len(edited), answer_prefix=answer_prefix)
            logits = adapter.next_token_logits(inputs).detach().cpu()
        if original is None:
            answer_id, foil_id = resolve_tokens(adapter, answer, foil, logits[0])
            original = answer_numbers(adapter, logits[0], answer_id, foil_id)
            logits = logits[1:]
        z = logits.double()  # (n, vocab); the same arithmetic as answer_numbers, for the whole batch
        rr = np.array([c["row"] for c in chunk])
        cc = np.array([c["col"] for c in chunk])
        maps["logit"][rr, cc] = (z[:, answer_id] - original.logit).numpy()
        maps["prob"][rr, cc] = (z.softmax(-1)[:, answer_id] - original.prob).numpy()
        if foil_id is not None:
            maps["logit_diff"][rr, cc] = (z[:, answer_id] - z[:, foil_id] - original.logit_diff).numpy()
        flipped[rr, cc] = (z.argmax(-1) != original.predicted_id).numpy()
        done += len(chunk)
        if progress is not None:
            progress(done, len(cells), "occlusion sweep")
    cell_info = []
    for c in cells:
        ys, xs = np.nonzero(c["mask"])
        box = [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1] if len(xs) else None
        cell_info.append(
            {
                "row": c["row"],
                "col": c["col"],
                "patches": [list(p) for p in c["patches"]],
                "mask_area_px": int(c["mask"].sum()),
                "box": box,
            }
        )
    audit = counterfactual_audit(
        f,
        {
            "k": int(k),
            "grid_shape": [n_rows, n_cols],
            "batch_size": batch_size,
            "answer_id": answer_id,
            "foil_id": foil_id,
            "answer_prefix_ids": list(answer_prefix),
            "cells_run": done,
        },
        [
            "one cell filled at a time: interactions between cells (redundant evidence) are not seen",
            "the original image runs in the first batch with the edited ones",
            "patch-granular map; an interpolated map is visual smoothing, not a causal pixel mask",
        ],
    )
    return OcclusionMap(
        int(k),
        f,
        img.size,
        original,
        maps["logit_diff"] if foil_id is not None else None,
        maps["logit"],
        maps["prob"],
        flipped,
        cell_info,
        done == len(cells),
        [audit],
        tuple(int(t) for t in answer_prefix),
    )
