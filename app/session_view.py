"""The window's session: which file it records into, the audit table that
follows the session's events, exporting and switching sessions.

The session is the model and the audit panel a view of it: every
:meth:`core.session.Session.record` fires :meth:`~core.session.Session.on_recorded`
(in the recording thread), :class:`SessionWatch` brings that to the GUI
thread as a Qt signal, and the window refreshes its audit table there. Nothing
refreshes the table by hand after a record.
"""

from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QFileDialog

import core
from core.session import RunInfo, Session


def default_session_path() -> Path:
    """A new session file under the user's data folder (one per window)."""
    folder = Path.home() / ".local" / "share" / "vlm-readout" / "sessions"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / time.strftime("session-%Y%m%d-%H%M%S.vlmr")


def open_start_session(path: str | Path | None) -> tuple[Session, str | None]:
    """The session a window starts with, and a line saying so when it is not
    the one asked for: the file ``path`` (opened, or created if missing); if
    that cannot be used (not a session, a folder, an unwritable place), a new
    file in the user's data folder; if none can be made there, a session in
    memory that is not saved. Nothing is created elsewhere without saying so."""
    problem = None
    if path is not None:
        try:
            return Session.open_or_create(path), None
        except (core.ReadoutError, OSError) as e:
            problem = f"cannot use the session {path}: {e}"
    try:
        fallback = default_session_path()
        session = Session.open_or_create(fallback)
    except (core.ReadoutError, OSError) as e:
        problem = problem or f"cannot create a session file in the user's data folder: {e}"
        return Session.temporary(), f"{problem}; recording into a temporary session that is not saved"
    return session, f"{problem}; recording into a new session {fallback} instead" if problem else None


class SessionWatch(QObject):
    """Forwards one session's recorded runs as :attr:`recorded` (a
    :class:`core.session.RunInfo`), delivered on the GUI thread.

    Create it on the GUI thread: a signal emitted from a worker's thread is
    queued to the receivers there; one emitted on the GUI thread is delivered
    at once (so the table is current when ``record`` returns).
    """

    recorded = Signal(object)

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._unsubscribe = None

    def watch(self, session: Session) -> None:
        """Follow ``session`` (and stop following the previous one)."""
        self.stop()
        self._unsubscribe = session.on_recorded(self._forward)

    def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def _forward(self, info: RunInfo) -> None:
        self.recorded.emit(info)


class SessionMixin:
    """The session half of :class:`app.main_window.MainWindow` (a QMainWindow
    with ``session``, ``session_watch``, ``audit_panel``, ``session_label``,
    ``image``, ``model_cache``, ``model_spec()``, ``show_error``,
    ``is_busy()``, ``_show_analysis`` and ``statusBar()``)."""

    def _use_session(self, session: Session) -> None:
        """Record into ``session`` from now on; its audit table follows its events."""
        self.session = session
        self.session_watch.watch(session)
        self._refresh_audit()

    def _record(self, readout, *, mask=None, parameters: dict | None = None) -> None:
        """Record a run in the session (autosaved): the readout, the shown image, the model.
        The audit table refreshes from the session's event."""
        try:
            self.session.record(
                readout,
                image=self.image,
                mask=mask,
                parameters=parameters,
                model=self.model_cache.get(self.model_spec()) or self.model_spec(),
            )
        except core.ReadoutError as e:
            self.show_error(f"not saved in the session: {e}")

    def _on_run_recorded(self, _info: RunInfo) -> None:
        self._refresh_audit()

    def _refresh_audit(self) -> None:
        self.audit_panel.set_rows([{**row, "run": row["run_id"]} for row in self.session.audit_table()])

    def _show_session(self, problem: str | None = None) -> None:
        """The session line: the file the runs are saved in, or (red) why it is not the one asked for."""
        if problem:
            self.session_label.setStyleSheet("color: #c00000;")
            self.session_label.setText(" ".join(problem.split()))
        else:
            self.session_label.setStyleSheet("color: #555555;")
            self.session_label.setText(f"session: {self.session.path}")

    def export_audit(self, fmt: str, path: str) -> bool:
        from core.export import export_session  # the figures' drawing code loads on the first export

        notes: list[str] = []
        try:
            written = export_session(self.session, fmt, path, notes=notes)
        except core.ReadoutError as e:
            self.show_error(str(e))
            return False
        self.statusBar().showMessage(f"exported {', '.join(str(p) for p in written)}")
        if notes:  # exported; some pictures could not be drawn as recorded
            more = f" (and {len(notes) - 1} more)" if len(notes) > 1 else ""
            self.show_error(f"exported, but {notes[0]}{more}")
        return True

    def open_session(self, path: str | Path) -> bool:
        """Switch to another session file and show its last read-out and audit
        table. A file that cannot be opened or read leaves the current session
        as it was, with the reason in the error line."""
        if self.is_busy():
            self.show_error("a job is running: wait for it or cancel it before opening a session")
            return False
        try:
            session = Session.open(path)
        except (core.ReadoutError, OSError) as e:
            self.show_error(f"cannot open the session: {e}")
            return False
        try:  # read it before switching: a file whose runs cannot be read is refused whole
            runs = session.runs()
            analyzes = [r for r in runs if r.kind == "analyze"]
            last = session.run(analyzes[-1].id).result if analyzes else None
            session.audit_table()
        except core.ReadoutError as e:
            session.close()
            self.show_error(f"cannot open the session: {e}")
            return False
        self.session_watch.stop()
        self.session.close()
        self._use_session(session)
        self._show_session()
        self.show_error("")
        if last is not None:
            try:
                self._show_analysis(last)
            except (KeyError, TypeError, ValueError, IndexError) as e:  # a result of another shape or version
                self._show_analysis(None)
                self.show_error(f"the session's last analyze run cannot be shown ({type(e).__name__}: {e})")
        self.statusBar().showMessage(f"session {Path(path).name}: {len(runs)} runs")
        return True

    def open_session_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self, "Open session", "", "VLM Readout sessions (*.vlmr *.sqlite *.db);;All files (*)"
        )
        if path:
            self.open_session(path)

    def _close_session(self) -> None:
        """Stop following the session and close it (the window is going)."""
        self.session_watch.stop()
        self.session.close()
