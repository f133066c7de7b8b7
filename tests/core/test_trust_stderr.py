"""stderr holds only ``error:`` and ``warning:`` lines (issue 27, part 6), and
a stdout that cannot be written is one line and a non-zero exit (part 5).

Through fresh processes (``python -m core.cli``, ``python -m app``), as a
user runs them: the libraries' own lines (transformers' "Token indices
sequence length...", Pillow's "Corrupt EXIF data", libtiff's C-level
"ZIPDecode: Not enough data" and "More samples per pixel than can be
decoded", a progress bar drawn before a refusal) become one ``warning:`` line,
join the ``error:`` line they explain, or are not printed."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import pytest

from core.errors import ImageLoadError, QuestionError
from core.files.images import ImageWarning, check_image_file, load_image
from core.models.loading import resources_dir
from core.shell.terminal import progress_bar
from tests.fuzz.hostile_images import jpeg_bytes, tiff_bytes

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = resources_dir() / "samples" / "sample_00.png"
QUESTION = "what color is the circle?"
LONG_QUESTION = " ".join(["red"] * 300)  # 300 tokens: over shapes-llava's 256


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "core.cli", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def _only_error_and_warning_lines(err: str) -> list[str]:
    lines = err.splitlines()
    assert lines and all(line.startswith(("error: ", "warning: ")) for line in lines), err
    assert "Traceback" not in err
    return lines


def _one_error_line(err: str) -> str:
    lines = _only_error_and_warning_lines(err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ---------------------------------------------------------------- hostile images, built here


def corrupt_exif_jpeg() -> bytes:
    """A JPEG whose EXIF block declares 50 entries and holds none: Pillow warns
    "Corrupt EXIF data" and still decodes it."""
    exif = b"Exif\0\0II*\0" + struct.pack("<IH", 8, 50)
    data = jpeg_bytes(16, 16)
    return data[:2] + b"\xff\xe1" + struct.pack(">H", len(exif) + 2) + exif + data[2:]


def short_deflate_tiff() -> bytes:
    """A deflated TIFF strip 758 bytes short: libtiff prints "ZIPDecode: Not
    enough data at scanline 0" on fd 2 and Pillow reports "decoder error -2"."""
    return tiff_bytes(16, 16, data=zlib.compress(b"\0" * 10))


def seven_samples_tiff() -> bytes:
    """Seven samples per pixel: Pillow logs "More samples per pixel than can be
    decoded: 7" before it refuses the header."""
    return tiff_bytes(16, 16, samples=7)


# ---------------------------------------------------------------- question length


@pytest.mark.parametrize(
    "argv",
    [
        ["answer", "--image", str(SAMPLE), "--question", LONG_QUESTION, "--quiet"],
        # without --quiet: its progress bar used to print "nonunique: 0it" before the refusal
        ["nonunique", "--image", str(SAMPLE), "--question", LONG_QUESTION, "--head", "L0.H0", "--json", "NU"],
    ],
    ids=["answer --quiet", "nonunique"],
)
def test_question_too_long_is_the_one_error_line(tmp_path, argv):
    argv = [str(tmp_path / "nu.json") if a == "NU" else a for a in argv]
    done = _cli(*argv)
    assert done.returncode == 2 and done.stdout == ""
    line = _one_error_line(done.stderr)  # the refusal alone: no tokenizer line, no "nonunique: 0it"
    assert line.startswith("error: the question is too long: ") and "256" in line, line
    assert not (tmp_path / "nu.json").exists()


def test_question_longer_than_the_tokenizer_says_is_one_warning_line(tmp_path):
    """The model takes it (256 positions) but its tokenizer declares 8: the
    answer comes with transformers' "Token indices sequence length..." as one
    line naming both numbers."""
    model = tmp_path / "llava"
    shutil.copytree(
        resources_dir() / "models" / "shapes-llava", model, ignore=shutil.ignore_patterns("MANIFEST.sha256")
    )
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["model_max_length"] = 8
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    done = _cli("answer", "--model", str(model), "--image", str(SAMPLE), "--question", QUESTION, "--quiet")
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 1, done.stderr
    assert _only_error_and_warning_lines(done.stderr) == [
        "warning: the question's prompt is 11 tokens, longer than the 8 the tokenizer declares as its maximum "
        "(model_max_length): the model may not have been trained on prompts this long"
    ]


