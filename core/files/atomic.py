"""Atomic writes: a sibling temporary file, flushed and fsynced, then
``os.replace`` so a reader never sees a half-written file.

Every output the command line writes goes through here, so every output path
gets the same rules:

* a target that exists must be a regular file: a folder, a FIFO, a device, a
  socket or a symbolic link is refused, never replaced and never followed
  (checked with ``os.lstat``);
* an existing file keeps its permission bits (never widened) and, where the
  process may, its owner; a read-only file is refused, as ``>`` would refuse it;
* any failure (read-only folder or file system, a parent that is a file, a
  full disk, a name too long) is one :class:`core.errors.OutputError` naming
  the path and the reason; the old file stays as it was and no temporary
  file is left behind.

:func:`check_output_file` / :func:`check_output_folder` run the same checks
up front, so a long run fails before it starts rather than when it writes;
they also refuse a name longer than the file system allows (``NAME_MAX``,
``PATH_MAX``) in one line.

:func:`staged_writes` puts several files (an export's pictures; a command's
JSON written only once its ``--session`` run is recorded) in place together:
each is written and fsynced beside its target first, and only when every
one of them and the caller's block succeeded are they renamed over their
targets; a failure anywhere leaves every target as it was.

:func:`no_space_reason` tells a write that failed for lack of room (a full
file system, the file-size limit) from other failures, for messages.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from core.errors import OutputError

_MAX_TEMP_STEM = 64  # the temporary name is ".<stem>.<random>.tmp": keep it under NAME_MAX when the target is long
# Under this much free space (for this user) a failed write is put down to a full disk: SQLite needs a
# few pages and its 32 KiB -shm, so an I/O error with less than this left is the disk being full.
DISK_FULL_BYTES = 1 << 20
_TOO_LONG = os.strerror(errno.ENAMETOOLONG)
_SHOWN_PATH = 160  # a path over this many characters is shortened in messages (it may be PATH_MAX long)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _reason(e: OSError) -> str:
    return os.strerror(e.errno) if e.errno else str(e)


def _kind(mode: int) -> str:
    """What a non-regular file is, for the message."""
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def shown_path(path: str | Path) -> str:
    """``path`` for a one-line message: a very long one keeps its start and end."""
    text = str(path)
    return text if len(text) <= _SHOWN_PATH else f"{text[:100]}...{text[-50:]}"


def no_space_reason(path: str | Path, siblings: Sequence[str | Path] = ()) -> str | None:
    """Why a write at ``path`` failed for lack of room, when that is what it
    was: ``"the disk is full (12 KB free on the file system of /data)"`` when
    the file system holding it has under :data:`DISK_FULL_BYTES` free for this
    user, ``"the file-size limit (ulimit -f) of N bytes is reached"`` when the
    process's ``RLIMIT_FSIZE`` is within reach of ``path`` or one of
    ``siblings`` (SQLite's ``-wal`` and ``-shm``); else None."""
    path = Path(path)
    folder = _first_existing(path.parent)
    try:
        info = os.statvfs(folder if folder is not None else ".")
    except (OSError, AttributeError):
        info = None
    if info is not None and info.f_blocks and info.f_bavail * info.f_frsize < DISK_FULL_BYTES:
        free = info.f_bavail * info.f_frsize
        return f"the disk is full ({free // 1024:,} KB free on the file system of {shown_path(folder)})"
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    except (ImportError, OSError, ValueError):  # no resource module (Windows)
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    sizes = []
    for p in (path, *siblings):
        try:
            sizes.append(os.lstat(p).st_size)
        except OSError:
            continue
    if soft < max(sizes, default=0) + DISK_FULL_BYTES:
        return f"the file-size limit (ulimit -f) of {soft:,} bytes is reached"
    return None


def _too_long(path: Path) -> str | None:
    """Why ``path`` cannot be a file name here, when a part of it is longer
    than its file system allows (``NAME_MAX``) or the whole is (``PATH_MAX``);
    else None. The limits are those of the nearest existing folder."""
    existing = _first_existing(path.parent) or Path(".")
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
        path_max = os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows) or an unknown limit
        name_max, path_max = 255, 4096
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > name_max:
            return f"the name {shown_path(part)} is {size} bytes, over this file system's limit of {name_max} ({_TOO_LONG})"
    size = len(os.fsencode(str(path.absolute())))
    if size >= path_max:
        return f"the path is {size:,} bytes, over this system's limit of {path_max - 1:,} ({_TOO_LONG})"
    return None


def _check_length(path: Path, what: str) -> None:
    why = _too_long(path)
    if why is not None:
        raise OutputError(f"cannot write {what}: {why}")


def _first_existing(path: Path) -> Path | None:
    """``path`` or its nearest ancestor that exists (by lstat)."""
    for p in (path, *path.parents):
        try:
            os.lstat(p)
            return p
        except OSError:
            continue
    return None


