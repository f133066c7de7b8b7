"""Replay the reader fuzzers' seed corpora and their findings (generate JSON,
tuned-lens folder, pairs file) through each harness's own TestOneInput (no
atheris needed): no input may raise anything but the reader's one-line
ReadoutError naming the input, and none may take long."""

import importlib
import time
from pathlib import Path

import pytest

from tests.fuzz import reader_corpus

READERS = ("generation", "lens", "pairs")
CORPORA = Path(__file__).parent / "corpus"


def _files(reader: str) -> list[Path]:
    return sorted(p for p in (CORPORA / reader).iterdir() if p.is_file())


@pytest.mark.parametrize("reader", READERS)
def test_corpus_is_small_and_complete(reader):
    seeds = getattr(reader_corpus, f"{reader}_seeds")()
    assert set(seeds) <= {p.name for p in _files(reader)}, "re-run tests/fuzz/reader_corpus.py"
    assert sum(p.stat().st_size for p in _files(reader)) < 100_000


@pytest.mark.parametrize(
    ("reader", "path"), [(r, p) for r in READERS for p in _files(r)], ids=lambda x: getattr(x, "name", x)
)
def test_corpus_input(reader, path):
    harness = importlib.import_module(f"tests.fuzz.fuzz_{reader}")
    harness.TestOneInput(path.read_bytes())  # a model loads on the first accepted input: time the second run
    start = time.perf_counter()
    harness.TestOneInput(path.read_bytes())
    assert time.perf_counter() - start < 5.0, "one small input must not take seconds"
