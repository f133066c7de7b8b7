"""VLM Readout engine: load a vision-language model, run it, read it out.

The engine never imports Qt. Public names: :func:`load_model`,
:func:`load_image`, :func:`answer`, :func:`answer_batch`, :func:`capture`
(``core.capture`` is the function; the module's other names are imported
``from core.capture import Trace``).
"""

from core.answer import Answer, answer, answer_batch
from core.capture import Trace, capture
from core.errors import (
    ImageLoadError,
    ModelLoadError,
    OutOfMemoryError,
    QuestionError,
    ReadoutError,
    UnsafeCheckpointError,
    UnsupportedArchitectureError,
)
from core.images import load_image
from core.models.loading import LoadedModel, load_model

__version__ = "0.1.0"

__all__ = [
    "Answer",
    "ImageLoadError",
    "LoadedModel",
    "ModelLoadError",
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
