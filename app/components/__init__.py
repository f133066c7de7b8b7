"""Qt-free models of the app (napari's ``components`` are the model): plain Python
with events; the widgets subscribe. Never imports PySide6, pyqtgraph or the views
(an import-linter contract in pyproject.toml)."""

from app.components.events import Event
from app.components.model_choice import ModelChoice
from app.components.run_view import NOTHING_SHOWN, RunView
from app.components.workspace import RunInput, ShownRun, Workspace, WorkspaceEvents

__all__ = ["NOTHING_SHOWN", "Event", "ModelChoice", "RunInput", "RunView", "ShownRun", "Workspace", "WorkspaceEvents"]
