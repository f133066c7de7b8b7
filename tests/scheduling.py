"""The order in which ``make test``'s two workers take the test files
(``-n 2 --dist loadfile``, each file whole in one worker): the worker that asks
for work gets the longest file left, so the two end together. xdist's own
order (most tests first) left long files of few tests for last, one worker
running them alone while the other had finished.

A file's length is its seconds in tests/file_seconds.json (setup, call and
teardown summed over a recent run, written by ``bench/suite_seconds.py
--write``); a file the record does not know counts its tests times the
record's seconds per test. A stale record only costs balance, never a test."""

from __future__ import annotations

import json
from pathlib import Path

from xdist.scheduler import LoadFileScheduling

RECORD = Path(__file__).with_name("file_seconds.json")


def read_record(path: Path = RECORD) -> dict[str, dict]:
    """``{file: {"seconds", "tests"}}`` (empty without a readable record)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


class LongestFileFirst(LoadFileScheduling):
    def __init__(self, config, log=None, record: dict[str, dict] | None = None):
        super().__init__(config, log)
        self.record = read_record() if record is None else record
        tests = sum(f["tests"] for f in self.record.values())
        self.seconds_per_test = sum(f["seconds"] for f in self.record.values()) / tests if tests else 0.0

    def seconds(self, file: str) -> float:
        """How long ``file`` (a work unit still queued) is expected to take."""
        known = self.record.get(file)
        return known["seconds"] if known else self.seconds_per_test * len(self.workqueue[file])

    def _assign_work_unit(self, node) -> None:
        # xdist hands out the queue's first unit: put the longest there.
        self.workqueue.move_to_end(max(self.workqueue, key=self.seconds), last=False)
        super()._assign_work_unit(node)
