"""Background work for the app: the only module that starts threads.

A :class:`Worker` runs a plain Python function in its own ``QThread``. The
function is called as ``fn(*args, progress=..., cancel=..., **kwargs)``:

* ``progress(done, total, message)`` reports progress (``total == 0`` means
  "busy, amount unknown");
* ``cancel`` is a :class:`threading.Event`; the function polls
  ``cancel.is_set()`` and returns early when it is set.

Exactly one of ``finished(result)``, ``failed(message)`` or ``cancelled()``
is emitted per run, on the GUI thread. Expected engine errors
(:class:`core.ReadoutError`) fail with their one-line message; anything else
fails with a one-line summary (the traceback goes to the log), never a crash.
A :class:`WorkerPool` starts workers, keeps each until its thread has ended
and joins them on :meth:`WorkerPool.shutdown`. A function that does not poll
``cancel`` within the shutdown's time (one long forward of a large model) is let
go rather than waited for: its signals are blocked, so nothing of it reaches the
closing window (nothing is shown or recorded), and it is kept here until its
thread ends (:func:`abandoned_workers`), since destroying a running ``QThread``
aborts the process. ``app.__main__`` then exits without waiting for it; any other
process joins it at exit.
"""

from __future__ import annotations

import atexit
import gc
import logging
import threading
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QDeadlineTimer, QObject, QThread, Signal, Slot

from core import ReadoutError

log = logging.getLogger(__name__)


def one_line(error: BaseException) -> str:
    """``"TypeName: message"`` squeezed onto one line."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class _CollectionOffWorkers:
    """Python's cyclic garbage collector kept off the worker threads.

    A collection runs on whichever thread crosses an allocation threshold; one in
    a worker thread can free Qt objects there (a closed window's widgets caught in
    a reference cycle), and Qt aborts the process (seen: "Fatal Python error:
    Aborted", garbage-collecting inside transformers' loading threads). So while
    any worker runs, automatic collection is off; when the last one has ended it
    is switched back on, and Python's own thresholds run the next collection on
    the GUI thread, the only thread left running Python code (the objects made
    during the job first: they are all still in the youngest generation). No
    collection is forced: a full one after every job took 0.1-1 s of the GUI
    thread with a model and its results on the heap (half of the app tests' time).
    Both calls are made on the GUI thread."""

    def __init__(self):
        self.running = 0
        self.switched_off = False

    def worker_started(self) -> None:
        if self.running == 0 and gc.isenabled():
            gc.disable()
            self.switched_off = True
        self.running += 1

    def worker_ended(self) -> None:
        self.running -= 1
        if self.running == 0 and self.switched_off:
            self.switched_off = False
            gc.enable()


_COLLECTION = _CollectionOffWorkers()


class _Thread(QThread):
    """A QThread whose ``run`` calls the given target."""

    def __init__(self, target: Callable[[], None]):
        super().__init__()
        self._target = target

    def run(self) -> None:
        self._target()


class Worker(QObject):
    """Runs ``fn`` once in a thread of its own; see the module docstring."""

    progress = Signal(int, int, str)
    finished = Signal(object)
    failed = Signal(str)
    cancelled = Signal()

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any):
        super().__init__()
        self._fn, self._args, self._kwargs = fn, args, kwargs
        self.cancel_token = threading.Event()
        self.returned = False  # set in the thread once fn has returned and the outcome is emitted
        self.qthread = _Thread(self._run)
        self._collection_held = False
        # queued to this (GUI-thread) object: runs on the GUI thread once the thread has ended
        self.qthread.finished.connect(self.release_collection)

    def start(self) -> None:
        _COLLECTION.worker_started()
        self._collection_held = True
        self.qthread.start()

    @Slot()
    def release_collection(self) -> None:
        """The worker's hold on automatic garbage collection released (once; GUI thread)."""
        if self._collection_held:
            self._collection_held = False
            _COLLECTION.worker_ended()

    def cancel(self) -> None:
        """Ask the function to stop; it does so the next time it polls."""
        self.cancel_token.set()

    def _report(self, done: int, total: int, message: str = "") -> None:
        self.progress.emit(int(done), int(total), message)

    def _run(self) -> None:
        try:
            result = self._fn(*self._args, progress=self._report, cancel=self.cancel_token, **self._kwargs)
        except ReadoutError as e:
            self.failed.emit(str(e))
        except Exception as e:  # a bug or an unexpected library error: report, do not crash
            log.exception("background job failed")
            self.failed.emit(one_line(e))
        else:
            if self.cancel_token.is_set():
                self.cancelled.emit()
            else:
                self.finished.emit(result)
        finally:
            self.returned = True


class WorkerPool(QObject):
    """Starts workers and keeps each one until its thread has ended.

    A QObject so that the thread-ended connections die with it.
    """

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._workers: list[Worker] = []

    def start(self, worker: Worker) -> Worker:
        """Start ``worker``, keeping it until its thread has ended.

        Connect to the worker's signals before this call: a signal emitted
        before a connection exists is not delivered.
        """
        abandoned_workers()  # joins those let go earlier that have ended since
        worker.qthread.finished.connect(self._forget_finished)
        self._workers.append(worker)
        worker.start()
        return worker

    def running(self) -> list[Worker]:
        """Workers whose thread has not been joined yet."""
        return list(self._workers)

    def shutdown(self, timeout_ms: int = 30_000) -> bool:
        """Cancel every worker and join its thread, within ``timeout_ms`` for them all; True if all
        ended in time. A worker still running then is let go (see the module docstring): the pool
        forgets it and none of its signals is emitted any more."""
        deadline = QDeadlineTimer(timeout_ms)
        for worker in self._workers:
            worker.cancel()
        all_ended = True
        for worker in list(self._workers):
            self._workers.remove(worker)
            if worker.qthread.wait(deadline):
                worker.release_collection()  # the queued slot may never run: the window is closing
            else:
                all_ended = False
                worker.blockSignals(True)  # its outcome, when it comes, is nobody's
                _LET_GO.append(worker)
                log.info("a background job was still running at shutdown: let go")
        return all_ended

    @Slot()
    def _forget_finished(self) -> None:
        """Join and drop workers whose function has returned (their thread is ending)."""
        for worker in [w for w in self._workers if w.returned]:
            worker.qthread.wait()
            self._workers.remove(worker)


# Workers a shutdown let go while their function still ran, kept until their thread has ended.
_LET_GO: list[Worker] = []


def abandoned_workers() -> list[Worker]:
    """The workers a :meth:`WorkerPool.shutdown` let go whose thread still runs; those that
    have ended are joined and dropped (call on the GUI thread)."""
    for worker in [w for w in _LET_GO if w.qthread.isFinished()]:
        worker.qthread.wait()
        worker.release_collection()
        _LET_GO.remove(worker)
    return list(_LET_GO)


@atexit.register
def _join_let_go() -> None:
    """A process that exits normally waits for the workers let go (cancelled, they end at their
    next poll): a ``QThread`` destroyed while it runs aborts the process."""
    for worker in list(_LET_GO):
        worker.qthread.wait()
