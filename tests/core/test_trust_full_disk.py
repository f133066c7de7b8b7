"""A full disk is called a full disk, never a corrupt session (issue 27).

Reading a session needs no write: with a -wal beside it and no -shm (a writer
killed, a copied folder), or a -shm SQLite cannot grow, the session and its
committed WAL transactions are read into memory (core/session/files.py,
replayed_copy) instead of SQLite creating files beside it. Recording on a full
disk is one line that says so, and the runs already in the session stay as
they were. Two ways to make the disk full: a 1 MiB tmpfs filled to the last
byte (needs root and mount: skipped otherwise), and everywhere a file-size
limit (RLIMIT_FSIZE in a subprocess, SIGXFSZ ignored: every write past it
fails with EFBIG, as a full disk fails with ENOSPC)."""

import errno
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import core.cli
import core.files.atomic
from core.cli import main
from core.results.readout import RecordedResult
from core.session import Session, SessionError, record_into
from core.session.records import _sqlite_problem
from tests.core.test_trust_session_files import _session

ROOT = Path(__file__).resolve().parents[2]


def _killed_writer_copy(source: Path, folder: Path) -> Path:
    """``folder/s.vlmr`` as a writer killed mid-session leaves it: two runs
    committed to its -wal and not yet in the main file, and no -shm."""
    writer = Session.open(source)
    writer.checkpoint_each_run = False  # as if killed before the checkpoint that follows each run
    writer._conn.execute("PRAGMA wal_autocheckpoint = 0")
    for i in range(2):
        writer.record(RecordedResult("note", {"i": i, "pad": "x" * 3000}, f"only in the wal {i}"))
    folder.mkdir(exist_ok=True)
    shutil.copyfile(source, folder / "s.vlmr")
    shutil.copyfile(source.with_name(source.name + "-wal"), folder / "s.vlmr-wal")
    writer.close()
    return folder / "s.vlmr"


def _summaries(out: Path) -> list[str]:
    return [r["summary"] for r in json.loads(out.read_text())["runs"]]


def _listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


ALL_RUNS = ["a 2x2 sweep", "painted", "a note", "only in the wal 0", "only in the wal 1"]


# ---------------------------------------------------------------- the messages (no disk needed)


def _sqlite_error(text: str, name: str) -> sqlite3.OperationalError:
    e = sqlite3.OperationalError(text)
    e.sqlite_errorname = name
    return e


def test_an_io_error_with_no_space_left_is_the_disk_full_and_never_corruption(tmp_path, monkeypatch):
    p = tmp_path / "s.vlmr"
    io_error = _sqlite_error("disk I/O error", "SQLITE_IOERR_SHMSIZE")
    full = _sqlite_error("database or disk is full", "SQLITE_FULL")
    plenty = _sqlite_problem(p, io_error, "record the run")
    assert plenty == f"{p}: cannot record the run: an input/output error on its disk (SQLite: disk I/O error)"

    class NoSpace:
        f_blocks, f_bavail, f_frsize = 1000, 3, 4096

    monkeypatch.setattr(core.files.atomic.os, "statvfs", lambda path: NoSpace)
    for e in (io_error, full):
        line = _sqlite_problem(p, e, "open it")
        assert line.startswith(f"{p}: cannot open it: the disk is full (12 KB free on the file system of {tmp_path})")
        assert (
            "corrupt" not in line
            and "\n" not in line
            and line.endswith("the runs already in the session are unchanged")
        )
    corrupt = _sqlite_error("database disk image is malformed", "SQLITE_CORRUPT")
    assert _sqlite_problem(p, corrupt) == f"{p}: corrupt session file (database disk image is malformed)"


