"""Whether every golden case's analyze JSON is bitwise what an earlier revision wrote.

    python bench/analyze_unchanged.py --rev 5078a8d [--json bench/results/analyze_unchanged.json]

checks out ``--rev`` into a temporary git worktree, runs each case of
tests/core/test_analyze_golden.py there and here (a fresh process each,
one thread), and compares the two documents value by value at full float
precision (the golden test compares rounded files within a tolerance that
holds across CPUs; this compares exactly, on one machine). For a refactor that
must not move a number (issue 26: the families as declarations).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DUMP = """
import json, os, sys
sys.path.insert(0, os.getcwd())
import torch
torch.set_num_threads(1)
from tests.core import test_analyze_golden as g
out = sys.argv[1]
for name in g.case_names():
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(g.run_case(name), f, sort_keys=True)
"""


def dump(tree: Path, out: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, "-c", DUMP, str(out)], cwd=tree, env=env, check=True)


def differences(want, got, path: str = "") -> list[str]:
    """Every place the two documents differ (NaN equals NaN)."""
    if type(want) is not type(got):
        return [f"{path}: {type(want).__name__} vs {type(got).__name__}"]
    if isinstance(want, dict):
        out = [f"{path}.{k}: only in one" for k in sorted(set(want) ^ set(got))]
        for k in sorted(set(want) & set(got)):
            out += differences(want[k], got[k], f"{path}.{k}")
        return out
    if isinstance(want, list):
        if len(want) != len(got):
            return [f"{path}: {len(want)} vs {len(got)} items"]
        return [d for i, (w, g) in enumerate(zip(want, got)) for d in differences(w, g, f"{path}[{i}]")]
    same = want == got or (isinstance(want, float) and want != want and got != got)
    return [] if same else [f"{path}: {want!r} vs {got!r}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="the earlier revision (a commit or branch)")
    parser.add_argument("--json", type=Path, help="write the summary here")
    args = parser.parse_args()
    rev = subprocess.run(["git", "rev-parse", args.rev], cwd=ROOT, capture_output=True, text=True, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        old_tree, old, new = tmp / "tree", tmp / "old", tmp / "new"
        old.mkdir(), new.mkdir()
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old_tree), args.rev], cwd=ROOT, check=True)
        try:
            dump(old_tree, old)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, check=True)
        dump(ROOT, new)
        cases = {}
        for f in sorted(new.glob("*.json")):
            before = old / f.name
            diffs = differences(json.loads(before.read_text()), json.loads(f.read_text())) if before.exists() else None
            cases[f.stem] = "new case" if diffs is None else len(diffs)
            for d in (diffs or [])[:5]:
                print(f"{f.stem}{d}")
    summary = {"revision": rev.stdout.strip(), "cases": cases}
    compared = [n for n in cases.values() if n != "new case"]
    summary["identical"] = sum(1 for n in compared if n == 0)
    print(f"{summary['identical']} of {len(compared)} cases bitwise identical to {args.rev}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if summary["identical"] == len(compared) else 1


if __name__ == "__main__":
    sys.exit(main())
