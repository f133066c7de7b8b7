"""The side panels of the main window: attention, DLA, lens, counterfactual, audit.

A read-out panel draws itself from the run it is shown for: ``draw(run, kind)`` (the
protocol of :class:`app.run_frame.RunFrame`), reading the typed results in ``run.results``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.components import ShownRun
    from core.analyze import AnalyzeResult

READ_OUT = "Read out"  # the window's button (and Run menu action, Ctrl+R) that makes a read-out
NO_ANALYSIS = f"no analysis yet: press {READ_OUT}"  # what an empty read-out panel says


def analysis_of(run: ShownRun | None) -> AnalyzeResult | None:
    """The analyze result ``run`` holds (a live one or a restored one alike), or None."""
    return None if run is None else run.analysis
