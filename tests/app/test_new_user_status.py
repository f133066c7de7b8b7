"""Issue 28, part 5 (H3): the faults a new user met in the window's status lines,
on quitting, in the model list and in a corrupt session's message.

* the status line always says what is happening now: a job starting says what it
  does at once; a later successful action clears an older failure; a refusal for
  a precondition the user can meet (paint a region, select a head, name a subject)
  goes when it is met;
* closing the window during a job that cannot stop mid-forward lets the process
  exit at once (a subprocess, as a user runs the app), the session intact;
* only a model that loaded joins the model list (and the remembered models);
* a corrupt session is one line (a count of SQLite's problems and the first).

Own file: these tests wait on worker signals (see tests/app/conftest.py).
"""

import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtTest import QTest

from app.recent_models import recent_models
from app.samples import bundled_samples
from core.results.readout import RecordedResult
from core.session import Session
from tests.app.test_window import TIMEOUT_MS, run_until_idle

REPO = Path(__file__).resolve().parents[2]
SUBJECT = "L1.H1"
CLAIM = "L1.H1 reads the colour of the shape asked about, at the answer position, on shape scenes"


def state_claim(window, n: int = 12) -> None:
    panel = window.validation_panel
    panel.subject_edit.setText(SUBJECT)
    panel.claim_edit.setText(CLAIM)
    panel.set_dataset("scenes")
    panel.n_spin.setValue(n)


def cancel_and_wait(qtbot, window) -> None:
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        qtbot.mouseClick(window.inputs.cancel_button, Qt.MouseButton.LeftButton)


# ----- 1. the status line describes the current state ------------------------------


def test_a_job_says_what_it_does_as_it_starts(qtbot, window):
    """Seen: "cancelled" (or "ready") beside a busy bar for 12-15 s as a validation starts."""
    run_until_idle(qtbot, window, window.actions.answer_question)  # the model loaded: no "loading model" line comes
    assert window.inputs.status_label.text() == "ready"
    state_claim(window, n=150)
    window.tabs.setCurrentIndex([window.tabs.tabText(i) for i in range(window.tabs.count())].index("Validation"))
    qtbot.mouseClick(window.validation_panel.run_button, Qt.MouseButton.LeftButton)
    assert window.is_busy() and window.inputs.status_label.text() == "validating…"  # at once, before any progress
    cancel_and_wait(qtbot, window)
    assert window.inputs.status_label.text() == "cancelled"
    qtbot.mouseClick(window.validation_panel.run_button, Qt.MouseButton.LeftButton)
    assert window.is_busy() and window.inputs.status_label.text() == "validating…"  # not the last job's "cancelled"
    cancel_and_wait(qtbot, window)
    # every other job too: Read out and the answer each name theirs as they start
    for start, doing in ((window.actions.run_readout, "reading out…"), (window.actions.answer_question, "answering…")):
        with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
            assert start()
            assert window.inputs.status_label.text() == doing
        assert window.inputs.status_label.text() == "ready"


def test_a_later_success_clears_an_older_failure(qtbot, window):
    """Seen: "failed" stayed beside the status after later images loaded fine."""
    window.set_question("what is a zebra?")  # a word the model's vocabulary lacks: the answer fails
    run_until_idle(qtbot, window, window.actions.answer_question)
    assert window.inputs.status_label.text() == "failed" and "zebra" in window.inputs.error_label.text()
    assert window.load_sample(bundled_samples()[1])  # a new image, loaded fine
    assert window.inputs.status_label.text() == "ready" and window.inputs.error_label.text() == ""
    # and a cancelled job is not the state once something new was done
    samples = bundled_samples() * 20
    window.actions.answer_pairs([s.image_path for s in samples], [s.question for s in samples], batch_size=1)
    assert window.inputs.status_label.text() == "answering the pairs…"
    cancel_and_wait(qtbot, window)
    assert window.inputs.status_label.text() == "cancelled"
    assert window.load_sample(bundled_samples()[2])
    assert window.inputs.status_label.text() == "ready"


