"""The session file on disk: checkpointing the WAL into the main file after
each run (so the ``.vlmr`` alone is the complete session at every moment),
writing a self-contained copy of a session (:meth:`Session.save_as`) with
SQLite's online backup (see :mod:`core.session`, "Durability"), the checks
on the file and the files SQLite keeps beside it before SQLite opens them
(:func:`read_header`, :func:`check_beside`), and reading a session whose
``-wal`` SQLite could only use by writing beside it (:func:`replayed_copy`).
"""

from __future__ import annotations

import os
import sqlite3
import stat
import struct
import tempfile
import time
from pathlib import Path

from core.files.input_files import open_regular_file
from core.session.records import SessionError
from core.session.schema import APPLICATION_ID, BUSY_TIMEOUT_S, SQLITE_MAGIC

# The files SQLite keeps beside a database (WAL, its shared-memory index, a rollback journal).
BESIDE = ("-wal", "-shm", "-journal")
# replayed_copy holds the whole session in memory: a larger one is refused with the reason it was needed.
MAX_REPLAY_BYTES = 1 << 30
_WAL_MAGIC = (0x377F0682, 0x377F0683)  # little- / big-endian checksums
_WAL_HEADER, _FRAME_HEADER = 32, 24

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
        from core.files.atomic import no_space_reason

        full = no_space_reason(tmp)
        raise SessionError(f"{target}: cannot write the copy ({full + '; ' if full else ''}{e})") from None
    finally:
        for leftover in (tmp, *(tmp.with_name(tmp.name + end) for end in ("-journal", "-wal", "-shm"))):
            try:
                leftover.unlink()
            except OSError:  # already renamed, never made, or not ours to remove
                pass
    return target


# ---------------------------------------------------------------- before SQLite opens a file


def read_header(p: Path, size: int = 100) -> bytes:
    """The first ``size`` bytes of the session file ``p`` (fewer if it is shorter),
    read only if it is a regular file (:func:`core.files.input_files.open_regular_file`:
    a FIFO or device is refused, never waited on).

    Raises:
        SessionError: not a regular file, or it cannot be read.
    """
    with open_regular_file(p, SessionError, max_bytes=None, what="session file") as f:
        try:
            return f.read(size)
        except OSError as e:
            raise SessionError(f"{p}: cannot read ({e.strerror or e})") from None


def beside(p: Path, suffix: str) -> Path:
    """The file SQLite keeps beside ``p`` (``suffix``: one of :data:`BESIDE`)."""
    return p.with_name(p.name + suffix)


def check_beside(p: Path) -> dict[str, bool]:
    """Which of SQLite's files beside ``p`` exist (``{"-wal": True, ...}``).

    Raises:
        SessionError: one of them is not a regular file (a folder, FIFO,
            device or link): SQLite would open it as part of the session
            (a FIFO would hang the read), so the session is refused as it is.
    """
    found = {}
    for suffix in BESIDE:
        try:
            mode = os.lstat(beside(p, suffix)).st_mode
        except FileNotFoundError:
            found[suffix] = False
            continue
        except OSError as e:
            raise SessionError(f"{beside(p, suffix)}: cannot look at it ({e.strerror or e})") from None
        if not stat.S_ISREG(mode):
            raise SessionError(
                f"{beside(p, suffix)}: not a regular file (a folder, link, FIFO or device) where SQLite keeps the "
                f"session's {suffix[1:]} file; refusing to open {p.name}"
            )
        found[suffix] = True
    return found


# ---------------------------------------------------------------- reading a WAL without SQLite's -shm


