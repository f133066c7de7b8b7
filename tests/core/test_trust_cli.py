"""The command line refuses what would mislead and never crashes on hostile
input: every numeric option of every subcommand is checked at parse time;
pairs files are read by one reader that names the line and the field; every
output path refuses what is not a regular file, keeps permission bits, and
turns a failed write into one line with the old file intact."""

import argparse
import codecs
import errno
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import core.files.atomic
from core.cli import build_parser, main
from core.dataset_audit import read_dataset
from core.errors import ImageLoadError, InputFileError, OutputError, ReadoutError
from core.files.atomic import check_output_file, check_output_folder, write_text_atomic
from core.files.pairs import load_pair_image, read_pairs
from core.methods.tuned_lens import read_pairs as read_lens_pairs
from core.models.loading import resources_dir
from core.shell.arguments import Number

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = resources_dir() / "samples"


def _permission_bits_deny() -> bool:
    """False for root (CAP_DAC_OVERRIDE writes through the bits): then the
    read-only cases are simulated by failing system calls instead."""
    folder = tempfile.mkdtemp()
    os.chmod(folder, 0o555)
    try:
        return not os.access(folder, os.W_OK)
    finally:
        os.chmod(folder, 0o700)
        os.rmdir(folder)


BITS_DENY = _permission_bits_deny()


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def _refused(capsys, argv: list[str], *needles: str) -> str:
    """``main(argv)`` exits non-zero with exactly one ``error:`` line holding every needle."""
    assert main(argv) != 0
    line = _one_error_line(capsys.readouterr().err)
    for needle in needles:
        assert needle in line, line
    return line


# ---------------------------------------------------------------- numeric options, found by introspection


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _numeric_options() -> list[tuple[str, str, object]]:
    """``(command, option, type)`` for every option of every subcommand that takes a value with a ``type=``."""
    out = []
    for name, sp in _subcommands().items():
        for action in sp._actions:
            if action.option_strings and action.type is not None:
                out.append((name, action.option_strings[-1], action))
    return out


NUMERIC = _numeric_options()


def _bad_values(kind: Number) -> list[str]:
    """Values just outside the domain, and values that are not numbers at all."""
    bad = ["abc", "", "nan", "inf", "-inf", "1e999"]
    if kind.kind is int:
        bad += ["1.5", "2e3"]
    if kind.lo is not None:
        bad.append(str(kind.lo) if kind.lo_open else str(kind.lo - 1))
        if kind.kind is float and not kind.lo_open:
            bad.append(str(kind.lo - 1e-9))
    if kind.hi is not None:
        bad.append(str(kind.hi) if kind.hi_open else str(kind.hi + 1))
    return bad


def test_every_subcommand_has_numeric_options_and_none_is_a_bare_int_or_float():
    commands = {c for c, _, _ in NUMERIC}
    assert {"answer", "evaluate-zoo", "audit", "counterfactual", "train-lens", "eval-lens"} <= commands
    bare = [(c, o) for c, o, a in NUMERIC if a.type in (int, float)]
    assert not bare, f"numeric options without a range check: {bare}"


@pytest.mark.parametrize(("command", "option", "action"), NUMERIC, ids=[f"{c} {o}" for c, o, _ in NUMERIC])
def test_numeric_option_refuses_out_of_range_at_parse_time(capsys, command, option, action):
    kind = action.type
    if not isinstance(kind, Number):  # a typed option of its own (--color R,G,B): its own bad values
        bad = ["1,2", "256,0,0", "a,b,c", "-1,0,0"]
    else:
        bad = _bad_values(kind)
        if action.default is not None:
            assert kind.contains(action.default), f"{command} {option}: default {action.default} out of range"
        edge = kind.lo if kind.lo is not None and not kind.lo_open else kind.hi if kind.hi is not None else None
        if edge is not None and not (kind.hi_open and edge == kind.hi):
            assert kind(str(edge)) == edge  # the closed end itself is accepted
    parser = build_parser()
    for value in bad:
        with pytest.raises(SystemExit) as e:
            parser.parse_args([command, f"{option}={value}"])
        assert e.value.code == 2
        line = _one_error_line(capsys.readouterr().err)
        assert line.startswith(f"error: argument {option}"), line


def test_issue_examples_are_one_line_through_main(capsys):
    assert _refused(capsys, ["answer", "--batch-size", "0"]) == (
        "error: argument --batch-size: must be a positive integer (got 0)"
    )
    _refused(capsys, ["answer", "--top-k", "0"], "--top-k", "positive integer")
    _refused(capsys, ["answer", "--top-k", "-3"], "--top-k", "(got -3)")
    _refused(capsys, ["answer", "--batch-size", "-1"], "--batch-size")  # was: exit 0, nothing written
    _refused(capsys, ["answer", "--top-k", "99999999999"], "at most")
    _refused(capsys, ["no-such-command"], "invalid choice")
    _refused(capsys, ["answer", "--no-such-option"], "unrecognized arguments")
    _refused(capsys, ["counterfactual", "--image", "x"], "required")
    assert main(["export", "--help"]) == 0 and "--format" in capsys.readouterr().out


