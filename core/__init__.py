"""VLM Readout engine: load a vision-language model, run it, read it out.

The engine never imports Qt. Public names: :func:`load_model`,
:func:`load_image`, :func:`answer`, :func:`answer_batch`, :func:`capture`
(``core.answer`` is both the module and, called, its function: core/shell/lazy.py).

The folders are the layers (docs/ARCHITECTURE.md, "Layout"): ``shell`` (the
process: arguments, terminal, network switches, lazy names, dtypes), ``files``
(what is read and written, checked), ``models`` (loading, the adapter, the
families), ``forward`` (one run of the model with hooks and edits: the capture),
``methods`` (the read-outs' mathematics), ``results`` (the result vocabulary and
audit rows), ``readouts`` (analyze's read-out registry), ``requests`` (a run asked
by the CLI or the app), ``session``, ``dataset_audit``, ``zoo``, ``cli``. At the
root: the runs on one input (analyze, answer, answer_text, generate, validate),
the image views and the export, which read across those layers, and the errors.

Names that need torch are imported when first used, so that a command whose
arguments are refused, or ``--help``, answers without importing torch (about
a second and a half; bench/startup.py).
"""

from core.errors import (
    ImageLoadError,
    ModelLoadError,
    ModelTooLargeError,
    NonFiniteError,
    OutOfMemoryError,
    QuestionError,
    ReadoutError,
    UnsafeCheckpointError,
    UnsupportedArchitectureError,
)
from core.shell.lazy import lazy_getattr

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "Answer": "core.answer",
    "answer": "core.answer",
    "answer_batch": "core.answer",
    "Trace": "core.forward.capture",
    "capture": "core.forward.capture",
    "load_image": "core.files.images",
    "LoadedModel": "core.models.loading",
    "load_model": "core.models.loading",
}


# ``core.answer`` stays its (callable) module: importing a submodule binds the package
# attribute to it (core/shell/lazy.py)
__getattr__ = lazy_getattr(__name__, _LAZY, modules=frozenset({"answer"}))


__all__ = [
    "Answer",
    "ImageLoadError",
    "LoadedModel",
    "ModelLoadError",
    "ModelTooLargeError",
    "NonFiniteError",
    "OutOfMemoryError",
    "QuestionError",
    "ReadoutError",
    "UnsafeCheckpointError",
    "UnsupportedArchitectureError",
    "answer",
    "answer_batch",
    "capture",
    "Trace",
    "load_image",
    "load_model",
]