# ---------------------------------------------------------------- images


def test_corrupt_exif_answers_with_one_warning_line(tmp_path):
    image = tmp_path / "corrupt-exif.jpg"
    image.write_bytes(corrupt_exif_jpeg())
    done = _cli("answer", "--image", str(image), "--question", QUESTION, "--quiet")
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 1, done.stderr
    assert _only_error_and_warning_lines(done.stderr) == [
        f"warning: {image}: the decoder said: Corrupt EXIF data. Expecting to read 12 bytes but only got 0."
    ]


@pytest.mark.parametrize(
    ("build", "said"),
    [
        (
            short_deflate_tiff,
            "corrupt or truncated image (decoder error -2); the decoder said: ZIPDecode: Not enough data",
        ),
        (seven_samples_tiff, "the decoder said: More samples per pixel than can be decoded: 7"),
    ],
    ids=["libtiff ZIPDecode", "more samples per pixel"],
)
def test_decoder_output_joins_the_error_line(tmp_path, build, said):
    image = tmp_path / "bad.tif"
    image.write_bytes(build())
    done = _cli("answer", "--image", str(image), "--question", QUESTION, "--quiet")
    assert done.returncode == 2 and done.stdout == ""
    line = _one_error_line(done.stderr)
    assert line.startswith(f"error: {image}: ") and said in line, line


def test_decoders_print_nothing_themselves(tmp_path, capfd):
    """In the engine: what a decoder says is an ImageWarning (a file it still
    read) or the ImageLoadError's detail, never its own output on fd 2; every
    reader of images (load_image, check_image_file, bytes, PIL images) does so."""
    exif = tmp_path / "exif.jpg"
    exif.write_bytes(corrupt_exif_jpeg())
    capfd.readouterr()
    with pytest.warns(ImageWarning, match=r"exif.jpg: the decoder said: Corrupt EXIF data") as caught:
        assert load_image(exif).size == (16, 16)
    assert len(caught) == 1
    with pytest.warns(ImageWarning, match=r"^image bytes: the decoder said: Corrupt EXIF"):
        load_image(corrupt_exif_jpeg())
    for build, name in [(short_deflate_tiff, "short.tif"), (seven_samples_tiff, "seven.tif")]:
        path = tmp_path / name
        path.write_bytes(build())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing else is said
            with pytest.raises(ImageLoadError, match="the decoder said: ") as e:
                load_image(path)
        assert "\n" not in str(e.value) and str(e.value).startswith(f"{path}: ")
    seven = tmp_path / "seven.tif"
    with pytest.raises(ImageLoadError, match="More samples per pixel"):
        check_image_file(seven)
    assert capfd.readouterr().err == ""


def test_a_clean_image_says_nothing(capfd):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_image(SAMPLE)
    assert capfd.readouterr().err == ""


# ---------------------------------------------------------------- the progress bar


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _screen(text: str) -> list[str]:
    """What a terminal shows of ``text``: each line as its last carriage return left it."""
    return [line.split("\r")[-1] for line in text.split("\n") if line.split("\r")[-1].strip()]


