"""The target-versus-distractor check: fill a synthetic scene's target object
(its ground-truth mask) and, as the control, the distractor of closest area,
over many scenes (:func:`object_fill_effects`). The scenes themselves come
from :func:`core.zoo.distractor_scenes.scenes_with_distractor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from core.errors import oom_guard
from core.methods.counterfactual.effect import Cancel, Progress, counterfactual_audit
from core.methods.counterfactual.fills import Fill, as_fill
from core.results.audit import AuditRecord


def closest_area_distractor(sample) -> int:
    """The distractor whose ground-truth mask area is closest to the target's (ties: lower index)."""
    area_t = int(sample.objects[sample.target].mask.sum())
    return min(sample.distractors, key=lambda i: (abs(int(sample.objects[i].mask.sum()) - area_t), i))


@dataclass
class ObjectFillEffects:
    """Filling the target object's ground-truth mask versus a distractor's of
    similar area, over many synthetic scenes. Drops are original minus edited
    answer-minus-foil logit difference (positive: the fill hurt the answer).

    Attributes:
        rows: per scene ``{"index", "kind", "template", "target_area", "distractor_area",
            "original", "target_filled", "distractor_filled", "target_drop", "distractor_drop"}``.
    """

    fill: Fill
    rows: list[dict]
    audit: AuditRecord = field(repr=False, default=None)

    def summary(self, rows: list[dict] | None = None) -> dict:
        rows = self.rows if rows is None else rows
        if not rows:
            return {"n": 0}
        t = np.array([r["target_drop"] for r in rows])
        d = np.array([r["distractor_drop"] for r in rows])
        med_t, med_d = float(np.median(t)), float(np.median(d))
        return {
            "n": len(rows),
            "share_target_fill_lowers_logit_diff": float((t > 0).mean()),
            "median_target_drop": med_t,
            "median_distractor_drop": med_d,
            "median_ratio": med_t / med_d if med_d > 0 else None,
            "median_target_drop_at_least_3x_distractor": bool(med_t > 0 and med_t >= 3 * med_d),
            "median_abs_target_change": float(np.median(np.abs(t))),
            "median_abs_distractor_change": float(np.median(np.abs(d))),
            "share_target_drop_exceeds_distractor_drop": float((t > d).mean()),
        }

    def by_kind(self) -> dict[str, dict]:
        kinds = sorted({r["kind"] for r in self.rows})
        return {k: self.summary([r for r in self.rows if r["kind"] == k]) for k in kinds}

    def to_dict(self) -> dict:
        return {
            "fill": self.fill.kind,
            "fill_parameters": self.fill.parameters(),
            "summary": self.summary(),
            "by_kind": self.by_kind(),
            "rows": self.rows,
            "audit": self.audit.to_dict() if self.audit else None,
        }


@torch.no_grad()
def object_fill_effects(
    loaded,
    samples: Sequence,
    fill: Fill | str = "mean",
    *,
    batch_size: int = 32,
    progress: Progress = None,
    cancel: Cancel = None,
    **fill_options,
) -> ObjectFillEffects:
    """For each synthetic sample (with a target and a distractor): the
    answer-minus-foil logit difference on the original, with the target's
    ground-truth mask filled, and with the closest-area distractor's mask
    filled (the question's own answer and foil)."""
    adapter = loaded.adapter
    f = as_fill(fill, **fill_options)
    rows: list[dict] = []
    per_batch = max(1, batch_size // 3)
    for start in range(0, len(samples), per_batch):
        if cancel is not None and cancel():
            break
        chunk = samples[start : start + per_batch]
        images, questions, meta = [], [], []
        for s in chunk:
            d = closest_area_distractor(s)
            mt, md = s.objects[s.target].mask, s.objects[d].mask
            fill_one = f.bind(s.image)
            images += [s.image, fill_one(mt), fill_one(md)]
            questions += [s.question] * 3
            meta.append((s, d, int(mt.sum()), int(md.sum())))
        with oom_guard(f"running a batch of {len(images)} scene images"):
            inputs = adapter.prepare(images, questions)
            logits = adapter.next_token_logits(inputs).detach().double().cpu()
        for j, (s, d, at, ad) in enumerate(meta):
            a, fo = adapter.token_id(s.answer), adapter.token_id(s.foil)
            ld = [float(logits[3 * j + i, a] - logits[3 * j + i, fo]) for i in range(3)]
            rows.append(
                {
                    "index": s.index,
                    "kind": s.kind,
                    "template": s.template,
                    "answer": s.answer,
                    "foil": s.foil,
                    "target": s.target,
                    "distractor": d,
                    "target_area": at,
                    "distractor_area": ad,
                    "original": ld[0],
                    "target_filled": ld[1],
                    "distractor_filled": ld[2],
                    "target_drop": ld[0] - ld[1],
                    "distractor_drop": ld[0] - ld[2],
                }
            )
        if progress is not None:
            progress(len(rows), len(samples), "target / distractor fills")
    audit = counterfactual_audit(
        f,
        {"n_samples": len(rows), "batch_size": batch_size, "control": "distractor mask of closest area"},
        [
            "ground-truth masks of synthetic scenes; answer and foil from the question's ground truth",
            "a drop says the answer depends on those pixels under this fill, not which internal route carries it",
        ],
    )
    return ObjectFillEffects(f, rows, audit)
