"""Where the suite's time goes: each test file's seconds and when each worker finished.

    python bench/suite_seconds.py [--write] [--json OUT] [pytest args...]

runs the suite as ``make test`` does (``-n 2 --dist loadfile``; pass other
pytest arguments after these options, paths included) and prints the wall
time, each worker's busy seconds and last finish, and the slowest files.
``--write`` merges each file's seconds (setup, call and teardown summed) and
test count into tests/file_seconds.json (dropping files that are gone), from
which tests/scheduling.py hands the longest file left to the worker that asks:
rerun it when files have grown or moved. Timings on a shared machine are
noisy; the record only orders the files, it never decides what runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "tests" / "file_seconds.json"
MAKE_TEST = ["-n", "2", "--dist", "loadfile"]

FILES: dict[str, dict] = {}  # file -> {"seconds", "tests"}
WORKERS: dict[str, dict] = {}  # worker -> {"busy", "last"} (seconds since the session started)
STARTED = time.monotonic()


# ---------------------------------------------------------------- the plugin (loaded with -p suite_seconds)


def pytest_runtest_logreport(report):
    file = report.nodeid.split("::", 1)[0]
    entry = FILES.setdefault(file, {"seconds": 0.0, "tests": 0})
    entry["seconds"] += report.duration
    entry["tests"] += report.when == "setup"
    node = getattr(report, "node", None)  # the worker that ran it (in the controller of -n)
    worker = WORKERS.setdefault(node.gateway.id if node is not None else "main", {"busy": 0.0, "last": 0.0})
    worker["busy"] += report.duration
    worker["last"] = time.monotonic() - STARTED


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("SUITE_SECONDS_OUT")
    if out and not hasattr(session.config, "workerinput"):  # the controller holds every worker's reports
        doc = {"files": FILES, "workers": WORKERS, "exit_status": int(exitstatus)}
        Path(out).write_text(json.dumps(doc))


# ---------------------------------------------------------------- the runner


def run(pytest_args: list[str]) -> dict:
    """Run the suite with the plugin: per-file seconds, per-worker times, wall seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "seconds.json"
        env = {
            **os.environ,
            "PYTHONPATH": str(Path(__file__).resolve().parent),
            "QT_QPA_PLATFORM": "offscreen",
            "SUITE_SECONDS_OUT": str(out),
        }
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_seconds", *pytest_args]
        start = time.monotonic()
        subprocess.run(cmd, cwd=ROOT, env=env, check=False)
        doc = json.loads(out.read_text())
        doc["wall_seconds"] = time.monotonic() - start
        return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help=f"merge the files' seconds into {RECORD.relative_to(ROOT)}")
    p.add_argument("--json", type=Path, help="write the measurement here")
    args, pytest_args = p.parse_known_args()
    doc = run([*MAKE_TEST, *pytest_args])
    files = {f: {"seconds": round(v["seconds"], 2), "tests": v["tests"]} for f, v in sorted(doc["files"].items())}
    print(f"wall {doc['wall_seconds']:.1f} s, exit status {doc['exit_status']}")
    for worker, w in sorted(doc["workers"].items()):
        print(f"  {worker}: busy {w['busy']:.1f} s, last test ended at {w['last']:.1f} s")
    for f, v in sorted(files.items(), key=lambda kv: -kv[1]["seconds"])[:15]:
        print(f"  {v['seconds']:7.1f} s  {v['tests']:4d} tests  {f}")
    if args.json:
        args.json.write_text(json.dumps({**doc, "files": files}, indent=1) + "\n")
    if args.write:
        record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
        record = {f: v for f, v in record.items() if (ROOT / f).is_file()}
        record.update(files)
        lines = [f"  {json.dumps(f)}: {json.dumps(v)}" for f, v in sorted(record.items())]  # a file a line
        RECORD.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    return 0 if doc["exit_status"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
