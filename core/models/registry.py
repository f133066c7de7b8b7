"""Which adapter serves which architecture.

Hugging Face models are matched by ``config.architectures[0]``; open_clip
models by their model class name. Adding a family is one new file in
``families/`` that calls :func:`register`.
"""

from __future__ import annotations

from core.errors import UnsupportedArchitectureError

_HF: dict[str, type] = {}
_OPEN_CLIP: dict[str, type] = {}


def register(*, hf: tuple[str, ...] = (), open_clip: tuple[str, ...] = ()):
    """Class decorator: register an Adapter for these architecture names."""

    def wrap(cls):
        for name in hf:
            _HF[name] = cls
        for name in open_clip:
            _OPEN_CLIP[name] = cls
        return cls

    return wrap


def _load_families() -> None:
    """Import every module of ``core.models.families`` (each registers itself)."""
    import importlib
    import pkgutil

    from core.models import families

    for info in pkgutil.iter_modules(families.__path__):
        importlib.import_module(f"core.models.families.{info.name}")


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
