"""The validation chain (docs/METHODS.md §4.11) end to end on the default models.

For each model: find the heads that move the asked attribute (colour or
shape) from the target object to the answer position on the ``val`` scenes
(attribute questions with at least one distractor), then run the seven
steps on the top candidates on the ``heldout`` scenes — and on routes: the
candidates of one block together, and that whole block — and write
``bench/results/validation_chain_<model>.json``.

    python bench/validation_chain.py --threads 1
    python bench/validation_chain.py --models shapes-llava --n-eval 200

Re-runnable: a retrained model gets new candidates and new numbers; the
JSON records the model's fingerprint. ``--markdown`` prints the README table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEP_SHORT = {1: "pattern", 2: "content", 3: "predicts S", 4: "swap", 5: "ablation", 6: "baselines", 7: "side effects"}


def run_model(spec: str, args) -> dict:
    import torch

    from core import load_model
    from core.methods import labels as L
    from core.zoo.label_scenes import attribute_context

    t0 = time.perf_counter()
    loaded = load_model(spec)

    def progress(done, total, message):
        if not args.quiet:
            print(f"  [{spec}] {message} {done}/{total}" if total else f"  [{spec}] {message}", file=sys.stderr)

    ctx = attribute_context(
        loaded,
        n_search=args.n_search,
        n_eval=args.n_eval,
        n_side=args.n_side,
        seed=args.seed,
        progress=progress,
    )
    found = L.find_candidates(ctx, args.k)
    chains = [L.run_chain(ctx, head, search) for head, search in found]
    # when candidates share a block, the function may be the block's: test those heads together
    # and the whole block as routes (their baselines are routes too; see labels.BaselinePlan)
    chains += [L.run_chain(ctx, route, search) for route, search in L.find_routes(ctx, found)]
    seconds = time.perf_counter() - t0
    base = ctx.base("eval")
    return {
        "schema_version": 1,
        "model": spec,
        "fingerprint": loaded.fingerprint,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "seconds": round(seconds, 1),
        "relation": L.RELATION,
        "criteria": {str(k): v for k, v in L.CRITERIA.items()},
        "search": {"condition": ctx.search_condition.to_dict(), "heads": found[0][1]["table"] if found else []},
        "evaluation": {
            "condition": ctx.eval_condition.to_dict(),
            "accuracy": float(base.correct.mean()),
            "mean_logit_diff": float(base.logit_diff.mean()),
            "side_kinds": {k: len(v) for k, v in ctx.side_samples.items()},
        },
        "candidates": [c.to_dict() for c in chains],
        "labels": [c.label().to_dict() for c in chains],
        "table": [c.table_row() for c in chains],
    }


def markdown(result: dict) -> str:
    head = "| candidate (picked by) | " + " | ".join(f"{k} {v}" for k, v in STEP_SHORT.items()) + " | status |"
    rows = [head, "|---" * (len(STEP_SHORT) + 2) + "|"]
    for c in result["candidates"]:
        cells = []
        for k in map(str, STEP_SHORT):
            s = c["steps"][k]
            v = s["value"]
            cells.append(s["status"] if s["status"] == "not-run" or v is None else f"{s['status']} {v:.3g}")
        rows.append(
            f"| {c['subject']} ({c['search'].get('picked_by', '')}) | " + " | ".join(cells) + f" | {c['status']} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["shapes-coca", "shapes-llava"])
    p.add_argument("--n-search", type=int, default=150)
    p.add_argument("--n-eval", type=int, default=150)
    p.add_argument("--n-side", type=int, default=50, help="samples of each other question kind (step 7)")
    p.add_argument("--k", type=int, default=3, help="candidates by target-source DLA (+ the top attention head)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--markdown", action="store_true", help="print the README table")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    import torch

    from core.atomic import write_text_atomic

    torch.set_num_threads(args.threads)
    for spec in args.models:
        result = run_model(spec, args)
        out = Path(args.out_dir) / f"validation_chain_{spec}.json"
        write_text_atomic(out, json.dumps(result, indent=1) + "\n")
        print(f"{spec}: {out} ({result['seconds']} s)", file=sys.stderr)
        if args.markdown:
            print(f"\n### {spec}\n\n{markdown(result)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
