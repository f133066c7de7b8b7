"""Reading a file the tool was given, as one validating step: a regular file
(a FIFO, socket or device is refused, never waited on), of a bounded size,
UTF-8 text, and JSON nested no deeper than a bound (Python's parser recurses:
thousands of brackets would be a RecursionError).

Every refusal is the caller's :class:`core.errors.ReadoutError` subclass with
one line that starts with the file's name. Readers of particular formats
(generate JSON, tuned-lens folders, sessions, pairs, model folders) validate
their fields on top of this.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from core.errors import InputFileError
from core.files.json_fields import json_kind

# Deeper nesting than any file the tool writes (its JSON documents nest under 10 levels).
MAX_JSON_DEPTH = 64
# A JSON input larger than this is refused before it is read (the largest the tool
# writes, an analyze JSON of a long prompt, is a few MB).
MAX_JSON_BYTES = 256 * 2**20


def open_regular_file(
    path: str | Path, error=InputFileError, *, max_bytes: int | None = MAX_JSON_BYTES, what: str = "file"
) -> BinaryIO:
    """``path`` opened for reading if it is a readable regular file of at most
    ``max_bytes`` (None: any size); else ``error("<path>: <why>")`` (``what``: the noun of "no
    such ..."). Opened non-blocking and checked with ``fstat`` on the open
    descriptor, so a FIFO, socket or device is refused, never waited on, and
    what is read is what was checked. The one such opening (images, sessions,
    JSON inputs)."""
    name = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except (FileNotFoundError, NotADirectoryError):
        raise error(f"{name}: no such {what}") from None
    except PermissionError:  # Windows: a folder is EACCES
        raise error(f"{name}: {'is a folder' if Path(path).is_dir() else 'permission denied'}") from None
    except (OSError, ValueError) as e:  # ENAMETOOLONG, ELOOP, a NUL byte in the name, ...
        raise error(f"{name}: cannot open ({getattr(e, 'strerror', None) or e})") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise error(f"{name}: is a folder, not a {what}")
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{name}: not a regular file (a FIFO, socket or device)")
        if max_bytes is not None and info.st_size > max_bytes:
            raise error(f"{name}: {info.st_size:,} bytes, over the {max_bytes:,}-byte limit for this {what}")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


@contextmanager
def checked_path(path: str | Path, error=InputFileError, *, max_bytes: int | None = None) -> Iterator[str]:
    """For a library that opens by path (safetensors' ``safe_open``): a path
    naming the very file :func:`open_regular_file` checked, ``/proc/self/fd/N``
    of its open descriptor where the system has one, so the file cannot be
    swapped for a FIFO between the check and the library's open."""
    with open_regular_file(path, error, max_bytes=max_bytes) as f:
        held = f"/proc/self/fd/{f.fileno()}"
        yield held if os.path.exists(held) else str(path)


def read_regular_bytes(path: str | Path, error=InputFileError, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of ``path`` (:func:`open_regular_file`'s checks)."""
    name = str(path)
    with open_regular_file(path, error, max_bytes=max_bytes) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise error(f"{name}: cannot read ({e.strerror or e})") from None
    if len(data) > max_bytes:  # it grew while being read
        raise error(f"{name}: over the {max_bytes:,}-byte limit for this file")
    return data


def json_depth_exceeds(text: str, max_depth: int) -> bool:
    """Whether ``text`` opens more than ``max_depth`` arrays / objects inside one
    another (brackets inside strings do not count). Linear, no recursion."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def parse_json(text: str, name: str, error=InputFileError, max_depth: int = MAX_JSON_DEPTH):
    """``json.loads(text)`` with the nesting bounded; NaN / Infinity literals are
    refused (the tool never writes them). ``error("<name>: <why>")`` on anything else."""
    if json_depth_exceeds(text, max_depth):
        raise error(f"{name}: JSON nested deeper than {max_depth} levels")

    def no_constant(token: str):
        raise ValueError(f"{token} is not JSON")

    try:
        return json.loads(text, parse_constant=no_constant)
    except json.JSONDecodeError as e:
        raise error(f"{name}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # a constant; a recursion json's own limit found first
        raise error(f"{name}: not valid JSON ({type(e).__name__}: {str(e)[:120]})") from None


def read_json_file(
    path: str | Path,
    error=InputFileError,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
    expect: type | None = dict,
):
    """The JSON document in ``path`` (a regular UTF-8 file; see the module
    docstring), an object unless ``expect`` says otherwise (None: any value)."""
    data = read_regular_bytes(path, error, max_bytes)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start})") from None
    doc = parse_json(text, str(path), error, max_depth)
    if expect is not None and not isinstance(doc, expect):
        want = {dict: "a JSON object", list: "a JSON array"}.get(expect, expect.__name__)
        raise error(f"{path}: expected {want}, got {json_kind(doc)}")
    return doc
