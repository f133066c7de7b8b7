"""Public functions that share their module's name (``core.answer``,
``core.capture``): the package loads names lazily (core/__init__.py), and
importing a submodule always binds the package attribute to the module, so the
module itself is made callable as its function."""

from __future__ import annotations

import sys
import types


def make_module_callable(module_name: str, function) -> None:
    """Calling module ``module_name`` calls ``function`` (its other names stay as they are)."""

    class CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return function(*args, **kwargs)

    sys.modules[module_name].__class__ = CallableModule
