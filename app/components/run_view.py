"""One read-out view's state: the run its content was drawn for, and whether
that run still matches the workspace's input (no Qt).

The window wraps each read-out view (the canvas heatmap, Attention, DLA, Lens,
the Counterfactual results, the Answer tab) in an :class:`app.run_frame.RunFrame`
that draws a :class:`RunView`: a header naming the view's run, amber and saying
so when the input has moved on; the panel draws itself from the run the view adopts.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.components.events import Event
from app.components.workspace import ShownRun, Workspace

NOTHING_SHOWN = "no run shown yet"


class RunView:
    """Follows a :class:`Workspace` for a view that shows results of ``kinds``.

    On ``run_shown`` with a result of one of ``kinds`` the view adopts that run; a run
    without one leaves the view's content (and run) as they were. ``run_shown(None)``
    clears it. After every workspace event :attr:`changed` fires with ``cleared``
    (True when the view's content must be emptied).

    Attributes:
        run: the run the content was drawn for, or None (nothing shown).
        kind: which of ``kinds`` that content is.
    """

    def __init__(self, workspace: Workspace, kinds: Sequence[str], name: str = ""):
        self.workspace = workspace
        self.kinds = tuple(kinds)
        self.name = name
        self.run: ShownRun | None = None
        self.kind: str | None = None
        self.changed = Event("changed")
        self._disconnects = [
            workspace.events.run_shown.connect(self._on_run_shown),
            workspace.events.input_changed.connect(self._on_input_changed),
        ]

    @property
    def stale(self) -> bool:
        """True when the content was drawn for another input than the current one."""
        return self.run is not None and not self.workspace.is_current(self.run)

    def header(self) -> str:
        """The header line: the run (``ShownRun.header``), its stale note, or that nothing is shown."""
        if self.run is None:
            return NOTHING_SHOWN
        if self.stale:
            return self.workspace.stale_note(self.run)
        return self.run.header(self.kind)

    def header_kept(self) -> list[str]:
        """The parts of :meth:`header` a narrow header keeps whole while it elides the rest: that
        it is stale and what changed, and the tokens each input named reads (the question, image
        and model are in the fields below; which token a view is about is not)."""
        if self.run is None:
            return []
        if not self.stale:
            return self.run.input.token_parts()
        lead = self.workspace.stale_lead(self.run)
        return [lead, *self.run.input.token_parts(), *self.workspace.input.token_parts()]

    def adopt(self, run: ShownRun, kind: str | None = None) -> bool:
        """Say the content now shows ``run`` (``kind``: which result; default the first of
        this view's kinds the run has). False, and nothing changes, if it has none."""
        kinds = [kind] if kind in self.kinds else [k for k in self.kinds if k in run.results]
        if not kinds or kinds[0] not in run.results:
            return False
        self.run, self.kind = run, kinds[0]
        return True

    def clear(self) -> None:
        """Nothing is shown in this view any more."""
        self.run, self.kind = None, None
        self.changed.emit(cleared=True)

    def disconnect(self) -> None:
        """Stop following the workspace."""
        for disconnect in self._disconnects:
            disconnect()
        self._disconnects = []

    def _on_run_shown(self, run: ShownRun | None, kind: str | None) -> None:
        if run is None:
            self.clear()
            return
        self.adopt(run, kind)
        self.changed.emit(cleared=False)

    def _on_input_changed(self, fields: tuple) -> None:
        self.changed.emit(cleared=False)