def _blocking_file(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` when it is not a folder (a
    file where a folder is needed), else None."""
    p = _first_existing(path)
    return p if p is not None and not p.is_dir() else None


def _existing_file(path: Path) -> os.stat_result | None:
    """``os.lstat`` of an output target: None when it does not exist; refused
    unless it is a regular file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise OutputError(f"cannot write {path}: {_blocking_file(path.parent)} is a file, not a folder") from None
    except OSError as e:
        raise OutputError(f"cannot write {path}: {_reason(e)}") from None
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"cannot write {path}: it is a folder; give a file name")
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"refusing to write {path}: it is {_kind(st.st_mode)}, not a regular file")
    if not os.access(path, os.W_OK):
        raise OutputError(f"refusing to replace {path}: the file is read-only")
    return st


def make_folder(folder: str | Path) -> Path:
    """Create ``folder`` (and its parents) if needed; an
    :class:`OutputError` names what is in the way."""
    folder = Path(folder)
    if folder.is_dir():
        return folder
    blocker = _blocking_file(folder)
    if blocker is not None:
        what = "it is" if blocker == folder else f"{blocker} is"
        raise OutputError(f"cannot create the folder {folder}: {what} a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create the folder {folder}: {_reason(e)}") from None
    return folder


def _writable_folder(folder: Path, what: str) -> None:
    """The folder ``folder`` exists (or can be created below a writable
    ancestor) and can be written; raises :class:`OutputError` naming ``what``."""
    existing = _first_existing(folder)
    if existing is None:
        raise OutputError(f"cannot write {what}: no part of {folder} exists")
    if not existing.is_dir():
        raise OutputError(f"cannot write {what}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only_fs(existing) else "permission denied"
        raise OutputError(f"cannot write {what}: the folder {existing} is not writable ({reason})")


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def check_output_file(path: str | Path) -> None:
    """Fail fast, before a long run: ``path`` can be written as a file (it is
    absent or a writable regular file, in a folder that exists or can be
    created and is writable). Creates nothing."""
    path = Path(path)
    _check_length(path, shown_path(path))
    _writable_folder(path.parent, str(path))
    _existing_file(path)


def check_output_folder(folder: str | Path) -> None:
    """Fail fast, before a long run: files can be written into ``folder``
    (an existing writable folder, or one that can be created). Creates nothing."""
    folder = Path(folder)
    _check_length(folder, f"into {shown_path(folder)}")
    existing = _first_existing(folder)
    if existing == folder and not folder.is_dir():
        raise OutputError(f"cannot write into {folder}: it is a file, not a folder")
    _writable_folder(folder, f"into {folder}")


class Staging:
    """Files staged by :func:`staged_writes`: each written beside its target,
    put in place only when the block ends without an error."""

    def __init__(self):
        self._staged: list[tuple[str, Path, os.stat_result | None]] = []

    def add(self, path: str | Path, data: bytes) -> Path:
        """Write ``data`` to a temporary file beside ``path`` (fsynced, with the
        permission bits ``path`` will have); it replaces ``path`` when the block ends.

        Raises:
            OutputError: ``path`` is not a regular file, or the write failed
                (nothing is replaced; no temporary file is left).
        """
        path = Path(path)
        _check_length(path, shown_path(path))
        make_folder(path.parent)
        old = _existing_file(path)
        tmp = None
        try:
            # mkstemp opens with O_CREAT | O_EXCL: a new name, never a link followed
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:_MAX_TEMP_STEM]}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            # mkstemp makes 0600: give a new file the usual permissions, an existing one its own
            os.chmod(tmp, stat.S_IMODE(old.st_mode) & 0o777 if old is not None else 0o666 & ~_umask())
            if old is not None and hasattr(os, "chown") and (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
                try:
                    os.chown(tmp, old.st_uid, old.st_gid)
                except OSError:  # only root (or the owner, for the group) may; the bits are kept regardless
                    pass
        except OSError as e:
            _remove(tmp)
            kept = "; the existing file is unchanged" if old is not None else ""
            raise OutputError(f"cannot write {path}: {_reason(e)}{kept}") from None
        self._staged.append((tmp, path, old))
        return path

    def _commit(self) -> None:
        while self._staged:
            tmp, path, old = self._staged[0]
            try:
                os.replace(tmp, path)  # renames over a link, never through it
            except OSError as e:
                kept = "; the existing file is unchanged" if old is not None else ""
                raise OutputError(f"cannot write {path}: {_reason(e)}{kept}") from None
            self._staged.pop(0)

    def _discard(self) -> None:
        for tmp, _, _ in self._staged:
            _remove(tmp)
        self._staged.clear()


def _remove(tmp: str | None) -> None:
    if tmp is not None:
        try:
            os.unlink(tmp)
        except OSError:
            pass


@contextmanager
def staged_writes() -> Iterator[Staging]:
    """Write several files so that they change together or not at all::

        with staged_writes() as out:
            out.add("result.json", data)        # written beside it, fsynced; nothing replaced yet
            record_into(session, result)        # may fail: then result.json is left as it was
        # here every added file is in place

    An error in the block (or in an :meth:`Staging.add`) removes every
    temporary file and leaves every target as it was.
    """
    staging = Staging()
    try:
        yield staging
        staging._commit()
    finally:
        staging._discard()


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Replace (or create) the regular file ``path`` with ``data`` atomically.

    Raises:
        OutputError: the target is not a regular file, or the write failed
            (the old file, if any, is unchanged; no temporary file is left).
    """
    with staged_writes() as out:
        out.add(path, data)


def write_text_atomic(path: str | Path, text: str) -> None:
    """:func:`write_bytes_atomic` of ``text`` encoded as UTF-8."""
    write_bytes_atomic(path, text.encode("utf-8"))
