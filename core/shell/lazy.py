"""Lazily loaded package names (core/__init__.py, core/dataset_audit/__init__.py):
a package lists ``name -> module`` and imports the module on first use, so a
light path (the CLI parser, ``vlm-readout export --help``) does not import torch.

Public functions that share their module's name (``core.answer``,
``core.capture`` before it moved to core.forward): importing a submodule always binds the package attribute to
the module, so the module itself is made callable as its function."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable


def lazy_getattr(package: str, names: dict[str, str], *, modules: frozenset[str] = frozenset()) -> Callable:
    """A module ``__getattr__`` for ``package``: ``names[name]`` is the module
    that defines ``name``; the value is cached in the package's namespace.
    A name in ``modules`` is the module itself (see make_module_callable)."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(names[name])
        value = module if name in modules else getattr(module, name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


def make_module_callable(module_name: str, function) -> None:
    """Calling module ``module_name`` calls ``function`` (its other names stay as they are)."""

    class CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return function(*args, **kwargs)

    sys.modules[module_name].__class__ = CallableModule
