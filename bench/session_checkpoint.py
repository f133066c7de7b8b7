"""What checkpointing the WAL after each recorded run costs (issue 13, item 7).

    python bench/session_checkpoint.py [--runs 60] [--json bench/results/session_checkpoint.json]

Two sessions in one process, recorded into in turn (A B A B ...: load drifts on
a shared machine hit both alike): one with ``Session.checkpoint_each_run``
(the default: ``PRAGMA wal_checkpoint(TRUNCATE)`` after each commit, so the
``.vlmr`` alone is complete), one without (the WAL grows and SQLite
checkpoints on its own every ~1000 pages). Each record is one app-sized run: a
result of ``--floats`` numbers (an analyze JSON of the default models is of
this order), one audit row, and a fresh 128 x 128 image stored as PNG. Per
record: the median and mean wall time of ``Session.record`` (both modes
include ``synchronous=FULL``'s fsync of the commit), their ratio, and what
sat in the ``-wal`` file at the end.

Ratios are the comparable numbers; milliseconds move with the machine's load
and its disk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from core.results.readout import RecordedResult
from core.session import Session


def _run(i: int, rng: np.random.Generator, n_floats: int):
    payload = rng.random(n_floats).round(6).tolist()
    audits = [{"method": "model output", "question": "q", "parameters": {"i": i}}]
    image = rng.integers(0, 256, (128, 128, 3), dtype=np.uint8)
    return RecordedResult("note", {"i": i, "payload": payload}, f"note {i}: {payload[0]:.3f}", {"i": i}, audits), image


def measure(n_runs: int, n_floats: int) -> dict:
    times: dict[str, list[float]] = {"checkpoint": [], "no checkpoint": []}
    wal_bytes = {}
    main_bytes = {}
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {}
        for mode in times:
            s = Session.create(Path(tmp) / f"{mode.replace(' ', '_')}.vlmr")
            s.checkpoint_each_run = mode == "checkpoint"
            sessions[mode] = s
        rng = np.random.default_rng(0)
        for i in range(n_runs + 2):  # the first two pairs warm up (page cache, imports)
            readout, image = _run(i, rng, n_floats)
            order = list(times) if i % 2 == 0 else list(reversed(times))
            for mode in order:
                started = time.perf_counter()
                sessions[mode].record(readout, image=image)
                if i >= 2:
                    times[mode].append(time.perf_counter() - started)
        for mode, s in sessions.items():
            wal = s.path.with_name(s.path.name + "-wal")
            wal_bytes[mode] = wal.stat().st_size if wal.exists() else 0
            main_bytes[mode] = s.path.stat().st_size
            s.close()
    rows = []
    for mode, ts in times.items():
        rows.append(
            {
                "mode": mode,
                "median_ms": round(1000 * statistics.median(ts), 3),
                "mean_ms": round(1000 * statistics.fmean(ts), 3),
                "wal_bytes_at_end": wal_bytes[mode],
                "vlmr_bytes_at_end": main_bytes[mode],
            }
        )
    with_cp, without = (statistics.median(times[m]) for m in times)
    return {
        "runs": n_runs,
        "floats_per_result": n_floats,
        "image": "128x128 RGB, a fresh one per run (stored as PNG)",
        "modes": rows,
        "checkpoint / no checkpoint (median)": round(with_cp / without, 3),
        "checkpoint cost per record ms (median difference)": round(1000 * (with_cp - without), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--floats", type=int, default=20000)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    result = measure(args.runs, args.floats)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
