"""Coverage-guided fuzzing of the generate-JSON reader (``--answer-from``):
:func:`core.generate.read_generation` and, for a file it accepts,
:func:`core.generate.check_generation` against shapes-llava, the question and
the image the seeds were generated for.

Run (see tests/fuzz/README.md)::

    mkdir -p /tmp/fuzz-generation
    .venv/bin/python tests/fuzz/fuzz_generation.py /tmp/fuzz-generation tests/fuzz/corpus/generation \\
        -max_total_time=600 -rss_limit_mb=3072 -timeout=20 -artifact_prefix=/tmp/fuzz-generation/

A finding is any exception other than InputFileError, a message that is not
one line starting with the file's name, or an accepted generation whose ids
the model could not be fed. The suite replays the corpus through the same
:func:`TestOneInput` without atheris (tests/fuzz/test_fuzz_readers.py).
"""

from __future__ import annotations

import sys
import tempfile
from functools import cache
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `core` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

QUESTION = "what shape is the blue object?"  # what the seeds were generated for
IMAGE = "sample_00.png"


@cache
def _target() -> Path:
    """The file every input is written to (one folder per process)."""
    return Path(tempfile.mkdtemp(prefix="fuzz-generation-")) / "generation.json"


@cache
def _model_and_image():
    from core import load_model
    from core.files.images import image_sha256, load_image
    from core.models.loading import resources_dir

    return load_model("shapes-llava"), image_sha256(load_image(resources_dir() / "samples" / IMAGE))


def TestOneInput(data: bytes) -> None:
    """Write ``data`` where ``--answer-from`` reads it and read it back;
    raise AssertionError (or let any other exception through) on a finding."""
    from core.errors import InputFileError
    from core.generate import check_generation, read_generation

    path = _target()
    path.write_bytes(data)
    name = str(path)
    try:
        generation = read_generation(path)
        loaded, sha = _model_and_image()
        check_generation(generation, loaded, name, question=QUESTION, image_sha256=sha)
    except InputFileError as e:
        message = str(e)
        assert "\n" not in message and message.startswith(f"{name}: "), f"bad error message: {message!r}"
        return
    vocab = int(loaded.adapter.W_U.shape[-1])
    assert generation.token_ids and all(0 <= i < vocab for i in generation.token_ids), generation.token_ids
    assert len(generation.tokens) == len(generation.token_ids) == len(generation.probs) == len(generation.top)
    generation.answer_text(len(generation.token_ids) - 1)  # every token can be read out


def main() -> None:
    import atheris

    # the reader's modules instrumented (imported here first), not torch or the model's code
    with atheris.instrument_imports(include=["core.generate", "core.files.json_fields", "core.files.input_files"]):
        import core.files.input_files  # noqa: F401
        import core.files.json_fields  # noqa: F401
        import core.generate  # noqa: F401
    _model_and_image()  # loaded once, before the run
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
