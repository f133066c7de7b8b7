"""Replay the fuzzer's seed corpus and its crash regressions through the
harness's own TestOneInput (no atheris needed): no input may raise anything
but ImageLoadError, and none may take long."""

import time
from pathlib import Path

import pytest

from tests.fuzz.fuzz_load_image import TestOneInput
from tests.fuzz.make_corpus import hostile, well_formed

CORPUS = Path(__file__).parent / "corpus" / "load_image"
FILES = sorted(p for p in CORPUS.iterdir() if p.is_file())


def test_corpus_is_small_and_complete():
    names = {p.name for p in FILES}
    assert set(well_formed()) | set(hostile()) <= names, "re-run tests/fuzz/make_corpus.py"
    assert sum(p.stat().st_size for p in FILES) < 200_000


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_corpus_input(path):
    start = time.perf_counter()
    TestOneInput(path.read_bytes())
    assert time.perf_counter() - start < 5.0, "one small input must not take seconds"
