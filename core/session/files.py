"""The session file on disk: checkpointing the WAL into the main file after
each run (so the ``.vlmr`` alone is the complete session at every moment)
and writing a self-contained copy of a session (:meth:`Session.save_as`)
with SQLite's online backup (see :mod:`core.session`, "Durability").
"""

from __future__ import annotations

import os
import sqlite3
import stat
import tempfile
import time
from pathlib import Path

from core.session.records import SessionError
from core.session.schema import APPLICATION_ID, BUSY_TIMEOUT_S, SQLITE_MAGIC

# A checkpoint waits this long for readers (an export, another window) to leave an old snapshot, per try.
CHECKPOINT_BUSY_MS = 20
CHECKPOINT_TRIES = 5


def checkpoint_wal(conn: sqlite3.Connection) -> bool:
    """``PRAGMA wal_checkpoint(TRUNCATE)``: copy every committed frame of the
    ``-wal`` file into the main file and empty the ``-wal``.

    A reader still on an older snapshot makes SQLite answer busy (it then
    copies what it can, like a passive checkpoint); the checkpoint is retried
    a few times with a short busy timeout and never raises for it. Returns
    True when the main file holds every committed run, False when readers kept
    it busy through every try (the runs are safe in the ``-wal``; the next
    record or :meth:`Session.close` checkpoints again)."""
    conn.execute(f"PRAGMA busy_timeout = {CHECKPOINT_BUSY_MS}")
    try:
        for attempt in range(CHECKPOINT_TRIES):
            try:
                busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            except sqlite3.OperationalError:  # locked by another writer's transaction: try again
                busy = 1
            if not busy:
                return True
            time.sleep(0.002 * (attempt + 1))
        return False
    finally:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` both exist and are one file (a link, another spelling)."""
    try:
        return a.exists() and b.exists() and a.samefile(b)
    except OSError:
        return False


def _is_session_file(p: Path) -> bool:
    """Whether ``p`` is an SQLite file marked as a session (header magic and ``application_id``)."""
    try:
        with open(p, "rb") as fh:
            header = fh.read(100)
    except OSError:
        return False
    return len(header) == 100 and header[:16] == SQLITE_MAGIC and int.from_bytes(header[68:72], "big") == APPLICATION_ID


def check_copy_target(target: Path, own: Path) -> os.stat_result | None:
    """The checks before :func:`backup_to` writes ``target``; its ``lstat`` when it exists.

    Raises:
        SessionError: ``target`` is the session's own file, not a regular file
            (a folder, a link, a device), an existing file that is not a
            session, a session open elsewhere (its ``-wal`` exists), or its
            folder is missing or not writable.
    """
    if same_file(target, own) or target.resolve() == own.resolve():
        raise SessionError(f"{target}: is this session's own file; save the copy under another name")
    if not target.parent.is_dir():
        raise SessionError(f"{target.parent}: no such folder")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise SessionError(f"{target}: cannot write the copy (its folder is not writable)")
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SessionError(f"{target}: cannot look at it ({os.strerror(e.errno) if e.errno else e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise SessionError(f"{target}: not a regular file (a folder, link or device); refusing to replace it")
    if not _is_session_file(target):
        raise SessionError(f"{target}: exists and is not a session file; refusing to overwrite it")
    if target.with_name(target.name + "-wal").exists():
        raise SessionError(f"{target}: that session is open (its -wal file exists); close it or choose another name")
    return st


def backup_to(conn: sqlite3.Connection, own: Path, target: str | Path) -> Path:
    """Write a self-contained copy of the database behind ``conn`` to ``target``:
    SQLite's online backup into a temporary file beside it, fsynced, then
    ``os.replace`` (atomic: ``target`` is the old file or the whole copy,
    never a part). A replaced file keeps its permission bits; a new one gets
    the usual ones (umask). Returns ``target``.

    Raises:
        SessionError: see :func:`check_copy_target`; the copy could not be written
            (the old file, if any, is unchanged and no temporary file is left).
    """
    target = Path(target)
    old = check_copy_target(target, own)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name[:64]}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        dest = sqlite3.connect(tmp, isolation_level=None)
        try:
            conn.backup(dest)
            dest.execute("PRAGMA journal_mode=DELETE")  # one file: no -wal beside the copy
        finally:
            dest.close()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, stat.S_IMODE(old.st_mode) if old is not None else 0o666 & ~umask)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        try:  # the rename itself is durable once the folder is synced
            dir_fd = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError:
            pass
    except (OSError, sqlite3.Error) as e:
        raise SessionError(f"{target}: cannot write the copy ({e})") from None
    finally:
        for leftover in (tmp, *(tmp.with_name(tmp.name + end) for end in ("-journal", "-wal", "-shm"))):
            try:
                leftover.unlink()
            except OSError:  # already renamed, never made, or not ours to remove
                pass
    return target
