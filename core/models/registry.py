"""Which adapter serves which architecture.

Hugging Face models are matched by ``config.architectures[0]``; open_clip
models by their model class name. Each family's adapter declares the names it
serves (``hf_architectures`` / ``open_clip_classes``, on the class itself, not
inherited); the registry imports every module of ``core.models.families`` and
reads those declarations, so adding a family is one new file there and the
families never import the registry.
"""

from __future__ import annotations

import importlib
import pkgutil

from core.errors import UnsupportedArchitectureError
from core.models import families
from core.models.adapter import Adapter

_HF: dict[str, type] = {}
_OPEN_CLIP: dict[str, type] = {}


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _load_families() -> None:
    """Import every module of ``core.models.families`` and index the adapters
    they define by the architecture names each declares."""
    if _HF or _OPEN_CLIP:
        return
    for info in pkgutil.iter_modules(families.__path__):
        importlib.import_module(f"{families.__name__}.{info.name}")
    for cls in _subclasses(Adapter):
        if not cls.__module__.startswith(f"{families.__name__}."):
            continue
        for name in vars(cls).get("hf_architectures", ()):
            _HF[name] = cls
        for name in vars(cls).get("open_clip_classes", ()):
            _OPEN_CLIP[name] = cls


def supported() -> list[str]:
    _load_families()
    return sorted(_HF) + [f"open_clip:{n}" for n in sorted(_OPEN_CLIP)]


def adapter_for_hf(architecture: str | None) -> type:
    _load_families()
    if isinstance(architecture, str) and architecture in _HF:  # a dict or list from a bad config is not hashable
        return _HF[architecture]
    raise UnsupportedArchitectureError(
        f"no adapter supports architecture {architecture!r}; supported: {', '.join(supported())}"
    )


def adapter_for_open_clip(model_class: str) -> type:
    _load_families()
    if isinstance(model_class, str) and model_class in _OPEN_CLIP:
        return _OPEN_CLIP[model_class]
    raise UnsupportedArchitectureError(
        f"no adapter supports open_clip model class {model_class!r}; supported: {', '.join(supported())}"
    )