def _wal_checksum(data: bytes, s0: int, s1: int, big_endian: bool) -> tuple[int, int]:
    """SQLite's WAL checksum (docs: fileformat2, "Checksum Algorithm"), continued from ``(s0, s1)``."""
    words = struct.unpack(f"{'>' if big_endian else '<'}{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def committed_pages(wal: bytes) -> tuple[int, dict[int, bytes]]:
    """``(database size in pages, {page number: page})`` of the transactions a
    WAL file holds committed, as SQLite would read them: frames are taken in
    order while their salts match the header and their checksums chain, up to
    the last commit frame. ``(0, {})`` for an empty, foreign or torn WAL (SQLite
    then reads the main file alone)."""
    if len(wal) < _WAL_HEADER:
        return 0, {}
    magic, version, page_size, _, salt1, salt2, c0, c1 = struct.unpack(">8I", wal[:_WAL_HEADER])
    big_endian = magic == _WAL_MAGIC[1]
    if magic not in _WAL_MAGIC or version != 3007000 or page_size < 512 or page_size > 65536:
        return 0, {}
    if page_size & (page_size - 1) or _wal_checksum(wal[:24], 0, 0, big_endian) != (c0, c1):
        return 0, {}
    s0, s1 = c0, c1
    size, pages, pending = 0, {}, {}
    offset = _WAL_HEADER
    while offset + _FRAME_HEADER + page_size <= len(wal):
        head = wal[offset : offset + _FRAME_HEADER]
        page_no, commit_size, f_salt1, f_salt2, f0, f1 = struct.unpack(">6I", head)
        page = wal[offset + _FRAME_HEADER : offset + _FRAME_HEADER + page_size]
        if (f_salt1, f_salt2) != (salt1, salt2) or page_no == 0:
            break
        s0, s1 = _wal_checksum(head[:8], s0, s1, big_endian)
        s0, s1 = _wal_checksum(page, s0, s1, big_endian)
        if (s0, s1) != (f0, f1):
            break
        pending[page_no] = page
        if commit_size:  # a transaction's last frame: its pages are committed
            pages.update(pending)
            pending.clear()
            size = commit_size
        offset += _FRAME_HEADER + page_size
    return size, pages


def replayed_copy(p: Path, reason: str) -> sqlite3.Connection:
    """A session read into memory with the transactions of its ``-wal`` applied,
    without SQLite opening the file: what a read-only open does when SQLite could
    only read the ``-wal`` by creating or growing its ``-shm`` beside it (a full
    disk, a read-only folder). Nothing is written anywhere.

    Raises:
        SessionError: the session and its WAL are over :data:`MAX_REPLAY_BYTES`
            (the message gives ``reason``), or cannot be read.
    """
    parts = []
    for path in (p, beside(p, "-wal")):
        try:
            with open(path, "rb") as fh:
                if os.fstat(fh.fileno()).st_size + sum(map(len, parts)) > MAX_REPLAY_BYTES:
                    raise SessionError(
                        f"{p}: cannot be read here: {reason}, and the session with its -wal is over "
                        f"{MAX_REPLAY_BYTES >> 20:,} MB, too large to read in memory instead"
                    )
                parts.append(fh.read(MAX_REPLAY_BYTES + 1))
        except FileNotFoundError:  # the -wal went away (its writer closed): the main file is complete
            parts.append(b"")
        except OSError as e:
            raise SessionError(f"{path}: cannot read ({e.strerror or e})") from None
    main, wal = parts
    n_pages, pages = committed_pages(wal)
    data = bytearray(main)
    if n_pages:
        page_size = struct.unpack(">I", wal[8:12])[0]
        data = data[: n_pages * page_size].ljust(n_pages * page_size, b"\0")
        for page_no, page in pages.items():
            if page_no <= n_pages:
                data[(page_no - 1) * page_size : page_no * page_size] = page
    if len(data) > 19 and data[18] == 2:  # WAL mode in the header; an in-memory database is not WAL
        data[18] = data[19] = 1
    conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    try:
        conn.deserialize(bytes(data))
    except sqlite3.Error as e:
        conn.close()
        raise SessionError(f"{p}: not a session file (not an SQLite database: {e})") from None
    return conn
