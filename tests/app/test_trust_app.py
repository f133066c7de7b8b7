"""The app with a session it cannot use: at start-up the window opens and says
so (recording into a new session it names, or into one in memory when none
can be made); File > Open session with a bad file keeps the current session."""

import os
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
from PySide6.QtGui import QImage

from app.main_window import MainWindow
from core.results.readout import RecordedResult
from core.session import Session

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """The user's home, where the fallback session goes (never the real one)."""
    folder = tmp_path / "home"
    folder.mkdir()
    monkeypatch.setenv("HOME", str(folder))
    return folder


def _open_window(qtbot, model_cache, session_path) -> MainWindow:
    win = MainWindow(model_cache=model_cache, session_path=session_path)
    win.show()
    qtbot.waitExposed(win)
    return win


def _bad_sessions(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    junk = tmp_path / "junk.vlmr"
    junk.write_bytes(b"not a database, just bytes\n" * 10)
    foreign = tmp_path / "other.db"
    with closing(sqlite3.connect(foreign)) as c:
        c.execute("CREATE TABLE t (x)")
        c.commit()
    folder = tmp_path / "a-folder.vlmr"
    folder.mkdir()
    return {
        "not SQLite": (junk, "not a session file"),
        "another program's database": (foreign, "another program"),
        "a folder": (folder, "is a folder, not a session file"),
        "in a missing folder": (tmp_path / "missing" / "s.vlmr", "no such folder"),
    }


@pytest.mark.parametrize("case", ["not SQLite", "another program's database", "a folder", "in a missing folder"])
def test_unusable_session_at_start_opens_the_window_and_names_the_new_one(qtbot, model_cache, tmp_path, home, case):
    bad, needle = _bad_sessions(tmp_path)[case]
    before = bad.read_bytes() if bad.is_file() else None
    win = _open_window(qtbot, model_cache, bad)
    try:
        line = win.sessions.label.text()
        assert line.startswith(f"cannot use the session {bad}: ") and needle in line, line
        assert "\n" not in line and "c00000" in win.sessions.label.styleSheet()  # red, and it stays
        fallback = win.session.path
        assert fallback.parent == home / ".local" / "share" / "vlm-readout" / "sessions" and fallback.is_file()
        assert line.endswith(f"recording into a new session {fallback} instead")
        win.session.record(RecordedResult("note", {}, "kept"))
        assert [r.summary for r in win.session.runs()] == ["kept"]
    finally:
        win.close()
    assert (bad.read_bytes() if bad.is_file() else None) == before  # the bad file is left as it was


def test_no_session_file_anywhere_records_in_memory_and_says_so(qtbot, model_cache, tmp_path, monkeypatch):
    not_a_folder = tmp_path / "home-is-a-file"
    not_a_folder.write_text("x")
    monkeypatch.setenv("HOME", str(not_a_folder))  # the data folder cannot be made either
    win = _open_window(qtbot, model_cache, tmp_path / "missing" / "s.vlmr")
    try:
        line = win.sessions.label.text()
        assert "no such folder" in line and line.endswith("recording into a temporary session that is not saved")
        win.session.record(RecordedResult("note", {}, "in memory"))
        assert len(win.session.runs()) == 1
    finally:
        win.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home-is-a-file"]  # nothing created elsewhere


def test_main_starts_with_a_bad_session_and_shows_it(tmp_path, home):
    """``vlm-readout-app --session junk`` used to be a traceback and no window.
    In a fresh process, as at start-up (app.main's quit leaves this process's
    QApplication unable to run later tests' event loops); the window's line is
    checked by the tests above, the terminal gets it as one warning line."""
    junk = tmp_path / "junk.vlmr"
    junk.write_bytes(b"junk" * 100)
    (tmp_path / "not_an_image.png").write_text("not an image")  # no read-out starts: no model loads
    shot = tmp_path / "app.png"
    argv = ["--session", str(junk), "--image", str(tmp_path / "not_an_image.png"), "--screenshot", str(shot)]
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "HF_HUB_OFFLINE": "1", "HOME": str(home)}
    done = subprocess.run(
        [sys.executable, "-m", "app", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and f"cannot use the session {junk}" in warnings[0]
    assert not QImage(str(shot)).isNull()
    assert junk.read_bytes() == b"junk" * 100


@pytest.mark.parametrize("mode", ["append", "read_only"])
def test_open_session_with_a_bad_file_keeps_the_current_session(qtbot, window, tmp_path, mode):
    window.session.record(RecordedResult("note", {}, "current work"))
    current, label = window.session, window.sessions.label.text()
    broken = tmp_path / "broken.vlmr"
    with Session.create(broken) as s:
        s.record(RecordedResult("analyze", {}, "x"))
    with closing(sqlite3.connect(broken)) as c:
        c.execute("UPDATE runs SET result = '{not json'")
        c.commit()
    bad = _bad_sessions(tmp_path)
    bad["in a missing folder"] = (bad["in a missing folder"][0], "no such session file")  # opened, not created
    for path, needle in [*bad.values(), (broken, "stored JSON unreadable")]:
        assert window.sessions.open_session(path, mode=mode) is False
        assert (
            window.inputs.error_label.text().startswith("cannot open the session: ")
            and needle in window.inputs.error_label.text()
        )
        assert window.session is current and not current.closed and window.sessions.label.text() == label
        assert [r.summary for r in current.runs()] == ["current work"]
    good = tmp_path / "good.vlmr"
    Session.create(good).close()
    assert window.sessions.open_session(good, mode=mode) is True
    assert current.closed
    if mode == "append":
        assert window.session.path == good and window.sessions.label.text() == f"session: {good}"
    else:  # a copy records the later runs; the file is only read
        assert window.session.path != good
        assert window.sessions.label.text() == f"session: {good} (read-only; new runs are not saved into it)"
