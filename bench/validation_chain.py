"""The validation chain (docs/METHODS.md §4.11) on the default models, through
``vlm-readout validate``, with its negative control.

For each model the command finds the heads that move the asked attribute
(colour or shape) from the target object to the answer position on the
``val`` scenes and runs the seven steps on them, and on the routes of blocks
holding two or more, on the ``heldout`` scenes; the same command then runs on
a copy of the model with random weights (``core.zoo.random_weights``: each
tensor replaced by noise of its own mean and standard deviation), where no
label may come out "supported". Each run's JSON is the command's own:

    bench/results/validation_chain_<model>.json
    bench/results/validation_chain_<model>_random.json

    python bench/validation_chain.py --threads 1 --markdown
    python bench/validation_chain.py --models shapes-llava --n 200

``--markdown`` prints the README tables from those files (``--from-results``:
without running anything).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLAIM = "moves the asked colour or shape from the target object to the answer"
STEP_SHORT = {1: "pattern", 2: "content", 3: "predicts S", 4: "swap", 5: "ablation", 6: "baselines", 7: "side effects"}


def command(model: str, out: Path, args) -> list[str]:
    """The ``vlm-readout validate`` command line of one run."""
    return [
        "validate",
        "--model",
        model,
        "--candidates",
        str(args.k),
        "--claim",
        CLAIM,
        "--dataset",
        "scenes",
        "--n",
        str(args.n),
        "--n-side",
        str(args.n_side),
        "--seed",
        str(args.seed),
        "--json",
        str(out),
        "--quiet",
    ]


def run(spec: str, args) -> None:
    from core.cli import main
    from core.zoo.random_weights import randomize_folder

    out_dir = Path(args.out_dir)
    trained = out_dir / f"validation_chain_{spec}.json"
    if main(command(spec, trained, args)) != 0:
        raise SystemExit(f"validate failed on {spec}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = randomize_folder(spec, Path(tmp) / f"{spec}-random", seed=args.seed)
        random = out_dir / f"validation_chain_{spec}_random.json"
        if main(command(str(folder), random, args)) != 0:
            raise SystemExit(f"validate failed on the random copy of {spec}")
    doc = json.loads(random.read_text())
    doc["model"]["folder_as_run"] = doc["model"]["spec"]  # a temporary folder: named for what it held
    doc["model"]["spec"] = f"{spec} with random weights (core.zoo.random_weights, seed {args.seed})"
    from core.files.atomic import write_text_atomic

    write_text_atomic(random, json.dumps(doc, allow_nan=False) + "\n")  # the temporary folder's path means nothing
    supported = [v["subject"] for v in doc["verdicts"] if v["supported"]]
    if supported:
        raise SystemExit(f"negative control failed: random weights 'support' {supported} on {spec}")


def markdown(result: dict) -> str:
    """The candidates x steps table of one command JSON: each step's status and key number."""
    head = "| candidate (picked by) | " + " | ".join(f"{k} {v}" for k, v in STEP_SHORT.items()) + " | status |"
    rows = [head, "|---" * (len(STEP_SHORT) + 2) + "|"]
    for c in result["chains"]:
        cells = []
        for k in map(str, STEP_SHORT):
            s = c["steps"][k]
            v = s["value"]
            cells.append(s["status"] if s["status"] == "not tested" or v is None else f"{s['status']} {v:.3g}")
        picked = c["search"].get("picked_by", "named")
        rows.append(f"| {c['subject']} ({picked}) | " + " | ".join(cells) + f" | {c['status']} |")
    return "\n".join(rows)


def header(result: dict) -> str:
    step5 = result["chains"][0]["steps"]["5"]["numbers"] if result["chains"] else {}
    step4 = result["chains"][0]["steps"]["4"]["numbers"] if result["chains"] else {}
    return (
        f"{result['model']['spec']} (fingerprint {result['model']['fingerprint']}; accuracy on the evaluation set "
        f"{step5.get('accuracy', float('nan')):.3f}, n={result['heldout']['n_samples']}; "
        f"{len(step4.get('pairs', []))} scenes admitted a swap; {result['seconds']} s)"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["shapes-coca", "shapes-llava"])
    p.add_argument("--n", type=int, default=150, help="attribute scenes of each split")
    p.add_argument("--n-side", type=int, default=50, help="scenes of each other question kind (step 7)")
    p.add_argument("--k", type=int, default=3, help="candidates by target-source DLA (+ the top attention head)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--markdown", action="store_true", help="print the README tables")
    p.add_argument("--from-results", action="store_true", help="only print the tables of the JSON already written")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    for spec in args.models:
        if not args.from_results:
            run(spec, args)
        if args.markdown:
            for suffix in ("", "_random"):
                result = json.loads((Path(args.out_dir) / f"validation_chain_{spec}{suffix}.json").read_text())
                print(f"\n{header(result)}:\n\n{markdown(result)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
