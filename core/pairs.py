"""Pairs files: JSONL of ``{"image", "question"[, "answer"]}`` lines.

Reading one (:func:`read_jsonl`, :func:`text_field`, :func:`read_pairs`) and
loading the image of one pair (:func:`load_pair_image`). Below the command
line and the methods, both of which read pairs files; :mod:`core.cli`
re-exports these names.
"""

from __future__ import annotations

import codecs
import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from core.errors import InputFileError


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def read_jsonl(path: str | Path, what: str = "pairs file") -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line of a JSONL file.

    The file must be UTF-8 (a leading byte-order mark is accepted) and each
    non-blank line one JSON object. Lines end at ``\\n`` only (a JSON string
    may hold U+2028 and the like). Every problem is one
    :class:`InputFileError` naming the file and the line, ``what`` the file's role.
    """
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise InputFileError(f"{path}: is a folder, not a {what}")
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):  # a pipe, as <(...) gives, reads like a file
            raise InputFileError(f"{path}: is a device or socket, not a {what}")
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputFileError(f"{path}: no such {what}") from None
    except OSError as e:
        raise InputFileError(f"{path}: cannot read the {what} ({os.strerror(e.errno) if e.errno else e})") from None
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    utf16 = data[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
    try:
        text = data.decode("utf-8")
        bad = text.find("\x00")  # UTF-16 without a byte-order mark decodes, with a NUL in every other byte
    except UnicodeDecodeError as e:
        text, bad = "", -1
        line = data.count(b"\n", 0, e.start) + 1
    else:
        line = text.count("\n", 0, bad) + 1 if bad >= 0 else 0
        utf16 = utf16 or bad >= 0
    if line:
        hint = "; it looks like UTF-16" if utf16 else ""
        raise InputFileError(f"{path}: not UTF-8 (line {line}){hint}; save the {what} as UTF-8")
    for n, raw in enumerate(text.split("\n"), 1):
        line_text = raw.rstrip("\r")
        if not line_text.strip():
            continue
        try:
            item = json.loads(line_text)
        except json.JSONDecodeError as e:
            raise InputFileError(f"{path}:{n}: not JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise InputFileError(f"{path}:{n}: JSON nested too deeply") from None
        if not isinstance(item, dict):
            raise InputFileError(f"{path}:{n}: expected a JSON object {{...}}, got {_json_type(item)}")
        yield n, item


def text_field(row: dict, key: str, where: str, *, required: bool = True) -> str | None:
    """``row[key]`` as a string; ``where`` is ``file:line`` for the message.

    A required field must be a non-blank string; an optional one is absent,
    null, or a non-empty string. NUL characters and unpaired surrogates (which
    no file or model can take) are refused.
    """
    value = row.get(key)
    if value is None:
        if not required:
            return None
        if key not in row:
            raise InputFileError(f'{where}: no "{key}" field')
        raise InputFileError(f'{where}: "{key}" must be a non-empty string, got null')
    if not isinstance(value, str):
        shown = json.dumps(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise InputFileError(f'{where}: "{key}" must be a string, got {_json_type(value)} ({shown})')
    if not (value.strip() if required else value):
        raise InputFileError(f'{where}: "{key}" is empty')
    if "\x00" in value:
        raise InputFileError(f'{where}: "{key}" contains a NUL character')
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InputFileError(f'{where}: "{key}" contains an unpaired surrogate (\\ud800-\\udfff)') from None
    return value


def resolve_beside(path: Path, name: str) -> Path:
    """A path from a JSONL line: ``~`` expanded; relative paths are relative to the JSONL file's folder."""
    p = Path(name).expanduser()
    return p if p.is_absolute() else path.parent / p


def read_pairs(path: Path) -> list[dict]:
    """JSONL of {"image": path, "question": text[, "answer": token]}; image
    paths are relative to the file. Each pair: ``image`` (as written),
    ``image_path`` (resolved), ``question``, ``answer`` (or None), ``where``
    (``file:line``, for messages)."""
    path = Path(path)
    pairs = []
    for n, row in read_jsonl(path, "pairs file"):
        where = f"{path}:{n}"
        image = text_field(row, "image", where)
        question = text_field(row, "question", where)
        answer = text_field(row, "answer", where, required=False)
        pairs.append(
            {
                "image": image,
                "image_path": resolve_beside(path, image),
                "question": question,
                "answer": answer,
                "where": where,
            }
        )
    if not pairs:
        raise InputFileError(f"{path}: no pairs (the file has no non-blank line)")
    return pairs


@contextmanager
def _naming_the_line(pair: dict):
    """An ImageLoadError inside names the pairs file's line
    (``pairs.jsonl:3: images/a.png: no such file``)."""
    from core.errors import ImageLoadError

    try:
        yield
    except ImageLoadError as e:
        if pair.get("where") is None:
            raise
        raise ImageLoadError(f"{pair['where']}: {e}") from None


def load_pair_image(pair: dict):
    """The image of one pair of :func:`read_pairs`, decoded; a failure names the line."""
    from core.images import load_image

    with _naming_the_line(pair):
        return load_image(pair["image_path"])


def check_pair_image(pair: dict) -> Path:
    """The image path of one pair after its header's checks
    (:func:`core.images.check_image_file`, no decoding); a failure names the line."""
    from core.images import check_image_file

    with _naming_the_line(pair):
        check_image_file(pair["image_path"])
    return pair["image_path"]
