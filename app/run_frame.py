"""A read-out view with a header naming the run it was drawn for, and the
window's half that keeps the workspace current (:class:`WorkspaceMixin`).

:class:`RunFrame` wraps a panel (the panel knows nothing of runs) and draws a
:class:`app.components.RunView`: grey ``run #4 · analyze · 'what shape…?' ·
sample_00.png · shapes-llava`` while the content shows the current input;
amber ``stale (question changed): drawn for …; the input is now …`` once the
image, question, model or target has moved on; ``no run shown yet`` when the
workspace shows nothing (the window empties the panels then: a new image).
"""

from __future__ import annotations

import dataclasses

from PySide6.QtWidgets import QVBoxLayout, QWidget

import core
from app.components import RunInput, RunView, ShownRun, Workspace
from app.widgets import ElidedLabel

CURRENT_STYLE = "color: #555555; padding: 1px 4px;"
STALE_STYLE = "color: #5a3b00; background: #ffd27a; padding: 1px 4px;"  # amber: not the current input

# the window's read-out views and the result kinds each shows (the Answer tab also shows a read-out's answer)
VIEW_KINDS = {
    "canvas": ("analyze",),
    "answer": ("answer", "analyze"),
    "attention": ("analyze",),
    "dla": ("analyze",),
    "lens": ("analyze",),
    "counterfactual": ("counterfactual", "sweep", "intervention"),
}
INTERVENTION_HINT = "interventions: select a head (Attention tab) or paint a region"
TARGET_PLACEHOLDER = "answer token (default: the model's top token)"
# what the user asks about: a change of any of these makes the shown target placeholder ("now: square") wrong
ASKED_FIELDS = {"image_sha256", "question", "model_spec"}


class RunFrame(QWidget):
    """``panel`` under a header that follows ``view``.

    Args:
        panel: the read-out widget shown below the header.
        view: the Qt-free state (which run, stale or not).
    """

    def __init__(self, panel: QWidget, view: RunView, parent: QWidget | None = None):
        super().__init__(parent)
        self.panel = panel
        self.view = view
        self.header = ElidedLabel()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        layout.addWidget(self.header)
        layout.addWidget(panel, 1)
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
        """Redraw the header from the view."""
        self.header.setText(self.view.header())
        self.header.setStyleSheet(STALE_STYLE if self.view.stale else CURRENT_STYLE)


class WorkspaceMixin:
    """The workspace half of :class:`app.main_window.MainWindow`: keeps ``workspace``
    (:class:`app.components.Workspace`) current from the window's fields, frames the
    read-out views, and empties them when the workspace shows nothing. Expects the
    window's ``model_cache``, fields (``question_edit``, ``target_edit``, ``foil_edit``,
    ``model_picker``) and panels."""

    def _use_workspace(self, model_spec: str) -> None:
        """Create the workspace (before the widgets, which follow it)."""
        self.workspace = Workspace(RunInput(model_spec=model_spec.strip()))
        self.workspace.events.input_changed.connect(self._on_input_changed)
        self.workspace.events.run_shown.connect(self._on_run_shown)

    def _frame_views(self, **views: QWidget) -> dict[str, RunFrame]:
        """Each read-out view (by name in :data:`VIEW_KINDS`) under a header naming its run: ``run_frames``."""
        self.run_frames = {
            name: RunFrame(widget, RunView(self.workspace, VIEW_KINDS[name], name)) for name, widget in views.items()
        }
        return self.run_frames

    def _follow_fields(self) -> None:
        """The question, target, foil and model fields write into the workspace as they change."""
        self.question_edit.textChanged.connect(lambda text: self.workspace.set_input(question=text.strip()))
        self.target_edit.textChanged.connect(lambda text: self.workspace.set_input(answer=text.strip()))
        self.foil_edit.textChanged.connect(lambda text: self.workspace.set_input(foil=text.strip()))
        self.model_picker.currentTextChanged.connect(self._on_model_changed)

    def _fingerprint(self, spec: str) -> str | None:
        """The fingerprint of the model loaded for ``spec``, None while it is not loaded."""
        loaded = self.model_cache.get(spec)
        return loaded.fingerprint if isinstance(loaded, core.LoadedModel) else None

    def _made_for(self, asked: RunInput) -> RunInput:
        """``asked`` (the input a job started with) with the fingerprint of the model it ran."""
        fingerprint = self._fingerprint(asked.model_spec) or asked.model_fingerprint
        return dataclasses.replace(asked, model_fingerprint=fingerprint)

    def current_image_path(self) -> str | None:
        """The shown image's path as given (None: pasted or dropped pixels, or no image)."""
        return self.workspace.input.image_path

    def _on_model_changed(self, text: str) -> None:
        spec = text.strip()
        if self.workspace.set_input(model_spec=spec, model_fingerprint=self._fingerprint(spec)):
            self.attention_panel.set_statistics(None)  # the dataset distribution was another model's heads

    def _on_input_changed(self, fields: tuple) -> None:
        if ASKED_FIELDS.intersection(fields):
            self.target_edit.setPlaceholderText(TARGET_PLACEHOLDER)  # "now: square" was the shown run's

    def _on_run_shown(self, run: ShownRun | None, kind: str | None) -> None:
        if run is None:  # nothing is shown any more: no view keeps another input's content
            self._show_analysis(None)
            self.analysis_inputs = None
            self.counterfactual_panel.clear_result()
            self.counterfactual_panel.clear_sweep()
            self.intervention_label.setText(INTERVENTION_HINT)
            self.last_counterfactual = self.last_intervention = None
            self._clear_answer()
