"""The app opens a session from elsewhere as export reads it (issue 27): a run
holding values the session never writes is named in the error line and the
other runs are shown; a session none of whose runs can be read is refused
whole and the current session stays; the window keeps running."""

from app.panels.history_panel import COLUMNS
from core.results.readout import RecordedResult
from core.session import Session
from tests.core.test_trust_session_files import _sql


def _session(path):
    with Session.create(path) as s:  # no model: showing a run loads none
        for summary in ("first", "second", "third"):
            s.record(RecordedResult("note", {"text": summary}, summary))
    return path


def test_a_damaged_run_is_named_and_the_others_are_shown(window, tmp_path):
    path = _session(tmp_path / "damaged.vlmr")
    _sql(path, "UPDATE runs SET parameters = 'null' WHERE id = 3", "UPDATE runs SET created = x'00' WHERE id = 1")
    assert window.sessions.open_session(path, mode="append") is True
    line = window.inputs.error_label.text()
    assert line.startswith("damaged.vlmr: run 1 cannot be read (created holds a blob, expected text) (and 1 more)")
    assert line.endswith("the other runs are shown") and "\n" not in line
    assert [r.id for r in window.session.runs()] == [2, 3]  # run 3's listed values read; its parameters do not
    assert [row["run_id"] for row in window.session.audit_table()] == [2]
    assert window.history_panel.run_ids() == [2, 3]
    answers = [window.history_panel.table.item(r, COLUMNS.index("answer")).text() for r in range(2)]
    assert answers == ["second", "damaged: parameters holds JSON null, expected a JSON object"]
    window.session.record(RecordedResult("note", {}, "recorded after"))  # the window keeps working
    assert window.history_panel.run_ids() == [2, 3, 4]


def test_a_session_none_of_whose_runs_reads_is_refused_and_the_current_one_stays(window, tmp_path):
    window.session.record(RecordedResult("note", {}, "current work"))
    current = window.session
    path = _session(tmp_path / "all-damaged.vlmr")
    deep = "[" * 5000 + "]" * 5000
    _sql(path, "UPDATE runs SET parameters = 'null' WHERE id < 3", f"UPDATE runs SET result = '{deep}' WHERE id = 3")
    for mode in ("append", "read_only"):
        assert window.sessions.open_session(path, mode=mode) is False
        line = window.inputs.error_label.text()
        assert (
            line.startswith("cannot open the session: ") and "none of its runs can be read (run 1: parameters" in line
        )
        assert window.session is current and not current.closed
    assert [r.summary for r in current.runs()] == ["current work"]
