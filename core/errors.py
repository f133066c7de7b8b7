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


class QuestionError(ReadoutError):
    """The question does not fit the model (too long, unknown words)."""
