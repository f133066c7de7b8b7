"""The one path of the window's background work: a request, then a worker,
then ``session.record``, then ``workspace.add_result`` (every panel draws from
the workspace: nothing here touches a panel).

A request (:mod:`core.requests`) runs on a model from the window's model
cache in a :class:`app.workers.Worker` (:func:`app.jobs.request_job`); its
:class:`core.results.readout.Readout` is recorded in the session with the request's
own ``parameters()`` (what the CLI records for the same request) and shown.
Work that makes no run (an answer, a model load, one head's source map) takes
the same worker path through :meth:`Runner.start` without the record.

One job runs at a time; :attr:`Runner.busy_changed`, :attr:`Runner.progress`
and :attr:`Runner.ended` are what the window's controls follow.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, Signal

from app.workers import Worker, WorkerPool


class Runner(QObject):
    """Runs the window's jobs one at a time (see the module docstring).

    Args:
        model_cache: ``{ModelChoice: LoadedModel}`` the jobs load into and reuse.
        record: ``record(readout, request) -> run id or None``: the session's record of a
            request's result (None: not saved, the reason already shown).
        show: ``show(readout, run_id, made_for)``: the workspace's ``add_result``.
    """

    busy_changed = Signal(bool)
    progress = Signal(int, int, str)  # done, total (0: amount unknown), the job's line
    started = Signal(str)  # the job's first status line, shown at once
    ended = Signal(str)  # "ready", "failed" or "cancelled"
    failed = Signal(str)  # the one-line reason, before ended("failed")

    def __init__(self, model_cache: dict, record: Callable, show: Callable, parent: QObject | None = None):
        super().__init__(parent)
        self.model_cache = model_cache
        self._record, self._show = record, show
        self.workers = WorkerPool(self)
        self.job: Worker | None = None
        self.closed = False  # the window closed: a late outcome is nobody's (nothing shown or recorded)

    def is_busy(self) -> bool:
        return self.job is not None

    def run_request(
        self, request, model, made_for, *, status: str = "working…", failed: Callable | None = None
    ) -> Worker:
        """Run ``request`` on ``model`` (a ModelChoice); its result is recorded (with the image and
        painted region the request holds) and shown as a result of ``made_for`` (the RunInput it was
        asked on)."""
        from app.jobs import request_job

        def done(result) -> None:
            if result is None:  # stopped between steps: nothing ran to the end
                return
            run_id = self._record(result, request)
            self._show(result, run_id, made_for)

        return self.start(done, request_job, self.model_cache, model, request, status=status, failed=failed)

    def start(self, on_result: Callable, fn: Callable, *args, status: str = "working…", failed=None) -> Worker:
        """Run ``fn(*args, progress=..., cancel=...)`` in a worker: ``on_result(result)`` on success,
        ``failed(message)`` (after :attr:`failed`) on failure, then :attr:`ended`."""
        job = Worker(fn, *args)

        def while_open(handler):
            return lambda *outcome: None if self.closed else handler(*outcome)

        job.progress.connect(while_open(self._on_progress))
        job.failed.connect(while_open(self.failed.emit))
        if failed is not None:
            job.failed.connect(while_open(failed))
        job.failed.connect(while_open(lambda _message: self._end("failed")))
        job.cancelled.connect(while_open(lambda: self._end("cancelled")))
        job.finished.connect(while_open(on_result))
        job.finished.connect(while_open(lambda _result: self._end("ready")))
        self.job = self.workers.start(job)
        self.busy_changed.emit(True)
        self.started.emit(status)
        return job

    def cancel(self) -> bool:
        """Ask the running job to stop (True if one runs); :attr:`ended` follows when it has."""
        if self.job is None:
            return False
        self.job.cancel()
        return True

    def cancelling(self) -> bool:
        return self.job is not None and self.job.cancel_token.is_set()

    def shutdown(self, timeout_ms: int) -> None:
        """The window closes: cancel and join the jobs (app.workers lets one go that does not stop)."""
        self.closed = True
        self.job = None
        self.workers.shutdown(timeout_ms)

    def _on_progress(self, done: int, total: int, message: str) -> None:
        self.progress.emit(done, total, "" if self.cancelling() else message)

    def _end(self, status: str) -> None:
        self.job = None
        self.busy_changed.emit(False)
        self.ended.emit(status)
