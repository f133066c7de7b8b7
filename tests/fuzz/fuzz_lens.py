"""Coverage-guided fuzzing of the tuned-lens folder reader,
:func:`core.methods.tuned_lens.store.load_lens`.

One input is a whole lens folder (:func:`pack`): a 4-byte little-endian
length N, N bytes of ``lens.json``, then the bytes of ``lens.safetensors``.

Run (see tests/fuzz/README.md)::

    mkdir -p /tmp/fuzz-lens
    .venv/bin/python tests/fuzz/fuzz_lens.py /tmp/fuzz-lens tests/fuzz/corpus/lens \\
        -max_total_time=600 -rss_limit_mb=3072 -timeout=20 -artifact_prefix=/tmp/fuzz-lens/

A finding is any exception other than LensError, a message that is not one
line starting with the folder's name, or an accepted lens whose tensors break
what the loader promises (the config's shapes, floating point, finite). The
suite replays the corpus through the same :func:`TestOneInput` without
atheris (tests/fuzz/test_fuzz_readers.py).
"""

from __future__ import annotations

import struct
import sys
import tempfile
from functools import cache
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `core` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def pack(config: bytes, tensors: bytes) -> bytes:
    """One fuzz input of a lens folder's two files."""
    return struct.pack("<I", len(config)) + config + tensors


def unpack(data: bytes) -> tuple[bytes, bytes]:
    """``(lens.json, lens.safetensors)`` of an input (any bytes: a short or
    lying length takes what there is)."""
    n = struct.unpack("<I", data[:4].ljust(4, b"\0"))[0]
    return data[4 : 4 + n], data[4 + n :]


@cache
def _folder() -> Path:
    """The lens folder every input is written to (one per process)."""
    return Path(tempfile.mkdtemp(prefix="fuzz-lens-"))


def TestOneInput(data: bytes) -> None:
    """Write ``data`` as a lens folder and load it; raise AssertionError (or
    let any other exception through) on a finding."""
    import torch

    from core.methods.tuned_lens.lens import LensError
    from core.methods.tuned_lens.store import LENS_CONFIG, LENS_TENSORS, load_lens

    folder = _folder()
    config, tensors = unpack(data)
    (folder / LENS_CONFIG).write_bytes(config)
    (folder / LENS_TENSORS).write_bytes(tensors)
    try:
        lens = load_lens(folder)
    except LensError as e:
        message = str(e)
        assert "\n" not in message and message.startswith(f"{folder}"), f"bad error message: {message!r}"
        return
    assert 1 <= lens.n_blocks and 1 <= lens.d_model, (lens.n_blocks, lens.d_model)
    for name, t in lens.state_dict().items():
        assert t.device.type == "cpu" and t.is_floating_point() and bool(torch.isfinite(t).all()), name
    assert tuple(lens.mean.shape) == (lens.n_blocks + 1, lens.d_model)
    x = torch.zeros(1, 2, lens.d_model, dtype=lens.mean.dtype)
    assert lens.translate_all(x.expand(lens.n_blocks, 2, lens.d_model)).shape == (lens.n_blocks, 2, lens.d_model)


def main() -> None:
    import atheris

    with atheris.instrument_imports(
        include=["core.methods.tuned_lens.store", "core.files.json_fields", "core.files.input_files"]
    ):
        import core.files.input_files  # noqa: F401
        import core.files.json_fields  # noqa: F401
        import core.methods.tuned_lens.store  # noqa: F401
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
