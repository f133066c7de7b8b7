"""Start-up cost of the ``vlm-readout`` command line, before and after a change.

    python bench/startup.py [--before REV] [--repeats N] [--json bench/results/startup.json]

Two parts:

* **Commands** (fresh processes, wall time, median of ``--repeats``): one
  ``answer`` on shapes-llava (the issue's example), ``answer --top-k 0`` (a
  refused option), ``export --help`` and ``--help``, each run from this tree
  ("after") and from ``git archive REV`` of ``core/`` ("before"), alternating
  before / after run by run so load drifts on a shared machine hit both alike.
  Every command is also run with the ``core`` package stubbed (its
  ``__init__`` not executed): what the command itself imports, i.e. what it
  costs once ``core/__init__.py`` stops importing torch eagerly.
* **Break-down** of one ``answer`` in one fresh process of this tree, phase by
  phase: imports (torch, transformers, torchvision as transformers pulls it
  in), building the parser, loading the model (config, weights, processor),
  the first answer (processor + forward) and a second one.

Ratios are the comparable numbers; seconds move with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "resources" / "samples" / "sample_00.png"
QUESTION = "what shape is the blue object?"
COMMANDS = {
    "answer (shapes-llava, one pair)": [
        "answer",
        "--model",
        "shapes-llava",
        "--image",
        str(IMAGE),
        "--question",
        QUESTION,
    ],
    "answer --top-k 0 (refused)": ["answer", "--top-k", "0", "--image", str(IMAGE), "--question", QUESTION],
    "export --help": ["export", "--help"],
    "--help": ["--help"],
}
# Runs core.cli.main with the core package stubbed: core/__init__.py (which imports torch) is not executed.
STUB = (
    "import sys, types; stub = types.ModuleType('core'); stub.__path__ = [sys.argv[1] + '/core']; "
    "sys.modules['core'] = stub; import core.cli; sys.exit(core.cli.main(sys.argv[2:]))"
)
PHASES = """
import sys, time, json
t = [time.perf_counter()]
def mark(name):
    t.append(time.perf_counter()); phases.append((name, t[-1] - t[-2]))
phases = []
import torch; mark("import torch")
import transformers; mark("import transformers")
import transformers.image_utils; mark("transformers.image_utils (pulls in torchvision, torch._dynamo)")
import core.cli; mark("import core.cli (core/__init__: core.answer, core.forward.capture, loading)")
args = core.cli.build_parser().parse_args(sys.argv[1:]); mark("build the parser, parse")
from core.files.images import load_image
image = load_image(args.image); mark("load the image")
loaded = core.cli._load(args); mark("load_model (config, weights, processor; HF modules it imports)")
from core.answer import answer
answer(loaded, image, args.question, top_k=args.top_k); mark("first answer (processor + forward)")
answer(loaded, image, args.question, top_k=args.top_k); mark("second answer (warm)")
print(json.dumps(phases))
"""


def _before_tree(rev: str, into: Path) -> Path:
    """``core/`` as committed at ``rev`` (read with ``git archive``; the work tree is untouched)."""
    data = subprocess.run(["git", "archive", rev, "core"], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def _run(tree: Path, argv: list[str], stub: bool) -> tuple[float, int]:
    cmd = [sys.executable, "-c", STUB, str(tree), *argv] if stub else [sys.executable, "-m", "core.cli", *argv]
    env = {**os.environ, "VLM_READOUT_RESOURCES": str(ROOT / "resources"), "PYTHONPATH": str(tree)}
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True)
    return time.perf_counter() - t, r.returncode


def commands(before: Path, repeats: int) -> list[dict]:
    rows = []
    for name, argv in COMMANDS.items():
        for stub in (False, True):
            times = {"before": [], "after": []}
            codes = {}
            for _ in range(repeats):
                for label, tree in (("before", before), ("after", ROOT)):
                    seconds, codes[label] = _run(tree, argv, stub)
                    times[label].append(seconds)
            b, a = statistics.median(times["before"]), statistics.median(times["after"])
            rows.append(
                {
                    "command": name,
                    "core package": "stubbed (lazy core/__init__)" if stub else "as is",
                    "before_s": round(b, 3),
                    "after_s": round(a, 3),
                    "after / before": round(a / b, 3),
                    "exit before": codes["before"],
                    "exit after": codes["after"],
                }
            )
            print(rows[-1], file=sys.stderr)
    return rows


def breakdown() -> list[dict]:
    argv = ["answer", "--model", "shapes-llava", "--image", str(IMAGE), "--question", QUESTION]
    r = subprocess.run([sys.executable, "-c", PHASES, *argv], cwd=ROOT, capture_output=True, text=True, check=True)
    phases = json.loads(r.stdout.strip().splitlines()[-1])
    total = sum(s for _, s in phases)
    return [{"phase": n, "seconds": round(s, 3), "share": round(s / total, 3)} for n, s in phases]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="HEAD", help="the revision to compare with (default HEAD)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="startup-before-") as tmp:
        rows = commands(_before_tree(a.before, Path(tmp)), a.repeats)
    phases = breakdown()
    print("| command | core package | before s | after s | after / before | exit before -> after |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['command']} | {r['core package']} | {r['before_s']} | {r['after_s']} | {r['after / before']} | "
            f"{r['exit before']} -> {r['exit after']} |"
        )
    print("\n| phase (one answer, this tree) | s | share |\n|---|---|---|")
    for ph in phases:
        print(f"| {ph['phase']} | {ph['seconds']} | {ph['share']:.0%} |")
    if a.json:
        rev = subprocess.run(["git", "rev-parse", "--short", a.before], cwd=ROOT, capture_output=True, text=True)
        doc = {"before": rev.stdout.strip() or a.before, "repeats": a.repeats, "commands": rows, "breakdown": phases}
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
