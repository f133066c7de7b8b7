"""VLM Readout engine: load a vision-language model, run it, read it out.

The engine never imports Qt. Public names: :func:`load_model`,
:func:`load_image`, :func:`answer`, :func:`answer_batch`, :func:`capture`
(``core.answer`` and ``core.capture`` are both the module and, called, its
function of that name: see core/lazy.py).

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
from core.lazy import lazy_getattr

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "Answer": "core.answer",
    "answer": "core.answer",
    "answer_batch": "core.answer",
    "Trace": "core.capture",
    "capture": "core.capture",
    "load_image": "core.images",
    "LoadedModel": "core.models.loading",
    "load_model": "core.models.loading",
}


# ``core.answer`` and ``core.capture`` stay their (callable) modules: importing a
# submodule binds the package attribute to it (core/lazy.py)
__getattr__ = lazy_getattr(__name__, _LAZY, modules=frozenset({"answer", "capture"}))


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