def test_a_load_warning_shows_only_while_its_model_is_picked(qtbot, window, tmp_path):
    """A model's load warning beside the status is about that model: picking another one (no job
    yet) takes it away, picking it again brings it back."""
    import shutil

    from safetensors.torch import load_file, save_file

    from core.models.loading import resources_dir

    folder = tmp_path / "extra-llava"
    shutil.copytree(resources_dir() / "models" / "shapes-llava", folder)
    (folder / "MANIFEST.sha256").unlink(missing_ok=True)  # a user's folder
    weights = load_file(str(folder / "model.safetensors"))
    weights["extra.probe.weight"] = weights[next(iter(weights))].clone()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    window.inputs.model_picker.setCurrentText(str(folder))
    run_until_idle(qtbot, window, window.actions.answer_question)
    assert window.inputs.status_label.text().startswith("ready; warning: ") and "extra.probe.weight" in (
        window.inputs.status_label.text()
    )
    window.inputs.model_picker.setCurrentText("shapes-llava")
    assert window.inputs.status_label.text() == "ready"
    window.inputs.model_picker.setCurrentText(str(folder))
    assert "extra.probe.weight" in window.inputs.status_label.text()


def paint(window) -> None:
    """A box painted on the Counterfactual tab's canvas, as the box tool paints one."""
    height, width = window.image.height, window.image.width
    window.counterfactual_panel.canvas.paint_box(width * 0.2, height * 0.2, width * 0.6, height * 0.6)
    assert window.counterfactual_panel.mask().any()


def test_a_precondition_message_goes_when_it_is_met(qtbot, window):
    """Seen: "patching: paint a region …" stayed after a region was painted."""
    interventions = window.intervention_panel
    interventions.set_positions("region")
    interventions.source_combo.setCurrentIndex(1)  # a bundled sample as the source
    assert not window.actions.patch_region()
    said = interventions.message_label.text()
    assert said.startswith("patching: paint a region") and window.inputs.error_label.text() == said
    paint(window)
    assert interventions.message_label.text() == "" and window.inputs.error_label.text() == ""

    # the claim's region: refused without one, the refusal gone when one is painted
    window.counterfactual_panel.canvas.clear_mask()
    state_claim(window)
    window.validation_panel.region_check.setChecked(True)
    assert not window.actions.run_claim()
    said = window.validation_panel.message_label.text()
    assert said.startswith("painted region: paint one") and window.inputs.error_label.text() == said
    paint(window)
    assert window.validation_panel.message_label.text() == "" and window.inputs.error_label.text() == ""
    # a subject to name: the refusal goes once one is typed
    window.validation_panel.subject_edit.setText("")
    assert not window.actions.run_claim() and window.inputs.error_label.text().startswith("name a head or route")
    QTest.keyClicks(window.validation_panel.subject_edit, "L1.H0")
    assert window.validation_panel.message_label.text() == "" and window.inputs.error_label.text() == ""

    # the Counterfactual tab's own Run without a region
    window.counterfactual_panel.canvas.clear_mask()
    assert not window.counterfactual_panel.request_run()
    assert window.counterfactual_panel.message_label.text().startswith("paint a region first")
    paint(window)
    assert window.counterfactual_panel.message_label.text() == ""

    # a head to select: the head actions' refusal goes once a head is clicked in Attention
    run_until_idle(qtbot, window, window.actions.run_readout)
    assert not window.actions.run_qk_ov()
    assert window.head_methods.message_label.text().startswith("select a head first")
    assert window.inputs.error_label.text() == window.head_methods.message_label.text()
    window.attention_panel.select_head(1, 0)
    assert window.selection.current is not None and window.selection.current.name == "L1.H0"
    assert window.head_methods.message_label.text() == "" and window.inputs.error_label.text() == ""


