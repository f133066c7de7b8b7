"""What keeps ``make test`` short: its two workers take the longest test file left
(tests/scheduling.py, driven here through xdist's own scheduler calls with two
stand-in workers), and a passing test's tmp_path goes at its teardown."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from xdist.scheduler import LoadFileScheduling

from tests.conftest import pytest_xdist_make_scheduler
from tests.scheduling import RECORD, LongestFileFirst, read_record

# Six files: "many.py" has the most tests and is short; "long.py" has the fewest and is longest.
FILES = {"many.py": 9, "long.py": 2, "mid.py": 3, "short.py": 4, "new.py": 5, "tiny.py": 1}
RECORD_OF = {
    "many.py": {"seconds": 1.0, "tests": 9},
    "long.py": {"seconds": 60.0, "tests": 2},
    "mid.py": {"seconds": 20.0, "tests": 3},
    "short.py": {"seconds": 2.0, "tests": 4},
    "tiny.py": {"seconds": 7.0, "tests": 1},
}  # 90 s over 19 tests: new.py, unknown, counts 5 x 90/19 = 23.7 s


class Worker:
    """What the scheduler calls on a worker: the tests it is sent, in order, also noted in
    ``handed`` (every worker's, in the order they were sent)."""

    def __init__(self, name: str, handed: list[int]):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []
        self.handed = handed

    def send_runtest_some(self, indexes):
        self.sent += indexes
        self.handed += indexes

    def shutdown(self):
        self.shutting_down = True


def _config(dist: str = "loadfile"):
    return SimpleNamespace(
        getvalue={"tx": ["2*popen"]}.get, getoption={"dist": dist}.get, option=SimpleNamespace(loadscopereorder=True)
    )


def _files_in_the_order_handed_out(scheduler) -> list[str]:
    """Schedule the collection and run it, each busy worker finishing one test a round; the
    files in the order the scheduler handed them out."""
    collection = [f"{file}::test_{i}" for file, n in FILES.items() for i in range(n)]
    handed: list[int] = []
    workers = [Worker("gw0", handed), Worker("gw1", handed)]
    for w in workers:
        scheduler.add_node(w)
        scheduler.add_node_collection(w, collection)
    scheduler.schedule()
    done = dict.fromkeys(workers, 0)
    while busy := [w for w in workers if done[w] < len(w.sent)]:
        for w in busy:
            scheduler.mark_test_complete(w, w.sent[done[w]])
            done[w] += 1
    assert sorted(handed) == list(range(len(collection)))  # each test once
    assert all(w.shutting_down for w in workers)
    return list(dict.fromkeys(collection[i].split("::")[0] for i in handed))


def test_the_longest_file_left_goes_first():
    order = _files_in_the_order_handed_out(LongestFileFirst(_config(), record=RECORD_OF))
    assert order == ["long.py", "new.py", "mid.py", "tiny.py", "short.py", "many.py"]


def test_xdist_alone_hands_out_the_most_tests_first():
    """What the scheduler changes: xdist's order leaves the longest file for near the end."""
    order = _files_in_the_order_handed_out(LoadFileScheduling(_config()))
    assert order == ["many.py", "new.py", "short.py", "mid.py", "long.py", "tiny.py"]


def test_without_a_record_every_file_counts_nothing_and_xdist_order_stands():
    order = _files_in_the_order_handed_out(LongestFileFirst(_config(), record={}))
    assert order == ["many.py", "new.py", "short.py", "mid.py", "long.py", "tiny.py"]


def test_the_record_reads_and_names_files_as_pytest_does(tmp_path):
    record = read_record(RECORD)
    assert record and all(f.startswith("tests/") and f.endswith(".py") for f in record)
    assert all(v["seconds"] >= 0 and v["tests"] > 0 for v in record.values())
    assert read_record(tmp_path / "missing.json") == {}
    (tmp_path / "bad.json").write_text("{")
    assert read_record(tmp_path / "bad.json") == {}


def test_make_test_schedules_with_it_and_other_modes_keep_xdists():
    assert "-n 2 --dist loadfile" in (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    assert isinstance(pytest_xdist_make_scheduler(_config("loadfile"), None), LongestFileFirst)
    assert pytest_xdist_make_scheduler(_config("load"), None) is None
    assert pytest_xdist_make_scheduler(_config("loadgroup"), None) is None


def test_a_passing_tests_tmp_path_goes_at_its_teardown(request):
    """Removed while its files are in the page cache, not flushed and unlinked sessions later."""
    assert request.config.getini("tmp_path_retention_policy") == "failed"
