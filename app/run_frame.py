"""A read-out view with a header naming the run it was drawn for.

:class:`RunFrame` wraps a panel and draws a :class:`app.components.RunView`: grey
``run #4 · analyze · 'what shape…?' · sample_00.png · shapes-llava · bfloat16 · cpu``
while the content shows the current input; amber ``stale (question changed): drawn
for …; the input is now …`` once the image, question, model, its dtype or device,
answer token or target has moved on; ``no run shown yet`` when the workspace shows
nothing. The panel draws itself from the run the view adopts (``panel.draw(run, kind)``,
see :class:`RunFrame`): the workspace's shown run is the only copy of what is on screen.
"""

from __future__ import annotations

from PySide6.QtWidgets import QVBoxLayout, QWidget

from app.components import RunView
from app.panels.counterfactual_panel import DRAWN_KINDS as COUNTERFACTUAL_KINDS
from app.panels.flow_panel import FLOW_KINDS
from app.panels.head_methods_panel import HEAD_METHOD_KINDS
from app.widgets import KeepingLabel

CURRENT_STYLE = "color: #555555; padding: 1px 4px;"
STALE_STYLE = "color: #5a3b00; background: #ffd27a; padding: 1px 4px;"  # amber: not the current input

# the window's read-out views and the result kinds each draws (the Answer tab also shows a read-out's answer;
# the painter, the grid of the read-out; a claim is checked on a model, not an input: the Validation tab is no view)
VIEW_KINDS = {
    "canvas": ("analyze",),
    "answer": ("answer", "generate", "analyze"),
    "attention": ("analyze",),
    "dla": ("analyze",),
    "lens": ("analyze",),
    "counterfactual": COUNTERFACTUAL_KINDS,
    "head methods": HEAD_METHOD_KINDS,
    "flow": FLOW_KINDS,
}


class RunFrame(QWidget):
    """``widget`` under a header that follows ``view``; ``panel`` draws itself from the run.

    The drawing protocol: ``panel.draw(run, kind)`` draws the results of the view's kinds
    that ``run.results`` holds (typed results, :mod:`core.results.readout`), ``kind`` being the one
    just shown; ``panel.draw(None, None)`` clears it. It is called when the view adopts
    another run or another result of its kinds (a live run and a restored one alike), never
    for a follow-up result of other kinds or an input change (the header says stale then).

    Args:
        widget: what is shown below the header (the panel, or a scroll page holding it).
        view: the Qt-free state (which run, stale or not).
        panel: what draws (default ``widget``); None: a widget that draws nothing itself.
    """

    def __init__(self, widget: QWidget, view: RunView, panel=..., parent: QWidget | None = None):
        super().__init__(parent)
        self.panel = widget if panel is ... else panel
        self.view = view
        self.header = KeepingLabel()
        self._drawn: tuple | None = None  # (run, its results of the view's kinds) last drawn
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        layout.addWidget(self.header)
        layout.addWidget(widget, 1)
        disconnect = view.changed.connect(lambda cleared: self.refresh())
        self.destroyed.connect(lambda *_: disconnect())  # the view may outlive this widget
        self.refresh()

    @property
    def stale(self) -> bool:
        """The header says the content was drawn for another input."""
        return self.view.stale

    def header_text(self) -> str:
        """The header's whole text (the label may show it elided)."""
        return self.header.text()

    def refresh(self) -> None:
        """Redraw the header from the view, and the panel when its run or results changed."""
        self.header.setText(self.view.header(), keep=self.view.header_kept())  # the token read stays readable
        self.header.setStyleSheet(STALE_STYLE if self.view.stale else CURRENT_STYLE)
        run = self.view.run
        # the objects themselves, compared by identity (an id could be reused once the old run is freed)
        drawn = None if run is None else (run, *(run.results.get(k) for k in self.view.kinds))
        same = (
            drawn is None
            and self._drawn is None
            or (drawn is not None and self._drawn is not None and all(a is b for a, b in zip(drawn, self._drawn)))
        )
        if not same:
            self._drawn = drawn
            if self.panel is not None:
                self.panel.draw(run, self.view.kind)