def test_refused_option_in_a_fresh_process_is_one_line_and_imports_no_model_code(tmp_path):
    """A bad option is refused by a fresh ``python -m core.cli`` in one line, and
    building and using the parser imports no torch (run with the ``core``
    package stubbed, so what is measured is the CLI's own imports, not
    ``core/__init__``'s)."""
    r = subprocess.run(
        [sys.executable, "-m", "core.cli", "answer", "--top-k", "0"], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 2 and r.stdout == ""
    assert _one_error_line(r.stderr) == "error: argument --top-k: must be a positive integer (got 0)"
    probe = textwrap.dedent(
        f"""
        import sys, types
        stub = types.ModuleType("core"); stub.__path__ = [{str(ROOT / "core")!r}]; sys.modules["core"] = stub
        import core.cli
        parser = core.cli.build_parser()
        parser.parse_args(["export", "--session", "s", "--format", "csv", "--out", "o"])
        parser.parse_args(["answer", "--top-k", "3", "--batch-size", "2"])
        for name in ("export", "answer", "analyze", "audit"):
            parser._subparsers._group_actions[0].choices[name].format_help()
        print(" ".join(m for m in ("torch", "transformers", "open_clip", "PIL") if m in sys.modules))
        """
    )
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"parsing imported {r.stdout.strip()}"


# ---------------------------------------------------------------- pairs files


def _pairs(tmp_path: Path, data: bytes, name: str = "pairs.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


GOOD = b'{"image": "sample_00.png", "question": "what shape is the blue object?"}\n'
BAD_PAIRS = {
    "image is an int": (GOOD + b'{"image": 3, "question": "q?"}\n', ':2: "image" must be a string, got a number'),
    "image is null": (b'{"image": null, "question": "q?"}\n', ':1: "image" must be a non-empty string, got null'),
    "image is a list": (GOOD + b'\n{"image": ["a.png"], "question": "q?"}\n', ':3: "image" must be a string, got an'),
    "image is a dict": (b'{"image": {"path": "a"}, "question": "q?"}\n', ':1: "image" must be a string, got an object'),
    "image is empty": (b'{"image": "", "question": "q?"}\n', ':1: "image" is empty'),
    "image has a NUL": (b'{"image": "a\\u0000.png", "question": "q?"}\n', ":1: \"image\" contains a NUL"),
    "no image": (b'{"question": "q?"}\n', ':1: no "image" field'),
    "question is an int": (b'{"image": "a.png", "question": 7}\n', ':1: "question" must be a string, got a number'),
    "question is null": (b'{"image": "a.png", "question": null}\n', ':1: "question" must be a non-empty string'),
    "question is blank": (b'{"image": "a.png", "question": "   "}\n', ':1: "question" is empty'),
    "question has a lone surrogate": (b'{"image": "a.png", "question": "\\ud800?"}\n', ":1: \"question\" contains an"),
    "answer is a number": (b'{"image": "a.png", "question": "q?", "answer": 3}\n', ':1: "answer" must be a string'),
    "line is an array": (GOOD + b"[1, 2]\n", ":2: expected a JSON object {...}, got an array"),
    "line is a string": (b'"image"\n', ":1: expected a JSON object {...}, got a string"),
    "line is not JSON": (GOOD + GOOD + b"{image: 1}\n", ":3: not JSON"),
    "deeply nested": (b"[" * 100_000 + b"]" * 100_000 + b"\n", ":1: JSON nested too deeply"),
    "Latin-1": ('{"image": "a.png", "question": "q"}\n{"image": "café.png", "question": "q?"}\n'.encode("latin-1"),
                ": not UTF-8 (line 2)"),
    "UTF-16 with BOM": (GOOD.decode().encode("utf-16"), ": not UTF-8 (line 1); it looks like UTF-16"),
    "UTF-16 without BOM": (GOOD.decode().encode("utf-16-le"), ": not UTF-8 (line 1); it looks like UTF-16"),
    "no pairs": (b"\n   \n\n", ": no pairs"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_PAIRS))
def test_bad_pairs_file_is_one_line_naming_the_line_and_field(tmp_path, capsys, case):
    data, needle = BAD_PAIRS[case]
    path = _pairs(tmp_path, data)
    _refused(capsys, ["answer", "--pairs", str(path)], f"{path}{needle}")
    # the same reader serves the audit dataset and the tuned lens's corpus
    with pytest.raises(InputFileError, match=re.escape(needle)):
        read_dataset(path) if case != "no pairs" else read_lens_pairs(path)


def test_unreadable_pairs_files_are_one_line(tmp_path, capsys):
    _refused(capsys, ["answer", "--pairs", str(tmp_path / "none.jsonl")], "no such pairs file")
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    _refused(capsys, ["answer", "--pairs", str(folder)], "is a folder, not a pairs file")
    _refused(capsys, ["answer", "--pairs", os.devnull], "is a device or socket")
    if BITS_DENY:
        locked = _pairs(tmp_path, GOOD, "locked.jsonl")
        locked.chmod(0)
        try:
            _refused(capsys, ["answer", "--pairs", str(locked)], "cannot read the pairs file (Permission denied)")
        finally:
            locked.chmod(0o644)


def test_bom_and_line_separators_inside_strings_are_read(tmp_path):
    question = "what shape\u2028is the blue object?"  # U+2028 splits str.splitlines(), not a JSONL line
    row = json.dumps({"image": "sample_00.png", "question": question, "answer": "square"}, ensure_ascii=False)
    path = _pairs(tmp_path, codecs.BOM_UTF8 + row.encode() + b"\r\n\r\n" + GOOD)
    pairs = read_pairs(path)
    assert [p.question for p in pairs] == [question, "what shape is the blue object?"]
    assert pairs[0].answer == "square" and pairs[1].answer is None
    assert pairs[0].image_path == tmp_path / "sample_00.png" and pairs[1].where == f"{path}:3"


def test_missing_image_names_the_pairs_line(tmp_path, capsys):
    shutil.copy(SAMPLES / "sample_00.png", tmp_path / "sample_00.png")
    path = _pairs(tmp_path, GOOD + b'{"image": "gone.png", "question": "q?"}\n')
    _refused(capsys, ["answer", "--pairs", str(path)], f"{path}:2:", "gone.png")
    with pytest.raises(ImageLoadError, match=":2:"):
        [load_pair_image(p) for p in read_pairs(path)]


# ---------------------------------------------------------------- outputs


@pytest.fixture
def old(tmp_path) -> Path:
    path = tmp_path / "out.jsonl"
    path.write_text("old contents\n")
    path.chmod(0o640)
    return path


def _only(folder: Path, *names: str) -> None:
    """Nothing but ``names`` in ``folder``: no temporary file was left behind."""
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)


def test_write_keeps_permission_bits_and_gives_new_files_the_umask(old, tmp_path):
    write_text_atomic(old, "new\n")
    assert old.read_text() == "new\n" and stat.S_IMODE(old.stat().st_mode) == 0o640
    old.chmod(0o4755)  # a set-uid bit is not carried over (never widened)
    write_text_atomic(old, "newer\n")
    assert stat.S_IMODE(old.stat().st_mode) == 0o755
    if os.geteuid() == 0 and not BITS_DENY:  # root replacing another user's file gives the new one back to that user
        os.chown(old, 65534, 65534)
        write_text_atomic(old, "newest\n")
        assert (old.stat().st_uid, old.stat().st_gid) == (65534, 65534)
    mask = os.umask(0o027)
    try:
        write_text_atomic(tmp_path / "fresh.txt", "x")
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "fresh.txt").stat().st_mode) == 0o640
    long_name = tmp_path / ("n" * 250)  # the temporary name must not outgrow NAME_MAX
    write_text_atomic(long_name, "x")
    _only(tmp_path, "out.jsonl", "fresh.txt", "n" * 250)


