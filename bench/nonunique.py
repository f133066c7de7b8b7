"""Non-unique attention (docs/METHODS.md §4.10) on the default models, over held-out
synthetic scenes: for the head that puts the most attention mass on the
target object's visual tokens at the answer position, can the head's output
be reproduced with that mass moved elsewhere, and at which constraint level?

    python bench/nonunique.py [--n 40] [--json bench/results/nonunique.json]

Per scene: capture at the answer position (every block), the target object's
visual tokens (ground-truth mask, ``region_tokens`` with 25% cover), the
(block, head) with the largest mass on them (self-attention blocks for
shapes-llava, cross-attention blocks for shapes-coca), then
``nonunique_attention`` with the object's tokens as the source set at
tolerance 5% (all levels; score bounds 1 and 2 logits) and 1% (level a only).
Recorded: the real mass on the object, the mass each level moves off it,
whether it counts as an alternative (moves >= 0.05, or half the object's mass
when that is below 0.1), the exactness checks and the time per call.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from core import load_model
from core.files.atomic import write_text_atomic
from core.forward.capture import capture
from core.forward.geometry import region_tokens
from core.methods.nonunique import nonunique_attention, visual_token_keys
from core.zoo import scenes

LEVELS = ["a", "b1", "b2", "c-query", "c-residual"]


def _key(lv) -> str:
    return "b" + format(lv.parameters["score_bound"], "g") if lv.level == "b" else lv.level


def run_model(spec: str, n: int, start: int = 0) -> dict:
    m = load_model(spec)
    a = m.adapter
    rows, i = [], start
    while len(rows) < n:
        s = scenes.make_sample("heldout", i)
        i += 1
        if s.target is None:
            continue
        tr = capture(m, s.image, s.question)
        tokens = a.visual_tokens((s.image.shape[1], s.image.shape[0]), tr.visual_positions[0].tolist() or None)
        region = region_tokens(tokens, s.objects[s.target].mask)
        if not region:
            continue
        best = None
        for block in range(tr.n_blocks):
            if a.attention_kind == "cross" and tr.block_kinds[block] != "cross":
                continue
            keys = visual_token_keys(tr, block, region)
            mass = tr.patterns[block][0, :, 0, keys].sum(-1)
            h = int(mass.argmax())
            if best is None or float(mass[h]) > best[2]:
                best = (block, h, float(mass[h]), keys)
        block, head, _, keys = best
        t0 = time.perf_counter()
        res = nonunique_attention(a, tr, block, head, sources=keys)
        dt = time.perf_counter() - t0
        tight = nonunique_attention(a, tr, block, head, sources=keys, tol=0.01, levels=("a",))
        row = {
            "index": s.index,
            "kind": s.kind,
            "block": res.block_name,
            "head": head,
            "n_region_tokens": len(keys),
            "real_mass": res.real_source_mass,
            "null_dimension": res.null_dimension,
            "seconds": dt,
            "checks": res.checks,
            "max_start_error": max(lv.start_error for lv in res.levels),
            "levels": {
                _key(lv): {
                    "moved": lv.moved_mass,
                    "moved_fraction": lv.moved_fraction,
                    "alternative": lv.alternative,
                    "output_error": lv.output_error,
                    "certified_min_source_mass": lv.certified_min_source_mass,
                    "query_reachable": lv.extra.get("query_reachable"),
                }
                for lv in res.levels
            },
            "a_tol_0.01": {
                "moved_fraction": tight.levels[0].moved_fraction,
                "alternative": tight.levels[0].alternative,
                "certified_min_source_mass": tight.levels[0].certified_min_source_mass,
                "duality_gap": tight.levels[0].extra.get("duality_gap"),
            },
            "verdict": res.verdict,
        }
        rows.append(row)
        print(
            f"{spec} scene {s.index} {row['block']}.H{head} mass {row['real_mass']:.3f} "
            + " ".join(
                f"{k}={v['moved_fraction']:.2f}{'*' if v['alternative'] else ''}" for k, v in row["levels"].items()
            )
            + f" | a@1%={row['a_tol_0.01']['moved_fraction']:.2f}  {dt:.2f}s",
            flush=True,
        )

    def med(xs):
        return statistics.median(xs) if xs else None

    summary = {
        "n": len(rows),
        "median_real_mass": med([r["real_mass"] for r in rows]),
        "median_seconds_per_call": med([r["seconds"] for r in rows]),
        "max_seconds_per_call": max(r["seconds"] for r in rows),
        "max_output_reconstruction_error": max(r["checks"]["output_reconstruction_error"] for r in rows),
        "max_start_error": max(r["max_start_error"] for r in rows),
        "levels_tol_0.05": {
            k: {
                "alternative_rate": sum(r["levels"][k]["alternative"] for r in rows) / len(rows),
                "median_moved_fraction": med([r["levels"][k]["moved_fraction"] for r in rows]),
            }
            for k in LEVELS
        },
        "c_query_reachable_rate": sum(bool(r["levels"]["c-query"]["query_reachable"]) for r in rows) / len(rows),
        "a_tol_0.01": {
            "alternative_rate": sum(r["a_tol_0.01"]["alternative"] for r in rows) / len(rows),
            "median_moved_fraction": med([r["a_tol_0.01"]["moved_fraction"] for r in rows]),
            "max_duality_gap": max(r["a_tol_0.01"]["duality_gap"] or 0.0 for r in rows),
        },
    }
    return {"model": spec, "summary": summary, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="bench/results/nonunique.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {
        "schema_version": 1,
        "bench": "nonunique",
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": args.threads,
        "tol": 0.05,
        "score_bounds": [1.0, 2.0],
        "models": [run_model(spec, args.n) for spec in ("shapes-llava", "shapes-coca")],
    }
    write_text_atomic(args.json, json.dumps(out, indent=1, allow_nan=False))
    for m in out["models"]:
        print(m["model"], json.dumps(m["summary"], indent=1))


if __name__ == "__main__":
    main()
