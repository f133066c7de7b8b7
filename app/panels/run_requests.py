"""What the panels that start work share: a run their controls cannot start as
chosen (:class:`Refusal`), the source images they read, and their "running: …"
line (:class:`RunningLine`).

A panel builds the request of its button (:mod:`core.requests`) from its own
controls and what the window gives it (the asked fields, the painted region),
or returns a :class:`Refusal`: the one-line reason and, when the user can meet
it (paint a region, select a head, fill a field), ``met()``. The window shows
the reason in the panel and its error line until ``met()`` holds
(:meth:`app.input_bar.InputBar.refuse_until`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import core

# the file dialogs' filter for an image (the window's, a source image, a region pasted from)
IMAGE_FILTER = "Images (*.png *.jpg *.jpeg *.bmp *.gif *.tif *.tiff *.webp *.ppm *.pgm *.pbm *.pnm);;All files (*)"


@dataclass(frozen=True)
class Refusal:
    """Why a run cannot start as chosen; ``met()`` holds once the user has met it (None: nothing
    the window can watch, the message stays until the next action)."""

    message: str
    met: Callable[[], bool] | None = None


def selected_other_than(selection, selected) -> Callable[[], bool]:
    """``met()`` of a refusal about the selection ``selected`` (None: nothing was selected): a
    current (not stale) component is selected, another than that one."""

    def met() -> bool:
        current = selection.current
        return current is not None and not current.stale and current is not selected

    return met


def read_source(source):
    """The pixels of a source image (a path, bytes, an array or a PIL image: :func:`core.load_image`),
    or a :class:`Refusal` saying why it cannot be read."""
    try:
        return core.load_image(source)
    except core.ImageLoadError as e:
        return Refusal(str(e))


class RunningLine:
    """A panel's "running: …" line: shown as its job starts, gone when the job ends or its result
    is drawn, unless another message took its place (a failure, a refusal, a restore's note).

    Args:
        show_message: the panel's ``show_message(text, error=False)``.
        label: the label it writes (its ``text()`` is the whole text shown).
    """

    def __init__(self, show_message: Callable, label):
        self._show_message = show_message
        self._label = label
        self._text: str | None = None

    def show(self, text: str) -> None:
        self._show_message(text)
        self._text = self._label.text()  # as the panel writes it (some join the lines)

    def end(self) -> None:
        if self._text is not None and self._label.text() == self._text:
            self._show_message("")
        self._text = None