def test_an_unmet_precondition_keeps_its_message_and_another_message_is_left_alone(qtbot, window):
    """The refusal goes only when its precondition is met, and never takes a later message with it."""
    interventions = window.intervention_panel
    interventions.set_positions("region")
    interventions.source_combo.setCurrentIndex(1)
    assert not window.actions.patch_region()
    said = window.inputs.error_label.text()
    window.counterfactual_panel.canvas.paint_box(0, 0, 0, 0, erase=True)  # an edit that paints nothing
    assert window.inputs.error_label.text() == said and interventions.message_label.text() == said
    window.show_error("something else went wrong")
    paint(window)
    assert window.inputs.error_label.text() == "something else went wrong"
    assert interventions.message_label.text() == ""


# ----- 2. quitting during a long job -------------------------------------------------

DRIVER = textwrap.dedent(
    """
    import sys, threading, time
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication
    import app.__main__ as entry
    from app.main_window import MainWindow

    app = QApplication([])
    in_forward = threading.Event()

    def drive():
        window = next(w for w in app.topLevelWidgets() if isinstance(w, MainWindow))

        def validate():  # after the first read-out: the model is loaded
            window.idle.disconnect(validate)
            adapter = window.loaded_model().adapter
            run_model = adapter.run_model

            def slow_forward(*args, **kwargs):  # as a large model's forward: long, and it cannot poll the cancel
                in_forward.set()
                time.sleep(40)
                return run_model(*args, **kwargs)

            adapter.run_model = slow_forward
            panel = window.validation_panel
            panel.subject_edit.setText("L1.H1")
            panel.claim_edit.setText("L1.H1 reads the colour of the shape")
            panel.set_dataset("scenes")
            panel.n_spin.setValue(150)
            assert window.actions.run_claim()
            close_when_in_forward()

        def close_when_in_forward():
            if not in_forward.is_set():
                QTimer.singleShot(50, close_when_in_forward)
                return
            print(f"closing {time.monotonic()}", flush=True)
            window.close()

        window.idle.connect(validate)

    QTimer.singleShot(0, drive)
    status = entry.main(sys.argv[1:])
    print(f"main returned {time.monotonic()}", flush=True)
    sys.exit(status)
    """
)


def test_closing_during_a_long_job_lets_the_process_exit_at_once(tmp_path):
    """Seen: the process stayed 12-36 s after the window closed, once with "QThread: Destroyed
    while thread is still running". Closing during a validation whose forward cannot poll the
    cancel (made 40 s long, as a large model's) lets the process exit within a few seconds with
    no such line, and the session holds the read-out and nothing of the validation."""
    session = tmp_path / "s.vlmr"
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, "--model", "shapes-llava", "--session", str(session)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    closed_at = None
    for line in proc.stdout:
        if line.startswith("closing"):
            closed_at = time.monotonic()
            break
    assert closed_at is not None, proc.stderr.read()
    try:
        proc.wait(timeout=60)
    finally:
        proc.kill()
    exited_after = time.monotonic() - closed_at
    stderr = proc.stderr.read()
    assert "QThread" not in stderr and "Fatal" not in stderr, stderr
    assert proc.returncode == 0, stderr
    assert exited_after < 5.0, f"the process lived {exited_after:.1f} s after the window closed"
    with Session.open(session) as s:  # intact: the read-out recorded, nothing of the cancelled chain
        assert s.check() == "ok"
        assert [r.kind for r in s.runs()] == ["analyze"]


