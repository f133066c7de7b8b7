"""The validation chain (docs/METHODS.md §4.11) on the default models, through
``vlm-readout validate``, for every shipped claim specification, with its
negative control.

For each model and specification (``--spec``: attribute-moving, object-name-copying,
previous-token, induction, sink-delimiter) the command finds candidate heads on the
``val`` scenes and runs the seven steps derived from the specification on them, and on
the routes of blocks holding two or more, on the ``heldout`` scenes; the same command
then runs on a copy of the model with random weights (``core.zoo.random_weights``: each
tensor replaced by noise of its own mean and standard deviation) with at least five
candidate heads, where no label may come out "supported". Each run's JSON is the
command's own:

    bench/results/validation_chain_<model>_<spec>.json
    bench/results/validation_chain_<model>_<spec>_random.json

    python bench/validation_chain.py --threads 1 --markdown
    python bench/validation_chain.py --models shapes-llava --specs induction --n 200

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

SPECS = ("attribute-moving", "object-name-copying", "previous-token", "induction", "sink-delimiter")
STEP_SHORT = {1: "pattern", 2: "content", 3: "predicts S", 4: "swap", 5: "ablation", 6: "baselines", 7: "side effects"}


def command(model: str, spec: str, out: Path, args, k: int) -> list[str]:
    """The ``vlm-readout validate`` command line of one run (the claim: the specification's relation)."""
    from core.methods.validation.spec import SHIPPED

    return [
        "validate",
        "--model",
        model,
        "--spec",
        spec,
        "--candidates",
        str(k),
        "--claim",
        SHIPPED[spec].relation,
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


def result_path(args, model: str, spec: str, suffix: str = "") -> Path:
    return Path(args.out_dir) / f"validation_chain_{model}_{spec}{suffix}.json"


def run(model: str, specs, args) -> None:
    from core.cli import main
    from core.files.atomic import write_text_atomic
    from core.zoo.random_weights import randomize_folder

    for spec in specs:
        if main(command(model, spec, result_path(args, model, spec), args, args.k)) != 0:
            raise SystemExit(f"validate failed on {model} ({spec})")
    with tempfile.TemporaryDirectory() as tmp:
        folder = randomize_folder(model, Path(tmp) / f"{model}-random", seed=args.seed)
        for spec in specs:
            random = result_path(args, model, spec, "_random")
            if main(command(str(folder), spec, random, args, max(args.k, 5))) != 0:
                raise SystemExit(f"validate failed on the random copy of {model} ({spec})")
            doc = json.loads(random.read_text())
            doc["model"]["folder_as_run"] = doc["model"]["spec"]  # a temporary folder: named for what it held
            doc["model"]["spec"] = f"{model} with random weights (core.zoo.random_weights, seed {args.seed})"
            write_text_atomic(random, json.dumps(doc, allow_nan=False) + "\n")  # the folder's path means nothing
            supported = [v["subject"] for v in doc["verdicts"] if v["supported"]]
            heads = [c for c in doc["chains"] if c["subject_kind"] == "head"]
            if supported or len(heads) < 5:
                raise SystemExit(f"negative control failed on {model} ({spec}): {supported or 'fewer than 5 heads'}")


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
    step4 = result["chains"][0]["steps"]["4"]["numbers"] if result["chains"] else {}
    heads = sum(c["subject_kind"] == "head" for c in result["chains"])
    return (
        f"{result['model']['spec']}, {result['specification']['name']} (fingerprint "
        f"{result['model']['fingerprint']}; n={result['heldout']['n_samples']} at the {result['heldout']['query']}; "
        f"{len(step4.get('pairs', []))} inputs admitted step 4's counterfactual; {heads} heads; {result['seconds']} s)"
    )


def compare_with(rev: str, args) -> None:
    """Print how far each attribute-moving run is from the one-relation chain's JSON at commit
    ``rev`` (``validation_chain_<model>[_random].json`` there): chains whose status differs, and
    the largest relative difference of any step's value over the chains both have."""
    import subprocess

    for model in args.models:
        for suffix in ("", "_random"):
            shown = subprocess.run(
                ["git", "show", f"{rev}:bench/results/validation_chain_{model}{suffix}.json"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            )
            old = {c["subject"]: c for c in json.loads(shown.stdout)["chains"]}
            new = json.loads(result_path(args, model, "attribute-moving", suffix).read_text())["chains"]
            worst, differ, common = 0.0, [], [c for c in new if c["subject"] in old]
            for c in common:
                o = old[c["subject"]]
                differ += [c["subject"]] if o["status"] != c["status"] else []
                for k, step in c["steps"].items():
                    a, b = o["steps"][k]["value"], step["value"]
                    if a is not None and b is not None:
                        worst = max(worst, abs(a - b) / max(abs(a), 1e-12))
            print(
                f"{model}{suffix}: {len(common)} chains in both ({len(new) - len(common)} new), status differs: "
                f"{differ or 'none'}, largest relative difference of a step's value {worst:.1g}"
            )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["shapes-coca", "shapes-llava"])
    p.add_argument("--specs", nargs="+", default=list(SPECS), choices=SPECS)
    p.add_argument("--n", type=int, default=150, help="attribute scenes of each split")
    p.add_argument("--n-side", type=int, default=50, help="scenes of each other question kind (step 7)")
    p.add_argument(
        "--k",
        type=int,
        default=3,
        help="candidates on the search set (+ the top attention head); >= 5 on random weights",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--markdown", action="store_true", help="print the README tables")
    p.add_argument("--from-results", action="store_true", help="only print the tables of the JSON already written")
    p.add_argument("--compare-with", metavar="REV", help="compare attribute-moving with the one-relation run at REV")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    for model in args.models:
        if not args.from_results:
            run(model, args.specs, args)
    if args.compare_with:
        compare_with(args.compare_with, args)
    if args.markdown:
        for spec in args.specs:
            for model in args.models:
                for suffix in ("", "_random"):
                    result = json.loads(result_path(args, model, spec, suffix).read_text())
                    print(f"\n{header(result)}:\n\n{markdown(result)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
