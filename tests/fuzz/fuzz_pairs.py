"""Coverage-guided fuzzing of the pairs-file reader, :func:`core.files.pairs.read_pairs`
(``answer --pairs``, ``audit --dataset``, the tuned lens's corpus).

Run (see tests/fuzz/README.md)::

    mkdir -p /tmp/fuzz-pairs
    .venv/bin/python tests/fuzz/fuzz_pairs.py /tmp/fuzz-pairs tests/fuzz/corpus/pairs \\
        -max_total_time=600 -rss_limit_mb=3072 -timeout=20 -artifact_prefix=/tmp/fuzz-pairs/

A finding is any exception other than InputFileError, a message that is not
one line starting with the file's name, or an accepted pair whose fields break
what :class:`core.files.pairs.Pair` promises. The images and masks a file names are
not opened here (a fuzzed path could name any file of the machine; the image
loader has its own harness, fuzz_load_image.py). The suite replays the corpus
through the same :func:`TestOneInput` without atheris (tests/fuzz/test_fuzz_readers.py).
"""

from __future__ import annotations

import sys
import tempfile
from functools import cache
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `core` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


@cache
def _target() -> Path:
    """The file every input is written to (one folder per process)."""
    return Path(tempfile.mkdtemp(prefix="fuzz-pairs-")) / "pairs.jsonl"


def TestOneInput(data: bytes) -> None:
    """Write ``data`` as a pairs file and read it; raise AssertionError (or
    let any other exception through) on a finding."""
    from core.errors import InputFileError
    from core.files.pairs import MAX_PAIRS, read_pairs

    path = _target()
    path.write_bytes(data)
    try:
        pairs = read_pairs(path)
    except InputFileError as e:
        message = str(e)
        assert "\n" not in message and message.startswith(f"{path}"), f"bad error message: {message!r}"
        return
    assert 0 < len(pairs) <= MAX_PAIRS
    for i, p in enumerate(pairs):
        assert p.index == i and p.where == f"{path}:{p.line}", (p.index, p.where)
        assert isinstance(p.image, str) and p.image.strip() and isinstance(p.question, str) and p.question.strip()
        assert isinstance(p.image_path, Path) and "\x00" not in p.image and "\x00" not in p.question
        for value in (p.answer, p.foil, p.answer_text, p.id, p.kind, p.template):
            assert value is None or isinstance(value, str)
        assert p.answer_token_index is None or (isinstance(p.answer_token_index, int) and p.answer_text is not None)
        (p.question + (p.answer or "") + (p.foil or "") + (p.answer_text or "")).encode("utf-8")


def main() -> None:
    import atheris

    with atheris.instrument_imports(include=["core.files.pairs", "core.files.input_files", "core.files.json_fields"]):
        import core.files.input_files  # noqa: F401
        import core.files.json_fields  # noqa: F401
        import core.files.pairs  # noqa: F401
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
