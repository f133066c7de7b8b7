"""Checking the fields of a JSON document the tool reads back (a generate
JSON, a tuned lens's ``lens.json``): each helper returns the value when it is
what was expected and raises ``ValueError('"<field>" must be ..., got ...')``
otherwise, so the reader prefixes the file's name and raises its own
:class:`core.errors.ReadoutError` subclass in one line. Import-light (no torch).
"""

from __future__ import annotations

INT32_MAX = 2**31 - 1  # ids and counts: what the command line accepts (core.shell.arguments.INT_MAX)


def json_kind(value) -> str:
    """What a JSON value is, for a message: ``null``, ``a boolean``, ``a number``, ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def shown(text, most: int = 80) -> str:
    """``text`` quoted for a message, cut to ``most`` characters."""
    if not isinstance(text, str):
        return repr(text)[:most]
    return repr(text[:most]) + ("..." if len(text) > most else "")


def required(doc: dict, key: str, prefix: str = ""):
    """``doc[key]``; ``no "<prefix><key>" field`` when it is absent."""
    if key not in doc:
        raise ValueError(f'no "{prefix}{key}" field')
    return doc[key]


def integer(value, label: str, low: int, high: int) -> int:
    """An integer (not a boolean, not a float) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f'"{label}" must be an integer, got {json_kind(value)}')
    if not low <= value <= high:
        seen = f"{value:,}" if value.bit_length() <= 64 else f"a {value.bit_length()}-bit number"
        raise ValueError(f'"{label}" must be in {low:,}..{high:,}, got {seen}')
    return value


def boolean(value, label: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f'"{label}" must be true or false, got {json_kind(value)}')
    return value


def text(value, label: str, *, non_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ValueError(f'"{label}" must be a string, got {json_kind(value)}')
    if non_empty and not value.strip():
        raise ValueError(f'"{label}" is empty')
    return value


def array(value, label: str, *, most: int, length: int | None = None) -> list:
    """A list of at most ``most`` entries (exactly ``length`` where given)."""
    if not isinstance(value, list):
        raise ValueError(f'"{label}" must be an array, got {json_kind(value)}')
    if length is not None and len(value) != length:
        raise ValueError(f'"{label}" has {len(value):,} entries, expected {length:,}')
    if len(value) > most:
        raise ValueError(f'"{label}" has {len(value):,} entries, over the {most:,} it may have')
    return value


def obj(value, label: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f'"{label}" must be an object, got {json_kind(value)}')
    return value


def one_of(value, label: str, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        seen = shown(value, 40) if isinstance(value, str) else json_kind(value)
        raise ValueError(f'"{label}" must be one of {", ".join(choices)}, got {seen}')
    return value
