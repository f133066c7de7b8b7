"""Plain-Python events: a model emits, views subscribe (no Qt).

An :class:`Event` keeps a list of callbacks; :meth:`Event.emit` calls each
with the event's payload as keyword arguments, in the thread that emits (the
workspace is changed on the GUI thread only, so its views draw there).
"""

from __future__ import annotations

from collections.abc import Callable


class Event:
    """One kind of change a model announces (``input_changed``, ``run_shown``, ...)."""

    def __init__(self, name: str = ""):
        self.name = name
        self._callbacks: list[Callable[..., None]] = []

    def connect(self, callback: Callable[..., None]) -> Callable[[], None]:
        """Call ``callback(**payload)`` on every :meth:`emit`; returns the function that disconnects it."""
        self._callbacks.append(callback)

        def disconnect() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        return disconnect

    def emit(self, **payload) -> None:
        """Call every connected callback, in connection order (a callback connected meanwhile waits for the next)."""
        for callback in list(self._callbacks):
            callback(**payload)

    def __len__(self) -> int:
        return len(self._callbacks)

    def __repr__(self) -> str:
        return f"Event({self.name!r}, {len(self._callbacks)} callbacks)"
