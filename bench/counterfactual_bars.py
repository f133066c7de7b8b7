"""Issue 4, "Done when" #1: filling the target object's ground-truth mask
(mean fill) versus filling a distractor's mask of similar area, on held-out
synthetic scenes, for each default model.

    python bench/counterfactual_bars.py [--n 500] [--models shapes-llava shapes-coca]
        [--json bench/results/counterfactual_bars.json]

writes the summaries to the JSON and one line per (model, scene) to
``counterfactual_bars.rows.jsonl`` beside it.

Scenes: ``scenes.make_sample("heldout", i)`` for i = 0, 1, ... kept when the
sample has a target object and at least one distractor, until ``n`` are kept
(the same scenes for every model). Answer and foil: the question's own. The
distractor is the one whose mask area is closest to the target's. Drop =
original minus edited answer-minus-foil logit difference (positive: the fill
hurt the answer).

Bar, per model: the target fill lowers the logit difference in >= 95% of
scenes, and the median target drop is >= 3x the median distractor drop.
Re-runnable: the model fingerprint is recorded, so a retrained model's numbers
are told apart from the old ones.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch

from core import load_model
from core.methods.counterfactual import object_fill_effects
from core.zoo.distractor_scenes import scenes_with_distractor

SHARE_BAR = 0.95
RATIO_BAR = 3.0


def evaluate(res, rows=None) -> dict:
    s = res.summary(rows)
    if s["n"] == 0:
        return s
    s["meets_share_bar"] = s["share_target_fill_lowers_logit_diff"] >= SHARE_BAR
    s["meets_ratio_bar"] = s["median_target_drop_at_least_3x_distractor"]
    return s


def run_model(spec: str, samples, batch_size: int, fill: str = "mean") -> dict:
    loaded = load_model(spec)
    t = time.perf_counter()
    res = object_fill_effects(loaded, samples, fill, batch_size=batch_size)
    seconds = time.perf_counter() - t
    rows = res.rows
    overall = evaluate(res)
    splits = {
        "by_kind": {k: evaluate(res, [r for r in rows if r["kind"] == k]) for k in sorted({r["kind"] for r in rows})},
        "relation_by_answer": {
            a: evaluate(res, [r for r in rows if r["kind"] == "relation" and r["answer"] == a]) for a in ("yes", "no")
        },
        "by_original_correct": {
            "correct (original logit diff > 0)": evaluate(res, [r for r in rows if r["original"] > 0]),
            "wrong (original logit diff <= 0)": evaluate(res, [r for r in rows if r["original"] <= 0]),
        },
        "excluding_relation": evaluate(res, [r for r in rows if r["kind"] != "relation"]),
    }
    return {
        "model": spec,
        "fingerprint": getattr(loaded, "fingerprint", None),
        "seconds": round(seconds, 2),
        "meets_bar": bool(overall["meets_share_bar"] and overall["meets_ratio_bar"]),
        "overall": overall,
        **splits,
        "audit": res.audit.to_dict(),
        "rows": rows,  # written to the JSONL beside the summary
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--models", nargs="+", default=["shapes-llava", "shapes-coca"])
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fill", default="mean", help="the bar is defined for mean; others for comparison")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    samples = scenes_with_distractor("heldout", args.n)
    results = [run_model(spec, samples, args.batch_size, args.fill) for spec in args.models]
    print(
        "| model | n | target fill lowers diff | median target drop | median distractor drop | ratio | "
        "median abs change target / distractor | bar |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        o = r["overall"]
        ratio = f"{o['median_ratio']:.1f}" if o["median_ratio"] is not None else "n/a (distractor median <= 0)"
        print(
            f"| {r['model']} | {o['n']} | {o['share_target_fill_lowers_logit_diff']:.3f} | "
            f"{o['median_target_drop']:.3f} | {o['median_distractor_drop']:.3f} | {ratio} | "
            f"{o['median_abs_target_change']:.3f} / {o['median_abs_distractor_change']:.3f} | "
            f"{'met' if r['meets_bar'] else 'not met'} |"
        )
        for kind, s in [*r["by_kind"].items(), ("all but relation", r["excluding_relation"])]:
            print(
                f"|   {kind} | {s['n']} | {s['share_target_fill_lowers_logit_diff']:.3f} | "
                f"{s['median_target_drop']:.3f} | {s['median_distractor_drop']:.3f} | | "
                f"{s['median_abs_target_change']:.3f} / {s['median_abs_distractor_change']:.3f} | |"
            )
    if args.json:
        out = {
            "date": date.today().isoformat(),
            "machine": platform.machine(),
            "torch": torch.__version__,
            "split": "heldout",
            "scene_indices": [s.index for s in samples],
            "fill": args.fill,
            "bar": f"share of scenes where the target fill lowers answer-minus-foil logit diff >= {SHARE_BAR}, "
            f"and median target drop >= {RATIO_BAR}x median drop of the closest-area distractor fill",
            "rows_file": Path(args.json).with_suffix(".rows.jsonl").name,
            "models": [{k: v for k, v in r.items() if k != "rows"} for r in results],
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, allow_nan=False) + "\n")
        lines = [
            json.dumps({"model": r["model"], **{k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}})
            for r in results
            for row in r["rows"]
        ]
        Path(args.json).with_suffix(".rows.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
