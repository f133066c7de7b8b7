"""How many assertions the suite executes: passing ``assert`` statements
(pytest's assertion-pass hook) and ``pytest.raises`` / ``pytest.warns`` blocks
entered, over a whole run of the suite. Static counts of ``assert`` in the
source fall when copies become one parametrised test; this counts what runs.

    python bench/assertion_count.py [--rev REV] [--json OUT] [pytest args...]

``--rev`` checks REV out into a temporary git worktree (deleted afterwards)
and runs its suite with this interpreter, so two revisions can be compared
(the numbers in issue 12's note: ``--rev 996ca83`` against HEAD).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COUNTS = {"asserts": 0, "raises": 0}


# ---------------------------------------------------------------- the plugin (loaded with -p assertion_count)


def pytest_assertion_pass(item, lineno, orig, expl):
    COUNTS["asserts"] += 1


def pytest_configure(config):
    for name in ("raises", "warns"):
        original = getattr(pytest, name)

        def counted(*args, __original=original, **kwargs):
            COUNTS["raises"] += 1
            return __original(*args, **kwargs)

        setattr(pytest, name, counted)


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("ASSERTION_COUNT_OUT")
    if out:
        Path(out).write_text(json.dumps({**COUNTS, "exit_status": int(exitstatus)}))


# ---------------------------------------------------------------- the runner


def count(tree: Path, pytest_args: list[str]) -> dict:
    """Run ``tree``'s suite with the plugin; the counts and pytest's exit status."""
    for pyc in (tree / "tests").rglob("*.pyc"):  # rewritten without the pass hook: rewrite again
        pyc.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "counts.json"
        env = {
            **os.environ,
            "PYTHONPATH": str(Path(__file__).resolve().parent),
            "PYTHONDONTWRITEBYTECODE": "1",
            "QT_QPA_PLATFORM": "offscreen",
            "ASSERTION_COUNT_OUT": str(out),
        }
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "assertion_count"]
        cmd += ["-o", "enable_assertion_pass_hook=true", *pytest_args]
        subprocess.run(cmd, cwd=tree, env=env, check=False)
        return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rev", help="count this revision's suite (a temporary worktree) instead of this tree's")
    p.add_argument("--json", type=Path, help="write the counts here")
    args, pytest_args = p.parse_known_args()
    if args.rev:
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp) / "tree"
            subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), args.rev], cwd=ROOT, check=True)
            try:
                counts = count(tree, pytest_args)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    else:
        counts = count(ROOT, pytest_args)
    counts["revision"] = args.rev or "working tree"
    print(json.dumps(counts))
    if args.json:
        args.json.write_text(json.dumps(counts, indent=1) + "\n")
    return 0 if counts["exit_status"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
