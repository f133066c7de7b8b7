"""The History tab: the session's runs as rows (id, kind, time, thumbnail,
question, answer, model) that follow the session's events; selecting a row
asks for that run; the open-session question. No model runs here."""

from __future__ import annotations

import threading

import numpy as np
from PIL import Image
from PySide6.QtWidgets import QMessageBox

from app.components import NOTHING_SHOWN
from app.panels.history_panel import COLUMNS, HistoryPanel, HistoryRow, local_time
from app.samples import bundled_samples
from app.workers import Worker
from core.methods.flow.attribution import AttributionPatching
from core.results.readout import RecordedResult, Target
from core.session import Session

TIMEOUT_MS = 10_000


def _rows(n: int) -> list[HistoryRow]:
    return [
        HistoryRow(
            run_id=i + 1,
            kind="analyze",
            created="2024-05-01T12:00:00.000+00:00",
            image=f"sample_{i}.png",
            thumbnail=np.full((8, 12, 3), 40 * i, np.uint8),
            question=f"question {i}?",
            answer="square (p 0.900)",
            model="shapes-llava",
        )
        for i in range(n)
    ]


def test_panel_lists_rows_and_a_selection_emits_its_run(qtbot):
    panel = HistoryPanel()
    qtbot.addWidget(panel)
    panel.set_runs(_rows(3))
    assert panel.run_ids() == [1, 2, 3] and panel.table.columnCount() == len(COLUMNS)
    assert panel.row_texts(2) == {
        "run": "#2",
        "kind": "analyze",
        "time": local_time("2024-05-01T12:00:00.000+00:00"),
        "image": "sample_1.png",
        "question": "question 1?",
        "answer": "square (p 0.900)",
        "model": "shapes-llava",
    }
    assert all(panel.has_thumbnail(i) for i in (1, 2, 3))
    assert "3 runs" in panel.title.text()

    got: list[int] = []
    panel.run_selected.connect(got.append)
    panel.show_current(3)  # the window says which run it shows: no request
    assert got == [] and panel.current_run() == 3
    assert panel.select_run(2) and got == [2] and panel.current_run() == 2
    assert panel.select_run(2) and got == [2, 2]  # selecting the shown run again restores it again
    panel.table.selectRow(0)  # a click on another row
    panel.table.cellDoubleClicked.emit(0, 0)  # and a double-click on it: shown again
    assert got == [2, 2, 1, 1]
    assert not panel.select_run(99) and got == [2, 2, 1, 1]

    panel.set_runs(_rows(4))  # a new run: the selection stays, nothing is asked
    assert got == [2, 2, 1, 1] and panel.current_run() == 1 and panel.run_ids() == [1, 2, 3, 4]
    panel.set_runs([])
    assert panel.run_ids() == [] and panel.current_run() is None and panel.title.text().startswith("no runs yet")


def test_local_time_reads_the_session_times():
    assert local_time(None) == "" and local_time("not a time") == "not a time"
    assert len(local_time("2024-05-01T12:00:00.000+00:00")) == len("2024-05-01 12:00:00")


def test_window_history_follows_the_session_and_shows_thumbnails(qtbot, window, tmp_path):
    sample = bundled_samples()[0]
    panel = window.history_panel
    assert window.tabs.tabText(window.tabs.indexOf(panel)) == "History"
    assert panel.run_ids() == []
    window.session.record(
        RecordedResult("note", {}, "a note about the scene"),
        image=str(sample.image_path),
        parameters={"question": sample.question},
    )
    assert panel.run_ids() == [1]  # recorded on the GUI thread: shown at once
    row = panel.row_texts(1)
    assert row["kind"] == "note" and row["question"] == sample.question and row["image"] == sample.image_path.name
    assert row["answer"] == "a note about the scene"  # a kind without an answer shows its summary
    assert panel.has_thumbnail(1)

    seen_on: list[bool] = []
    window.sessions.watch.recorded.connect(
        lambda _i: seen_on.append(threading.current_thread() is threading.main_thread())
    )
    job = Worker(lambda *, progress, cancel: window.session.record(RecordedResult("note", {}, "from a thread")))
    with qtbot.waitSignal(job.finished, timeout=TIMEOUT_MS):
        window.runner.workers.start(job)
    qtbot.waitUntil(lambda: panel.run_ids() == [1, 2], timeout=TIMEOUT_MS)
    assert seen_on == [True] and not panel.has_thumbnail(2)
    assert [info.id for info in window.workspace.runs] == [1, 2]

    other = tmp_path / "other.vlmr"
    Session.create(other).close()
    assert window.sessions.open_session(other, mode="append")
    assert panel.run_ids() == [] and window.workspace.runs == []