def test_a_job_left_running_at_close_never_reaches_the_window(qtbot, window):
    """A job that does not stop within the close's wait is let go: its result is dropped (nothing
    recorded into the closed session) and its thread is still joined once it ends."""
    from app.workers import Worker, abandoned_workers

    release = __import__("threading").Event()

    def stubborn(*, progress, cancel):
        release.wait(30)  # does not poll the cancel: as one long forward
        return RecordedResult("note", {}, "late")

    shown = []
    worker = Worker(stubborn)
    worker.finished.connect(shown.append)
    window.runner.workers.start(worker)
    window.close_wait_ms = 200  # as app.__main__ sets it
    started = time.monotonic()
    window.close()
    assert time.monotonic() - started < 5.0  # the close does not wait for the forward
    assert window.runner.workers.running() == [] and window.session.closed
    assert abandoned_workers() == [worker]
    release.set()
    qtbot.waitUntil(lambda: abandoned_workers() == [], timeout=5_000)
    qtbot.wait(50)
    assert shown == []  # its outcome never reached the closed window


# ----- 3. the model list holds only models that loaded ----------------------------


def test_a_model_that_failed_to_load_is_not_listed(qtbot, window, tmp_path):
    picker = window.inputs.model_picker
    missing = str(tmp_path / "no-such-model")
    picker.setFocus()
    picker.lineEdit().selectAll()
    QTest.keyClicks(picker.lineEdit(), missing)
    QTest.keyClick(picker.lineEdit(), Qt.Key.Key_Return)  # as a user confirms a typed path
    assert window.inputs.model_spec() == missing
    run_until_idle(qtbot, window, window.actions.answer_question)
    assert window.inputs.status_label.text() == "failed" and missing in window.inputs.error_label.text()
    listed = [picker.itemText(i) for i in range(picker.count())]
    assert missing not in listed and missing not in recent_models()


def test_a_model_that_loaded_is_listed(qtbot, window):
    """The other half: a model folder that loads joins the list (once), whichever job loaded it."""
    from core.models.loading import resources_dir

    folder = str(resources_dir() / "models" / "shapes-llava")  # a model folder, by its path
    picker = window.inputs.model_picker
    picker.setCurrentText(folder)
    state_claim(window, n=150)
    assert window.actions.run_claim()  # not an answer: a validation loads the model too
    qtbot.waitUntil(lambda: window.loaded_model() is not None, timeout=TIMEOUT_MS)
    cancel_and_wait(qtbot, window)
    listed = [picker.itemText(i) for i in range(picker.count())]
    assert listed.count(folder) == 1 and recent_models()[0] == folder


# ----- 4. a corrupt session is one line -------------------------------------------


def corrupt_session(path: Path) -> None:
    """A session whose free pages are lost (SQLite: "Page N is never used", one line each)."""
    with Session.create(path) as s:
        for i in range(10):
            s.record(RecordedResult("note", {"x": list(range(3000)), "i": i}))
    with sqlite3.connect(path) as c:
        c.execute("PRAGMA journal_mode=DELETE")
        c.execute("DELETE FROM runs")
    c.close()
    data = bytearray(path.read_bytes())
    data[32:40] = bytes(8)  # the freelist's first trunk page and count
    path.write_bytes(bytes(data))
    with sqlite3.connect(path) as c:
        problems = c.execute("PRAGMA integrity_check(100)").fetchone()[0].splitlines()
    c.close()
    assert sum(p.startswith("Page ") for p in problems) > 3  # several lines: the message summarises them


def test_a_corrupt_session_is_one_line_in_the_window_and_the_cli(qtbot, model_cache, tmp_path, monkeypatch):
    from app.main_window import MainWindow

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the window's fallback session goes there

    path = tmp_path / "corrupt.vlmr"
    corrupt_session(path)
    win = MainWindow(model_cache=model_cache, session_path=path)
    qtbot.addWidget(win)
    said = win.sessions.label.text()
    assert said.startswith(f"cannot use the session {path}: {path}: corrupt session file (SQLite integrity check: ")
    assert "problems, first: Page " in said and said.count("never used") == 1 and "***" not in said
    win.close()

    out = subprocess.run(
        [sys.executable, "-m", "core.cli", "export", "--session", str(path), "--format", "csv", "--out", "o.csv"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and lines[0].count("never used") == 1, lines
    assert "problems, first: Page " in lines[0] and not (tmp_path / "o.csv").exists()