def test_targets_that_are_not_regular_files_are_refused_untouched(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    target = tmp_path / "target.txt"
    target.write_text("keep\n")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    dangling = tmp_path / "dangling.txt"
    dangling.symlink_to(tmp_path / "nowhere")
    folder = tmp_path / "folder"
    folder.mkdir()
    cases = {fifo: "a FIFO", link: "a symbolic link", dangling: "a symbolic link", folder: "is a folder"}
    for path, needle in cases.items():
        for fn in (lambda p: write_text_atomic(p, "x"), check_output_file):
            with pytest.raises(OutputError, match=needle) as e:
                fn(path)
            assert "\n" not in str(e.value) and str(path) in str(e.value)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.readlink(link) == str(target)
    assert target.read_text() == "keep\n" and not (tmp_path / "nowhere").exists()
    _only(tmp_path, "fifo", "target.txt", "link.txt", "dangling.txt", "folder")


def test_parent_that_is_a_file_and_names_too_long_are_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for fn in (lambda p: write_text_atomic(p, "x"), check_output_file):
        with pytest.raises(OutputError, match=f"{afile} is a file, not a folder"):
            fn(afile / "sub" / "out.json")
    with pytest.raises(OutputError, match="it is a file, not a folder"):
        check_output_folder(afile)
    with pytest.raises(OutputError, match="is a file, not a folder"):
        core.files.atomic.make_folder(afile / "sub")
    with pytest.raises(OutputError, match="File name too long"):
        write_text_atomic(tmp_path / ("n" * 300), "x")
    _only(tmp_path, "afile")


@pytest.mark.parametrize(
    ("where", "code"),
    [("fsync", errno.ENOSPC), ("fsync", errno.EIO), ("mkstemp", errno.EROFS), ("mkstemp", errno.EACCES)],
)
def test_failed_write_is_one_line_and_leaves_the_old_file_and_no_temp(old, tmp_path, monkeypatch, where, code):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    target = core.files.atomic.os if where == "fsync" else core.files.atomic.tempfile
    monkeypatch.setattr(target, where, fail)
    with pytest.raises(OutputError) as e:
        write_text_atomic(old, "new contents that do not fit\n")
    assert str(e.value) == f"cannot write {old}: {os.strerror(code)}; the existing file is unchanged"
    assert old.read_text() == "old contents\n" and stat.S_IMODE(old.stat().st_mode) == 0o640
    _only(tmp_path, "out.jsonl")


@pytest.mark.skipif(not BITS_DENY, reason="permission bits do not deny this user (root)")
def test_read_only_folder_and_file_are_refused(old, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        for fn in (lambda p: write_text_atomic(p, "x"), check_output_file):
            with pytest.raises(OutputError, match="Permission denied|not writable"):
                fn(locked / "out.json")
        with pytest.raises(OutputError, match="not writable"):
            check_output_folder(locked / "new")
    finally:
        locked.chmod(0o755)
    old.chmod(0o444)
    with pytest.raises(OutputError, match="read-only"):
        write_text_atomic(old, "x")
    assert old.read_text() == "old contents\n"


def test_cli_outputs_are_checked_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import core.cli

    def no_model(args):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(core.cli, "_load", no_model)
    shutil.copy(SAMPLES / "sample_00.png", tmp_path / "sample_00.png")
    pairs = _pairs(tmp_path, GOOD)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    afile = tmp_path / "afile"
    afile.write_text("x")
    image = str(SAMPLES / "sample_00.png")
    q = "what shape is the blue object?"
    _refused(capsys, ["answer", "--pairs", str(pairs), "--out", str(fifo)], "a FIFO")
    _refused(capsys, ["answer", "--pairs", str(pairs), "--out", str(tmp_path)], "is a folder")
    _refused(capsys, ["answer", "--image", image, "--question", q, "--out", "x"], "--out goes with --pairs")
    _refused(capsys, ["analyze", "--image", image, "--question", q, "--json", str(afile / "a.json")], "is a file")
    cf = ["counterfactual", "--image", image, "--question", q, "--sweep", "2", "--json", str(fifo)]
    _refused(capsys, cf, "a FIFO")
    _refused(capsys, ["audit", "--dataset", str(pairs), "--out", str(afile)], "is a file, not a folder")
    _refused(capsys, ["evaluate-zoo", "--split", "nosuch"], "unknown split")
    _refused(capsys, ["evaluate-zoo", "--json", str(fifo)], "a FIFO")
    _refused(capsys, ["train-lens", "--out", str(afile), "--pairs", str(pairs)], "is a file, not a folder")
    _refused(capsys, ["train-lens", "--out", str(tmp_path / "lens"), "--split", "nosuch"], "unknown split")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and afile.read_text() == "x"


def test_dataset_generator_refuses_bad_options_and_outputs(tmp_path, capsys):
    from core.zoo.dataset import main as dataset_main

    assert dataset_main(["--n", "0", "--out", str(tmp_path)]) == 2
    assert _one_error_line(capsys.readouterr().err) == "error: argument --n: must be a positive integer (got 0)"
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert dataset_main(["--n", "1", "--out", str(afile / "ds"), "--quiet"]) == 2
    assert "is a file, not a folder" in _one_error_line(capsys.readouterr().err)


def test_stdout_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch):
    """``vlm-readout ... > FILE`` on a full disk: one line, not a traceback at exit."""
    from core.session import Session

    session = tmp_path / "s.vlmr"
    Session.create(session).close()

    class FullStdout:
        def write(self, *text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        flush = write

        def fileno(self):
            raise ValueError("no file descriptor")

    monkeypatch.setattr(sys, "stdout", FullStdout())
    argv = ["export", "--session", str(session), "--format", "csv", "--out", str(tmp_path / "o.csv")]
    assert main(argv) == 2
    assert (
        _one_error_line(capsys.readouterr().err) == "error: cannot write to standard output (No space left on device)"
    )


def test_every_expected_failure_is_a_readout_error():
    assert issubclass(OutputError, ReadoutError) and issubclass(InputFileError, ReadoutError)
