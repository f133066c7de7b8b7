"""Coverage-guided fuzzing of :func:`core.files.images.load_image` with atheris.

Run (see tests/fuzz/README.md)::

    .venv/bin/python tests/fuzz/fuzz_load_image.py tests/fuzz/corpus/load_image \\
        -max_total_time=660 -max_len=16384 -rss_limit_mb=3072 -timeout=20

A finding is any exception other than ImageLoadError, an ImageLoadError whose
message is not one line naming the input, or an accepted image that breaks the
limits load_image promises. libFuzzer's -rss_limit_mb and -timeout bound memory
and time per input. The suite replays the corpus through the same
:func:`TestOneInput` without atheris (tests/fuzz/test_fuzz_corpus.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `core` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

NAME = "image bytes"  # what load_image calls bytes it was given


def TestOneInput(data: bytes) -> None:
    """Feed ``data`` to load_image; raise AssertionError (or let any other
    exception through) on a finding."""
    from core.errors import ImageLoadError
    from core.files.images import MAX_ASPECT_RATIO, MAX_PIXELS, load_image

    try:
        img = load_image(data)
    except ImageLoadError as e:
        message = str(e)
        assert "\n" not in message and message.startswith(f"{NAME}: "), f"bad error message: {message!r}"
        return
    w, h = img.size
    assert img.mode == "RGB", img.mode
    assert 0 < w * h <= MAX_PIXELS and max(w, h) <= MAX_ASPECT_RATIO * min(w, h), img.size


def main() -> None:
    import warnings

    import atheris

    # Pillow warns "Corrupt EXIF data" on every other input; load_image still turns bomb warnings into errors.
    warnings.simplefilter("ignore")

    # Instrument Pillow (all its plugins, imported now) and the loader; not torch,
    # which `core` imports on the way.
    with atheris.instrument_imports(include=["PIL", "core.files.images"]):
        from PIL import Image

        import core.files.images  # noqa: F401

        Image.init()
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
