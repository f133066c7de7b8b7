"""The main window end to end: sample shown, answer off the GUI thread, errors in the window, cancel."""

import threading

import numpy as np
import pytest
from PIL import Image
from PySide6.QtCore import QMimeData, QPointF, Qt, QTimer, QUrl
from PySide6.QtGui import QDropEvent, QImage
from PySide6.QtWidgets import QApplication

import core
from app.__main__ import main
from app.samples import bundled_samples
from app.workers import Worker, WorkerPool
from tests.app.shown import shown_result

TIMEOUT_MS = 60_000


def run_until_idle(qtbot, window, start) -> None:
    """Call ``start()`` (which must start a job) and wait until the window is idle again."""
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        assert start()
    assert not window.is_busy()


def test_opens_on_sample_and_answers_like_core(qtbot, window):
    sample = bundled_samples()[0]
    assert window.image_name == sample.image_path.name
    assert window.inputs.question_edit.text() == sample.question
    height, width = window.image.height, window.image.width
    assert window.canvas.image_item.image.shape == (height, width, 3)  # row-major (H, W, 3): upright, not transposed

    run_until_idle(qtbot, window, window.actions.answer_question)

    assert window.inputs.error_label.text() == ""
    loaded = window.loaded_model()
    expected = core.answer(loaded, core.load_image(sample.image_path), sample.question)
    shown = shown_result(window, "answer")
    assert shown.answer == expected.answer == loaded.adapter.token_str(shown.answer_id)
    assert 0.0 <= shown.prob <= 1.0
    assert shown.prob == expected.prob  # the same answer() on the same input
    assert window.answer_panel.label.text() == f"answer: {expected.answer}  (p = {expected.prob:.3f})"
    assert window.answer_panel.table_title.text() == "top alternatives"
    assert window.answer_panel.table.rowCount() == len(expected.top) == 5
    assert [window.answer_panel.table.item(r, 0).text() for r in range(5)] == [t for t, _ in expected.top]
    assert window.inputs.status_label.text() == "ready"
    assert window.inputs.answer_button.isEnabled() and not window.inputs.cancel_button.isEnabled()


def test_image_is_upright_not_transposed(window):
    pixels = np.zeros((100, 240, 3), np.uint8)  # (H, W, 3): a wide image, red in the top-left corner
    pixels[:20, :40] = (255, 0, 0)
    assert window.set_image(Image.fromarray(pixels), name="wide")
    assert window.canvas.image_item.width() == 240 and window.canvas.image_item.height() == 100
    assert window.canvas.plot.getViewBox().yInverted()  # row 0 drawn at the top
    assert (window.canvas.image_item.image[:20, :40] == (255, 0, 0)).all()


def test_second_answer_reuses_loaded_model(qtbot, window):
    run_until_idle(qtbot, window, window.actions.answer_question)
    loaded = window.loaded_model()
    window.set_question("how many triangles are there?")
    run_until_idle(qtbot, window, window.actions.answer_question)
    assert window.loaded_model() is loaded
    assert shown_result(window, "answer") is not None


def test_gui_stays_responsive_while_model_runs(qtbot, window):
    samples = bundled_samples() * 4
    seen = []  # (busy, progress value, progress maximum) at each tick of a GUI-thread timer
    timer = QTimer()
    timer.timeout.connect(
        lambda: seen.append(
            (window.is_busy(), window.inputs.progress_bar.value(), window.inputs.progress_bar.maximum())
        )
    )
    timer.start(10)
    run_until_idle(
        qtbot,
        window,
        lambda: window.actions.answer_pairs(
            [s.image_path for s in samples], [s.question for s in samples], batch_size=1
        ),
    )
    timer.stop()
    busy_ticks = [(value, maximum) for busy, value, maximum in seen if busy]
    assert len(busy_ticks) >= 5, "the GUI event loop did not run while the model worked"
    assert any(0 < value < maximum for value, maximum in busy_ticks), "no progress was shown mid-run"
    assert len(window.answer_panel.pair_answers) == len(samples)


def test_bad_image_shows_one_line_error(qtbot, window, tmp_path):
    bad = tmp_path / "not_an_image.png"
    bad.write_bytes(b"this is text, not a PNG\n")
    shown_before = window.image
    assert not window.set_image(bad)
    message = window.inputs.error_label.text()
    assert "not_an_image.png" in message and "not an image" in message
    assert "\n" not in message
    assert window.image is shown_before and not window.is_busy()


