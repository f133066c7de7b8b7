"""core/files/input_files.py: the one validating first step of every file the tool reads."""

import os

import pytest

from core.errors import InputFileError, ModelLoadError
from core.files.input_files import json_depth_exceeds, parse_json, read_json_file, read_regular_bytes


def test_a_json_object_is_read(tmp_path):
    f = tmp_path / "a.json"
    f.write_text('{"a": [1, 2, {"b": "[[[["}]}', encoding="utf-8")
    assert read_json_file(f) == {"a": [1, 2, {"b": "[[[["}]}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"[" * 5000 + b"]" * 5000, "JSON nested deeper than 64 levels"),
        (b'{"a": ' * 100 + b"1" + b"}" * 100, "JSON nested deeper than 64 levels"),
        (b'{"a": NaN}', "not valid JSON (ValueError: NaN is not JSON)"),
        (b'{"a": Infinity}', "not valid JSON (ValueError: Infinity is not JSON)"),
        (b'{"a": 1', "not valid JSON (Expecting ',' delimiter at line 1 column 8)"),
        (b"\xff\xfe{}", "not UTF-8 text (byte 0)"),
        (b"[1, 2]", "expected a JSON object, got an array"),
        (b"null", "expected a JSON object, got null"),
    ],
)
def test_bad_json_is_one_line_naming_the_file(tmp_path, content, message):
    f = tmp_path / "bad.json"
    f.write_bytes(content)
    with pytest.raises(InputFileError) as e:
        read_json_file(f)
    assert str(e.value) == f"{f}: {message}"


def test_strings_may_hold_brackets_and_escaped_quotes():
    assert not json_depth_exceeds('["' + "[" * 1000 + '\\"' + "{" * 1000 + '"]', 2)
    assert json_depth_exceeds("[[[", 2)


def test_non_regular_files_are_refused_without_waiting(tmp_path):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    with pytest.raises(InputFileError, match=r"pipe.json: not a regular file \(a FIFO, socket or device\)$"):
        read_json_file(fifo)  # no writer: a blocking open would hang here
    with pytest.raises(InputFileError, match="is a folder"):
        read_json_file(tmp_path)
    with pytest.raises(InputFileError, match="no such file"):
        read_json_file(tmp_path / "missing.json")
    with pytest.raises(InputFileError, match="cannot open"):
        read_json_file(tmp_path / ("x" * 300))  # over NAME_MAX


def test_size_bound_and_the_callers_error_class(tmp_path):
    f = tmp_path / "big.json"
    f.write_bytes(b" " * 2000)
    with pytest.raises(ModelLoadError, match=r"big.json: 2,000 bytes, over the 1,000-byte limit"):
        read_regular_bytes(f, ModelLoadError, max_bytes=1000)
    with pytest.raises(ModelLoadError, match="^cfg: JSON nested"):
        parse_json("[" * 100, "cfg", ModelLoadError)


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.isdir("/proc/self/fd"), reason="needs FIFOs and /proc")
def test_checked_path_names_the_checked_file_even_once_it_is_swapped(tmp_path):
    """safetensors opens by path: the path it is given is the checked file's
    descriptor, so a FIFO put in its place after the check is never opened."""
    from core.files.input_files import checked_path

    target = tmp_path / "lens.safetensors"
    target.write_bytes(b"the checked bytes")
    with checked_path(target) as held:
        target.unlink()
        os.mkfifo(target)  # would hang a reader that opened the name
        with open(held, "rb") as f:
            assert f.read() == b"the checked bytes"
    with pytest.raises(InputFileError, match="not a regular file"):
        with checked_path(target):
            pass
