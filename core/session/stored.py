"""Reading a session's stored values back, checked.

SQLite is dynamically typed: any column of a file from elsewhere may hold
text, a number, a blob or null whatever its declared type, and a JSON column
may hold text that is not JSON, JSON of another shape, or JSON nested deep
enough to exhaust Python's parser. Every value :class:`core.session.Session`
reads out of a row goes through one of these readers; a value that is not
what the session writes raises :class:`StoredValueError` with the column and
what was expected, which the caller turns into one line naming the run (a
:class:`core.session.records.DamagedRunError`) or the file.
"""

from __future__ import annotations

from core.files.input_files import MAX_JSON_BYTES, MAX_JSON_DEPTH, parse_json

# A stored JSON document larger than this is refused before it is read (an analyze result is a few MB).
MAX_STORED_JSON_BYTES = MAX_JSON_BYTES


class StoredValueError(ValueError):
    """One stored value is not what the session writes; the message says
    which column and what was expected (no file or run: the caller adds it)."""


def kind_of(value) -> str:
    """What an SQLite value is, in words (for messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):  # never from SQLite; listed so it is not called a whole number
        return "a boolean"
    return {str: "text", bytes: "a blob", int: "a whole number", float: "a real number"}.get(
        type(value), type(value).__name__
    )


def _wrong(column: str, value, expected: str) -> StoredValueError:
    return StoredValueError(f"{column} holds {kind_of(value)}, expected {expected}")


def text(value, column: str, *, null: bool = False) -> str | None:
    """``value`` if it is text (or None when ``null`` allows it)."""
    if isinstance(value, str) or (value is None and null):
        return value
    raise _wrong(column, value, "text" + (" or null" if null else ""))


def whole(value, column: str, *, null: bool = False) -> int | None:
    """``value`` if it is a whole number (or None when ``null`` allows it)."""
    if (isinstance(value, int) and not isinstance(value, bool)) or (value is None and null):
        return value
    raise _wrong(column, value, "a whole number" + (" or null" if null else ""))


def blob(value, column: str, *, null: bool = False) -> bytes | None:
    """``value`` if it is a blob (or None when ``null`` allows it)."""
    if isinstance(value, bytes) or (value is None and null):
        return value
    raise _wrong(column, value, "a blob" + (" or null" if null else ""))


class _Refused(Exception):
    """parse_json's error class here: its message becomes a StoredValueError."""


_EXPECT = {dict: "a JSON object", list: "a JSON array"}


def json_value(value, column: str, *, expect: type | None = None, empty=None):
    """The JSON document stored as text in ``value``, parsed with its size and
    nesting bounded (:data:`MAX_STORED_JSON_BYTES`, :data:`core.files.input_files.MAX_JSON_DEPTH`).

    Args:
        expect: ``dict`` or ``list``: the document must be one (None: any JSON value).
        empty: what null or ``""`` stands for (the session stores an empty list or
            dict of an audit row that way); None: null and ``""`` are refused.
    """
    if empty is not None and value in (None, ""):
        return type(empty)(empty)
    if not isinstance(value, str):
        raise _wrong(column, value, "JSON text")
    if len(value) > MAX_STORED_JSON_BYTES:
        raise StoredValueError(f"{column} is {len(value):,} characters, over the {MAX_STORED_JSON_BYTES:,} limit")
    try:
        doc = parse_json(value, column, _Refused, MAX_JSON_DEPTH)
    except _Refused as e:  # "<column>: not valid JSON (...)", "<column>: JSON nested deeper than 64 levels"
        raise StoredValueError(f"{column}: stored JSON unreadable: {str(e).removeprefix(column + ': ')}") from None
    if expect is not None and not isinstance(doc, expect):
        raise StoredValueError(f"{column} holds {_json_kind(doc)}, expected {_EXPECT[expect]}")
    return doc


def _json_kind(doc) -> str:
    if doc is None:
        return "JSON null"
    if isinstance(doc, bool):
        return "a JSON boolean"
    if isinstance(doc, str):
        return "a JSON string"
    if isinstance(doc, (int, float)):
        return "a JSON number"
    return _EXPECT[type(doc)]
