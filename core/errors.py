"""Typed errors. Each carries a one-line message meant for the user: the CLI
prints it and exits non-zero, the app shows it in the window."""

from __future__ import annotations


class ReadoutError(Exception):
    """Base class of every error the engine raises on purpose."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always one line


class ImageLoadError(ReadoutError):
    """The file is not an image we can read safely."""


class ModelLoadError(ReadoutError):
    """The model folder, name or weights cannot be loaded."""


class UnsupportedArchitectureError(ModelLoadError):
    """No adapter is registered for this architecture."""


class UnsafeCheckpointError(ModelLoadError):
    """Loading would run code (pickle, remote code) and the user did not opt in."""


class ModelTooLargeError(ModelLoadError):
    """The model, or a read-out of it, would not fit in the memory available:
    refused before anything is allocated (core/models/memory.py), naming both
    figures and the dtype that would fit."""


class QuestionError(ReadoutError):
    """The question does not fit the model (too long, unknown words)."""


class OutOfMemoryError(ReadoutError):
    """The run did not fit in memory; nothing was recorded."""


class oom_guard:
    """Turn an allocator failure inside the block into :class:`OutOfMemoryError`
    with a one-line hint (GPU and CPU allocators fail differently)."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            return False
        import torch

        text = str(exc)
        if isinstance(exc, torch.OutOfMemoryError) or (
            isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)
        ):
            raise OutOfMemoryError(
                f"out of memory while {self.what}; try a smaller batch, fewer kept layers/positions, "
                "or a lower-precision dtype"
            ) from None
        return False


class InterventionError(ReadoutError, ValueError):
    """An edit (ablation, patch, knockout) that cannot be applied as asked: a
    site the family does not have, positions out of range, a value of the wrong
    shape. Also a ValueError, so callers that caught bad edits as ValueError
    keep working."""


class UndefinedReadoutError(ReadoutError, ValueError):
    """A read-out that has no meaning for this architecture, refused instead of
    printed: an attention pattern of a layer that computes none (linear attention,
    a short convolution), a residual decomposition of a stream that is not a sum
    of writes (Gemma 3n's AltUp). The message names the layer or stream and why."""


class OutputError(ReadoutError):
    """An output file or folder cannot be written where asked (read-only or
    full disk, a parent that is a file, a target that is a folder, a FIFO, a
    device or a symbolic link). The old file, if any, is left as it was."""


class InputFileError(ReadoutError):
    """An input file (a JSONL of pairs or samples) cannot be read or has a bad
    line: the message names the file, the line number and the field."""


class NonFiniteError(ReadoutError):
    """A forward gave NaN or Inf logits where a read-out reads them: never shown
    as a result (the message names the model; its config or weights are broken)."""