def test_a_failed_write_of_an_output_names_the_full_disk(tmp_path, monkeypatch, capsys):
    session = _session(tmp_path / "s.vlmr")
    out = tmp_path / "audit.json"
    out.write_text("the earlier export\n")

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(core.files.atomic.os, "fsync", no_space)
    assert main(["export", "--session", str(session), "--format", "json", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: cannot write {out}: No space left on device; the existing file is unchanged"]
    assert out.read_text() == "the earlier export\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "audit.json",
        "s.vlmr",
    ]


# ---------------------------------------------------------------- a session whose -wal SQLite cannot read without writing


def test_a_wal_without_its_shm_is_read_in_memory_and_nothing_is_written_beside_it(tmp_path, capsys):
    copy = _killed_writer_copy(_session(tmp_path / "s.vlmr"), tmp_path / "copy")
    before = _listing(copy.parent)
    assert main(["export", "--session", str(copy), "--format", "json", "--out", str(tmp_path / "a.json")]) == 0
    assert capsys.readouterr().err == ""
    assert _summaries(tmp_path / "a.json") == ALL_RUNS  # the runs only the -wal holds are there
    assert _listing(copy.parent) == before  # no -shm made, nothing changed
    torn = copy.with_name("s.vlmr-wal")
    torn.write_bytes(torn.read_bytes()[:-100])  # the last transaction cut short: as SQLite, left out
    assert main(["export", "--session", str(copy), "--format", "json", "--out", str(tmp_path / "a.json")]) == 0
    assert _summaries(tmp_path / "a.json") == ALL_RUNS[:-1]


# ---------------------------------------------------------------- a file-size limit (runs everywhere)

_LIMITED = textwrap.dedent(
    """
    import json, resource, signal, sys
    from pathlib import Path
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
    from core.cli import main
    from core.results.readout import RecordedResult
    from core.session import SessionError, record_into
    session, out = sys.argv[2], sys.argv[3]
    code = main(["export", "--session", session, "--format", "csv", "--out", out + ".csv"])
    big = main(["export", "--session", session, "--format", "html", "--out", out + ".html"])
    try:
        record_into(session, RecordedResult("note", {"pad": "y" * 200_000}, "does not fit"))
        recorded = "recorded"
    except SessionError as e:
        recorded = str(e)
    print(json.dumps({"csv": code, "html": big, "record": recorded}))
    """
)


def test_a_file_size_limit_reads_every_run_and_refuses_a_record_in_one_line(tmp_path):
    copy = _killed_writer_copy(_session(tmp_path / "s.vlmr"), tmp_path / "copy")
    copy.with_name("s.vlmr-shm").write_bytes(b"")  # a -shm SQLite would have to grow past the limit
    before = _listing(copy.parent)
    limit = 16 * 1024
    done = subprocess.run(
        [sys.executable, "-c", _LIMITED, str(limit), str(copy), str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert result["csv"] == 0 and (tmp_path / "out.csv").read_text().count("only in the wal") == 2
    assert (
        result["html"] == 2
        and len(errors) == 1
        and errors[0] == f"error: cannot write {tmp_path}/out.html: File too large"
    )
    assert result["record"].startswith(f"{copy}: cannot ")
    assert f"the file-size limit (ulimit -f) of {limit:,} bytes is reached" in result["record"]
    assert "corrupt" not in result["record"] and "\n" not in result["record"]
    after = _listing(copy.parent)
    assert after["s.vlmr"] == before["s.vlmr"] and after["s.vlmr-wal"] == before["s.vlmr-wal"]
    with Session.open(copy, read_only=True) as s:  # every earlier run as it was
        assert [r.summary for r in s.runs()] == ALL_RUNS


# ---------------------------------------------------------------- a small full tmpfs (root and mount only)


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs at ``tmp_path/disk``, unmounted afterwards; skipped where it cannot be mounted."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path) -> None:
    """Write a ballast file until the file system has no byte left."""
    fd = os.open(disk / "ballast", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for chunk in (65536, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_export_and_record_on_a_full_tmpfs(full_disk, tmp_path, capsys, monkeypatch):
    source = _session(tmp_path / "s.vlmr")
    intact = _killed_writer_copy(source, full_disk / "intact")  # a -wal and no -shm
    shutil.copyfile(source, full_disk / "closed.vlmr")  # closed cleanly (every run checkpointed): the main file alone
    _fill(full_disk)
    before = {p: _listing(p) for p in (full_disk, full_disk / "intact")}
    for session in (intact, full_disk / "closed.vlmr"):
        out = tmp_path / f"{session.stem}.json"
        assert main(["export", "--session", str(session), "--format", "json", "--out", str(out)]) == 0
        assert capsys.readouterr().err == "" and _summaries(out) == ALL_RUNS
    # recording (an existing session or a new one): one line saying the disk is full, before the model loads
    monkeypatch.setattr(core.cli, "_load", lambda args: pytest.fail("the model loaded before the session was checked"))
    image = ROOT / "resources" / "samples" / "sample_00.png"
    argv = ["analyze", "--image", str(image), "--question", "q?", "--json", str(tmp_path / "a.json")]
    for session in (intact, full_disk / "closed.vlmr", full_disk / "new.vlmr"):
        assert main([*argv, "--session", str(session)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {session}: cannot ") and "the disk is full" in err[0], err
        assert "corrupt" not in err[0]
        with pytest.raises(SessionError, match="the disk is full") as e:
            record_into(session, RecordedResult("note", {}, "x"))
        assert str(e.value).startswith(f"{session}: cannot ") and "\n" not in str(e.value)
    assert not (tmp_path / "a.json").exists()
    assert not (full_disk / "new.vlmr").exists()  # a half-made session is not left behind
    for folder, listing in before.items():
        kept = _listing(folder)
        for name in ("s.vlmr", "s.vlmr-wal", "closed.vlmr"):
            if name in listing:
                assert kept[name] == listing[name], f"{name} changed"
    (full_disk / "ballast").unlink()  # room again: every run is still there
    with Session.open(intact, read_only=True) as s:
        assert [r.summary for r in s.runs()] == ALL_RUNS


def test_a_writer_on_a_full_tmpfs_fails_one_record_and_keeps_its_runs(full_disk, tmp_path, capsys):
    session = full_disk / "s.vlmr"
    shutil.copyfile(_session(tmp_path / "s.vlmr"), session)
    with Session.open(session) as writer:  # the app has it open: its -wal and -shm exist
        _fill(full_disk)
        assert main(["export", "--session", str(session), "--format", "csv", "--out", str(tmp_path / "a.csv")]) == 0
        assert capsys.readouterr().err == ""
        with pytest.raises(SessionError) as e:
            writer.record(RecordedResult("note", {"pad": "z" * 300_000}, "does not fit"))
        line = str(e.value)
        assert line.startswith(f"{session}: cannot record the run: the disk is full") and "\n" not in line
        assert [r.summary for r in writer.runs()] == ["a 2x2 sweep", "painted", "a note"]
        (full_disk / "ballast").unlink()
        assert writer.record(RecordedResult("note", {}, "room again")) == 4