def test_unknown_word_shows_question_error(qtbot, window):
    loaded = window.loaded_model() or core.load_model("shapes-llava", **window.model_choice().load_options())
    window.model_cache[window.model_choice()] = loaded
    with pytest.raises(core.QuestionError) as expected:
        core.answer(loaded, window.image, "what is a zebra?")
    window.set_question("what is a zebra?")
    run_until_idle(qtbot, window, window.actions.answer_question)
    assert window.inputs.error_label.text() == str(expected.value)
    assert "zebra" in window.inputs.error_label.text()
    assert shown_result(window, "answer") is None and window.inputs.status_label.text() == "failed"


def test_cancel_returns_to_idle(qtbot, window):
    samples = bundled_samples() * 20
    window.actions.answer_pairs([s.image_path for s in samples], [s.question for s in samples], batch_size=1)
    assert window.inputs.cancel_button.isEnabled() and not window.inputs.answer_button.isEnabled()
    qtbot.waitUntil(lambda: window.inputs.progress_bar.value() >= 1, timeout=TIMEOUT_MS)
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        qtbot.mouseClick(window.inputs.cancel_button, Qt.MouseButton.LeftButton)
    assert window.inputs.status_label.text() == "cancelled"
    assert window.inputs.error_label.text() == "" and window.answer_panel.pair_answers == []
    assert window.inputs.answer_button.isEnabled() and not window.inputs.cancel_button.isEnabled()
    qtbot.waitUntil(lambda: window.runner.workers.running() == [], timeout=5_000)


def test_close_while_running_joins_the_worker(qtbot, window):
    samples = bundled_samples() * 20
    window.actions.answer_pairs([s.image_path for s in samples], [s.question for s in samples], batch_size=1)
    assert window.runner.workers.running()
    window.close()  # cancels and joins; the fixture checks again after its own close
    assert window.runner.workers.running() == []


def test_the_audit_table_follows_the_sessions_events(qtbot, window, tmp_path):
    """The Audit tab is a view of the session: a run recorded in another thread
    (as a worker would) reaches it on the GUI thread through the session's
    on_recorded event, with no refresh by hand; a replaced session no longer drives it."""
    from core.results.readout import RecordedResult
    from core.session import Session

    before = len(window.audit_panel.rows())
    seen_on: list[bool] = []
    watch = window.sessions.watch
    watch.recorded.connect(lambda _info: seen_on.append(threading.current_thread() is threading.main_thread()))
    note = RecordedResult("note", {}, "from a thread")
    job = Worker(lambda *, progress, cancel: window.session.record(note))  # as a job that records would
    with qtbot.waitSignal(job.finished, timeout=TIMEOUT_MS):
        window.runner.workers.start(job)
    qtbot.waitUntil(lambda: len(window.audit_panel.rows()) == before + 1, timeout=5_000)
    assert window.audit_panel.rows()[-1]["summary"] == "from a thread" and seen_on == [True]  # on the GUI thread

    old = window.session
    other = tmp_path / "other.vlmr"
    Session.create(other).close()
    assert window.sessions.open_session(other, mode="append") and old.closed and window.audit_panel.rows() == []
    assert old._callbacks == []  # unsubscribed when replaced
    window.session.record(RecordedResult("note", {}, "in the new one"))  # on the GUI thread: shown at once
    assert [r["summary"] for r in window.audit_panel.rows()] == ["in the new one"]


def test_drop_and_paste_set_the_image(qtbot, window):
    sample = bundled_samples()[1]
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(sample.image_path))])
    drop = QDropEvent(
        QPointF(10, 10), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier
    )
    window.dropEvent(drop)
    assert window.image_name == sample.image_path.name

    QApplication.clipboard().setImage(QImage(str(bundled_samples()[2].image_path)))
    window.actions.paste_image()
    assert window.image_name == "pasted image"
    assert window.image.size == core.load_image(bundled_samples()[2].image_path).size


def test_worker_reports_errors_as_one_line(qtbot):
    def broken(*, progress, cancel):
        raise ValueError("line one\nline two")

    def refused(*, progress, cancel):
        raise core.ImageLoadError("x.png: not an image file PIL can read")

    pool = WorkerPool()
    for fn, message in ((broken, "ValueError: line one line two"), (refused, "x.png: not an image file PIL can read")):
        worker = Worker(fn)
        with qtbot.waitSignal(worker.failed, timeout=5_000) as failed:
            pool.start(worker)
        assert failed.args == [message]
    assert pool.shutdown() and pool.running() == []


