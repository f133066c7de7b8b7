"""Shared by the benchmarks: time functions interleaved in one process, so
load drifts on a shared machine hit all of them alike."""

from __future__ import annotations

import time


def interleaved_times(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each run of each function, run in turn (A B C A B C ...)
    after one warm-up each."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return times