def test_bar_is_not_drawn_before_the_work_starts(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    with pytest.raises(QuestionError):
        with progress_bar("nonunique", quiet=False, messages=True):
            raise QuestionError("the question is too long")
    assert sys.stderr.getvalue() == ""


def test_bar_is_wiped_when_the_work_fails(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    with pytest.raises(QuestionError):
        with progress_bar("answering", quiet=False, total=4) as progress:
            progress(1)
            progress(2, 4, "halfway")
            raise QuestionError("refused")
    drawn = sys.stderr.getvalue()
    assert "answering" in drawn and _screen(drawn) == []


def test_bar_stays_after_work_that_finished(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    with progress_bar("answering", quiet=False, total=2) as progress:
        progress(1)
        progress(2)
    (shown,) = _screen(sys.stderr.getvalue())
    assert shown.startswith("answering: 100%")


@pytest.mark.parametrize("stream", ["pipe", "quiet"])
def test_bar_is_not_drawn_into_a_pipe_or_with_quiet(monkeypatch, stream):
    monkeypatch.setattr(sys, "stderr", io.StringIO() if stream == "pipe" else _Terminal())
    with progress_bar("answering", quiet=stream == "quiet", total=2) as progress:
        progress(1)
        progress(2)
    assert sys.stderr.getvalue() == ""


# ---------------------------------------------------------------- stdout that cannot be written


def _shell(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _reader_gone(argv: list[str]) -> subprocess.CompletedProcess:
    """Run ``argv`` with stdout a pipe whose reader has exited (``| head -0``)."""
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    err = process.stderr.read()
    process.stderr.close()
    return subprocess.CompletedProcess(argv, process.wait(timeout=300), "", err)


STDOUT_FAILURES = {
    "full disk": ("> /dev/full", "No space left on device"),
    "closed": (">&-", "Bad file descriptor"),
}


@pytest.fixture
def export_argv(tmp_path):
    from core.session import Session

    session = tmp_path / "s.vlmr"
    Session.create(session).close()
    return ["export", "--session", str(session), "--format", "csv", "--out", str(tmp_path / "o.csv")]


@pytest.mark.parametrize("failure", STDOUT_FAILURES)
@pytest.mark.parametrize("entry", ["core.cli --help", "core.cli answer --help", "app --help", "core.cli export"])
def test_stdout_failure_is_one_line_for_help_and_quick_commands(failure, entry, export_argv):
    redirect, reason = STDOUT_FAILURES[failure]
    argv = entry.split() + (export_argv[1:] if entry.endswith("export") else [])
    done = _shell(" ".join([f"'{sys.executable}'", "-m", *[f"'{a}'" for a in argv], redirect]))
    assert done.returncode == 2
    assert done.stderr == f"error: cannot write to standard output ({reason})\n"


@pytest.mark.parametrize("entry", ["core.cli --help", "app --help", "core.cli export"])
def test_stdout_reader_gone_is_one_line(entry, export_argv):
    argv = entry.split() + (export_argv[1:] if entry.endswith("export") else [])
    done = _reader_gone([sys.executable, "-m", *argv])
    assert done.returncode == 2
    assert done.stderr == "error: cannot write to standard output (Broken pipe)\n"


@pytest.mark.parametrize(
    ("command", "failure"),
    [("answer", "full disk"), ("generate", "closed")],
)
def test_stdout_failure_after_a_model_ran_is_one_line(command, failure):
    redirect, reason = STDOUT_FAILURES[failure]
    args = f"'{command}' --image '{SAMPLE}' --question '{QUESTION}' --quiet"
    done = _shell(f"'{sys.executable}' -m core.cli {args} {redirect}")
    assert done.returncode == 2
    assert done.stderr == f"error: cannot write to standard output ({reason})\n"


def test_stdout_reader_gone_after_a_model_ran_is_one_line():
    done = _reader_gone(
        [sys.executable, "-m", "core.cli", "answer", "--image", str(SAMPLE), "--question", QUESTION, "--quiet"]
    )
    assert done.returncode == 2
    assert done.stderr == "error: cannot write to standard output (Broken pipe)\n"


def test_help_on_a_working_stdout_is_still_exit_0(capsys):
    from core.cli import main

    assert main(["--help"]) == 0 and "usage: vlm-readout" in capsys.readouterr().out
    assert os.environ["HF_HUB_OFFLINE"] == "1"


@pytest.mark.parametrize("redirect", ["2>&-", "2>/dev/full", "<&-"])
def test_closed_or_full_stderr_and_closed_stdin_still_exit_2(redirect):
    """A refusal with nowhere to say it is still exit 2 (no crash on the
    error line itself); a closed descriptor is reserved, not handed to a file."""
    done = _shell(f"'{sys.executable}' -m core.cli answer --top-k 0 {redirect}")
    assert done.returncode == 2 and done.stdout == ""
    if redirect == "<&-":
        assert _one_error_line(done.stderr).startswith("error: argument --top-k: must be")