def test_worker_runs_off_gui_thread_and_cancels(qtbot):
    seen = {}

    def wait_for_cancel(*, progress, cancel):
        seen["thread"] = threading.get_ident()
        progress(0, 0, "waiting")
        cancel.wait(10)
        return "done"

    pool = WorkerPool()
    worker = Worker(wait_for_cancel)
    with qtbot.waitSignal(worker.progress, timeout=5_000):
        pool.start(worker)
    assert seen["thread"] != threading.get_ident()
    with qtbot.waitSignal(worker.cancelled, timeout=5_000):
        worker.cancel()
    assert pool.shutdown() and pool.running() == []


def test_no_garbage_collection_runs_on_a_worker_thread(qtbot):
    """While any worker runs, Python's automatic collection is off (a collection in a
    worker thread could free Qt objects there, which aborts the process); once the last
    worker's thread has ended it is on again, also after a shutdown that joins them."""
    import gc

    seen = []

    def job(*, progress, cancel):
        seen.append(gc.isenabled())
        cancel.wait(0.2)
        return "done"

    assert gc.isenabled()
    pool = WorkerPool()
    first, second = Worker(job), Worker(job)
    with qtbot.waitSignals([first.qthread.finished, second.qthread.finished], timeout=5_000):
        pool.start(first)
        pool.start(second)
    qtbot.waitUntil(lambda: gc.isenabled(), timeout=5_000)  # the queued release ran on the GUI thread
    assert seen == [False, False]
    third = pool.start(Worker(job))
    assert not gc.isenabled()
    assert pool.shutdown() and gc.isenabled() and third.returned

    # Switched back on, not forced: a full collection after every job held the GUI thread
    # 0.1-1 s with a model and its results on the heap.
    collections = []

    def seen_collection(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(seen_collection)
    try:
        fourth = Worker(job)
        fourth.start()
        fourth.qthread.wait()
        fourth.release_collection()
    finally:
        gc.callbacks.remove(seen_collection)
    assert gc.isenabled() and collections == []


@pytest.mark.parametrize("image_arg", [None, "not_an_image.png"])
def test_main_screenshot(qtbot, tmp_path, image_arg):
    shot = tmp_path / "app.png"
    argv = ["--model", "shapes-coca", "--screenshot", str(shot), "--session", str(tmp_path / "s.vlmr")]
    if image_arg:
        (tmp_path / image_arg).write_text("not an image")
        argv += ["--image", str(tmp_path / image_arg)]
    assert main(argv) == 0
    image = QImage(str(shot))
    assert not image.isNull() and image.width() > 400


def test_the_screenshot_run_leaves_the_process_able_to_run_windows(qtbot, tmp_path, window, model_cache):
    """main() runs an event loop of its own: Qt 6's quit() closed every window
    of the process (this one too) and, once quit, every later event loop of the
    thread returned at once, so every window test after it timed out."""
    from app.main_window import MainWindow

    argv = ["--model", "shapes-llava", "--screenshot", str(tmp_path / "a.png"), "--session", str(tmp_path / "s.vlmr")]
    assert main(argv) == 0
    assert window.isVisible() and not window.runner.closed
    run_until_idle(qtbot, window, window.actions.run_readout)  # a window opened before it
    later = MainWindow(model_cache=model_cache, session_path=tmp_path / "later.vlmr")
    qtbot.addWidget(later)
    later.show()
    run_until_idle(qtbot, later, later.actions.run_readout)  # and one opened after it
    assert later.analysis is not None and window.analysis is not None
    later.close()


def test_missing_x11_libraries_give_one_clear_line(monkeypatch, capsys):
    """Without the system libraries Qt's xcb plugin loads, the app says which
    and how to install them, instead of Qt's abort."""
    import ctypes.util

    import app.__main__ as entry

    monkeypatch.setattr(entry.sys, "platform", "linux")
    monkeypatch.setenv("QT_QPA_PLATFORM", "xcb")
    monkeypatch.setenv("DISPLAY", ":99")
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None if name == "xcb-cursor" else f"lib{name}.so")
    assert entry.main(["--model", "shapes-coca"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "libxcb-cursor0" in err[0]
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    assert entry.missing_display_libraries() == []


def test_none_survives_many_windows(qtbot, model_cache, tmp_path):
    """Building and closing windows must not be able to free None, True or False (see app._pin_singletons)."""
    import gc
    import sys

    from app.main_window import MainWindow

    before = sys.getrefcount(None)
    for i in range(3):
        w = MainWindow(model_cache=model_cache, session_path=tmp_path / f"s{i}.vlmr")
        w.close()
        w.deleteLater()
    gc.collect()
    if sys.version_info < (3, 12):
        for singleton in (None, True, False):  # pinned: PySide6's extra releases cannot reach zero
            assert sys.getrefcount(singleton) > 1 << 39
    assert sys.getrefcount(None) > before - 1_000_000
