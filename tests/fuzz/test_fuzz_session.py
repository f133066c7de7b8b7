"""Replay the session fuzzer's seed corpus and its regressions through the
harness's own TestOneInput (no atheris needed): every input is exported in
every format and recorded into, and none may raise anything but ReadoutError,
print a message that is not one line naming the file or run, change the
session's folder by exporting, or take long."""

import time
from pathlib import Path

import pytest

from tests.fuzz.fuzz_session import CORPUS, TestOneInput, seeds

FILES = sorted(p for p in CORPUS.iterdir() if p.is_file())


def test_corpus_is_small_and_complete():
    assert set(seeds()) <= {p.name for p in FILES}, "re-run tests/fuzz/fuzz_session.py --write-corpus"
    assert sum(p.stat().st_size for p in FILES) < 200_000


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_corpus_input(path: Path):
    start = time.perf_counter()
    TestOneInput(path.read_bytes())
    assert time.perf_counter() - start < 10.0, "one small input must not take seconds"