def test_restoring_a_run_shows_its_image_and_question(qtbot, window, tmp_path):
    """A run without a read-out (a note on an image) restores what it has: the image (from the
    stored pixels: its file is gone) and the question; a run without an image says so."""
    sample = bundled_samples()[2]
    copy = tmp_path / "copied.png"
    copy.write_bytes(sample.image_path.read_bytes())
    run_id = window.session.record(
        RecordedResult("note", {}, "on a copy"), image=str(copy), parameters={"question": "is it a copy?"}
    )
    no_image = window.session.record(RecordedResult("note", {}, "no picture"))
    copy.unlink()
    assert window.load_sample(bundled_samples()[0])
    with qtbot.waitSignal(window.history_panel.run_selected, timeout=TIMEOUT_MS):
        window.history_panel.select_run(run_id)
    assert np.array_equal(np.asarray(window.image), np.asarray(Image.open(sample.image_path).convert("RGB")))
    assert window.image_name == "copied.png" and window.inputs.question_edit.text() == "is it a copy?"
    assert window.workspace.shown.run_id == run_id and window.inputs.error_label.text() == ""
    image_before = window.image
    assert window.history_panel.select_run(no_image)  # a click on it
    assert window.inputs.error_label.text() == f"cannot show run #{no_image}: the session has no image for it"
    assert window.image is image_before and window.workspace.shown.run_id == run_id
    assert window.history_panel.current_run() == run_id  # the history selects the run still shown


def _answer_dialog(monkeypatch, button_text: str | None) -> list[str]:
    """Make the open-session question answer itself with ``button_text`` (None: Cancel)."""
    asked: list[str] = []

    def exec_(box):
        asked.append(box.text())
        for button in box.buttons():
            if (button_text is None and box.buttonRole(button) == QMessageBox.ButtonRole.RejectRole) or (
                button.text() == button_text
            ):
                button.click()
                return 0
        raise AssertionError(f"no button {button_text!r}")

    monkeypatch.setattr(QMessageBox, "exec", exec_)
    return asked


def test_open_session_asks_continue_or_read_only(qtbot, window, tmp_path, monkeypatch):
    shared = tmp_path / "shared.vlmr"
    with Session.create(shared) as s:
        s.record(RecordedResult("note", {}, "shared work"))
    current = window.session

    asked = _answer_dialog(monkeypatch, None)
    assert window.sessions.open_session(shared) is False and asked == ["Open shared.vlmr"]
    assert window.session is current and not current.closed

    _answer_dialog(monkeypatch, "Open read-only")
    assert window.sessions.open_session(shared) is True
    assert window.sessions.label.text() == f"session: {shared} (read-only; new runs are not saved into it)"
    assert window.history_panel.run_ids() == [1]
    window.session.record(RecordedResult("note", {}, "mine"))
    assert window.history_panel.run_ids() == [1, 2]
    with Session.open(shared, read_only=True) as s:
        assert [r.summary for r in s.runs()] == ["shared work"]

    _answer_dialog(monkeypatch, "Continue this session")
    assert window.sessions.open_session(shared) is True
    assert window.session.path == shared and window.sessions.label.text() == f"session: {shared}"
    window.session.record(RecordedResult("note", {}, "appended"))
    with Session.open(shared, read_only=True) as s:
        assert [r.summary for r in s.runs()] == ["shared work", "appended"]


def test_a_result_of_another_shape_is_not_drawn_and_says_so(qtbot, window):
    """An analyze run whose stored JSON is not an analyze result (another version, a hand-made file):
    its image and question are shown, the read-out views stay empty, one line says why."""
    sample = bundled_samples()[1]
    run_id = window.session.record(
        RecordedResult("analyze", {"target": {"answer": "yes"}}, "odd"),
        image=str(sample.image_path),
        parameters={"question": sample.question},
    )
    assert window.sessions.restore_run(run_id)
    assert window.inputs.question_edit.text() == sample.question and window.image_name == sample.image_path.name
    # its stored JSON does not restore as an analyze result: one line naming the kind and what is missing
    assert window.inputs.error_label.text().startswith(
        f"run #{run_id} cannot be drawn (the stored analyze result does not fit"
    )
    assert window.attention_panel.cells == {} and window.answer_panel.label.text() == "no answer yet"
    assert window.workspace.shown.run_id == run_id and window.workspace.shown.results == {}
    assert window.run_frames["attention"].header_text() == NOTHING_SHOWN


def test_a_run_of_a_kind_no_view_draws_says_so(qtbot, window):
    """A run the window has no view of (attribution patching, recorded by the command) shows its
    image and question, and one line says that export shows it, instead of an empty window passing for it."""
    sample = bundled_samples()[0]
    target = Target("yellow", 7, "red", 8, 3.4, 1.2, 0.24, "yellow", 7, 74)
    result = AttributionPatching(["L0"], [[[0.0]]], None, None, [], None, None, target, target)
    run_id = window.session.record(
        RecordedResult.of(result, result.to_dict()),
        image=str(sample.image_path),
        parameters={"question": sample.question},
    )
    assert window.sessions.restore_run(run_id)
    assert window.inputs.question_edit.text() == sample.question
    assert window.inputs.error_label.text() == (
        f"run #{run_id} (attribution-patching): the window has no view of this kind; export shows it"
    )
    assert window.workspace.shown.run_id == run_id
