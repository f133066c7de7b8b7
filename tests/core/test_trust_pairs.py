"""Pairs files and their masks (``answer --pairs``, ``audit --dataset``, the
tuned lens's corpus) are refused in one line naming the file, the line and
the field: a ``~user`` that names no user, a FIFO (never waited on), a file
over the size or pair bounds, NaN / Infinity or deep nesting in a line. A
large file is read at tens of thousands of lines a second with progress, and
its last bad line is named. An audit in which no sample succeeded (a mask
bomb, a wrong-size mask) exits non-zero and writes nothing; otherwise its last
line says how many failed."""

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

import core.files.pairs
from core.cli import main
from core.dataset_audit import read_dataset
from core.errors import ImageLoadError, InputFileError
from core.files.pairs import check_pair_images, load_pair_mask, read_pairs
from core.methods.tuned_lens import read_pairs as read_lens_pairs
from core.models.loading import resources_dir
from tests.fuzz.hostile_images import png_bytes, tiff_bytes

SAMPLES = resources_dir() / "samples"
QUESTION = "what shape is the blue object?"
NO_USER = "~no-such-user-of-vlm-readout"


def _pairs(tmp_path: Path, rows, name: str = "pairs.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _row(image: str = "sample_00.png", **more) -> dict:
    return {"image": image, "question": QUESTION, **more}


def _one_line(capsys, argv: list[str], code: int = 2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err.removeprefix("error: ")


def _refused(call, needle: str) -> str:
    with pytest.raises(InputFileError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message and needle in message, message
    return message


# ---- ~user


@pytest.mark.parametrize("key", ["image", "target_mask"])
def test_a_home_folder_that_cannot_be_found_names_the_line_and_field(tmp_path, capsys, key):
    row = _row(**{key: f"{NO_USER}/x.png"})
    path = _pairs(tmp_path, [_row(), row])
    needle = f'{path}:2: "{key}": cannot expand {NO_USER!r}'
    assert _refused(lambda: read_pairs(path), needle).startswith(f"{path}:2: ")
    _refused(lambda: read_dataset(path), needle)
    _refused(lambda: read_lens_pairs(path), needle)
    assert _one_line(capsys, ["answer", "--pairs", str(path)]).startswith(needle)
    out = tmp_path / "out"
    assert _one_line(capsys, ["audit", "--dataset", str(path), "--out", str(out), "--quiet"]).startswith(needle)
    assert not out.exists()


def test_a_home_that_exists_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (pair,) = read_pairs(_pairs(tmp_path, [_row("~/a.png")]))
    assert pair.image_path == tmp_path / "a.png" and pair.image == "~/a.png"


# ---- the file itself


def test_a_fifo_is_refused_without_waiting(tmp_path, capsys):
    fifo = tmp_path / "pairs.jsonl"
    os.mkfifo(fifo)
    result = {}
    reader = threading.Thread(target=lambda: result.update(err=_one_line(capsys, ["answer", "--pairs", str(fifo)])))
    reader.daemon = True
    reader.start()
    reader.join(10)
    if reader.is_alive():
        with open(fifo, "wb"):
            pass
        pytest.fail("answer --pairs blocked on a FIFO")
    assert result["err"] == f"{fifo}: is a FIFO (a pipe), not a pairs file; save it to a file first"


def test_size_and_pair_bounds(tmp_path, monkeypatch):
    path = _pairs(tmp_path, [_row()] * 4)
    monkeypatch.setattr(core.files.pairs, "MAX_PAIRS", 3)
    _refused(lambda: read_pairs(path), f"{path}:4: over 3 pairs, the most one file may hold; split the pairs file")
    assert len(read_pairs(path, limit=3)) == 3  # a limit reads no further
    monkeypatch.setattr(core.files.pairs, "MAX_PAIRS_BYTES", 100)
    _refused(lambda: read_pairs(path), f"{path}: {path.stat().st_size:,} bytes, over the 100-byte limit")


def test_a_lens_corpus_folder_is_bounded_in_all(tmp_path, monkeypatch):
    import core.methods.tuned_lens.data as lens_data
    from core.methods.tuned_lens import LensError

    for name in ("a.jsonl", "b.jsonl"):
        _pairs(tmp_path, [_row(), _row()], name)
    assert len(read_lens_pairs(tmp_path)) == 4
    monkeypatch.setattr(lens_data, "MAX_PAIRS", 3)
    with pytest.raises(LensError, match=rf"^{tmp_path}: over 3 pairs in its \*.jsonl files"):
        read_lens_pairs(tmp_path)


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"image": "a.png", "question": "q?", "x": NaN}', ":1: not JSON (NaN is not JSON)"),
        ('{"image": "a.png", "question": "q?", "x": -Infinity}', ":1: not JSON (-Infinity is not JSON)"),
        ('{"image": "a.png", "question": "q?", "x": ' + "[" * 100 + "]" * 100 + "}", ":1: JSON nested too deeply"),
        ('{"image": "a.png", "question": "q?", "x": "' + "[" * 100 + '"}', None),  # brackets in a string: fine
        ('{"image": "a.png", "question": "q?", "x": ' + "9" * 5000 + "}", ":1: not JSON"),  # over int's digit limit
    ],
)
def test_line_level_json_classes(tmp_path, line, needle):
    path = _pairs(tmp_path, [line])
    if needle is None:
        assert read_pairs(path)[0].row["x"] == "[" * 100
    else:
        assert _refused(lambda: read_pairs(path), f"{path}{needle}").startswith(f"{path}:1: ")


# ---- large files


def test_a_large_file_is_read_fast_with_progress_and_names_its_last_bad_line(tmp_path, capsys):
    shutil.copy(SAMPLES / "sample_00.png", tmp_path / "sample_00.png")
    n = 100_000
    path = tmp_path / "big.jsonl"
    line = json.dumps(_row(answer="square", foil="circle")) + "\n"
    path.write_text(line * n + json.dumps(_row("gone.png")) + "\n")
    calls = []
    start = time.perf_counter()
    pairs = read_pairs(path, progress=lambda done, total, message="": calls.append((done, total, message)))
    seconds = time.perf_counter() - start
    assert len(pairs) == n + 1 and seconds < 10, f"{n:,} lines in {seconds:.1f} s"  # ~100k lines/s unloaded
    assert calls[-1][:2] == (n + 2, n + 2) and len(calls) >= n // core.files.pairs.PROGRESS_EVERY
    assert [c[0] for c in calls] == sorted(c[0] for c in calls) and "reading big.jsonl: line" in calls[0][2]
    with pytest.raises(ImageLoadError, match=rf"^{path}:{n + 1}: .*gone.png: no such file$"):
        check_pair_images(pairs)
    assert _one_line(capsys, ["answer", "--pairs", str(path)]).startswith(f"{path}:{n + 1}: ")


def test_each_distinct_image_is_checked_once(tmp_path, monkeypatch):
    path = _pairs(tmp_path, [_row(), _row("sample_01.png"), _row(), _row()])
    checked = []
    monkeypatch.setattr(core.files.pairs, "check_pair_image", lambda pair: checked.append(pair.line))
    assert (
        check_pair_images(read_pairs(path))
        == [tmp_path / n for n in ("sample_00.png", "sample_01.png")] + [tmp_path / "sample_00.png"] * 2
    )
    assert checked == [1, 2]


# ---- masks and the audit


def _dataset(tmp_path: Path, masks: dict[str, bytes]) -> Path:
    """A dataset of one line per mask (sample_00's image, that mask as its target)."""
    shutil.copy(SAMPLES / "sample_00.png", tmp_path / "sample_00.png")
    for name, data in masks.items():
        (tmp_path / name).write_bytes(data)
    return _pairs(tmp_path, [_row(target_mask=name) for name in masks], "dataset.jsonl")


def test_a_mask_bomb_and_a_wrong_size_mask_are_per_sample_errors(tmp_path):
    path = _dataset(tmp_path, {"bomb.tif": tiff_bytes(8000, 8000), "small.png": png_bytes(3, 2)})
    bomb, small = read_pairs(path)
    with pytest.raises(ImageLoadError, match=rf"^{path}:1: .*bomb.tif: 8000x8000 is 64,000,000 pixels"):
        load_pair_mask(bomb, (64, 64))
    with pytest.raises(ImageLoadError, match=rf"^{path}:2: .*small.png: mask is 3x2, the image is 64x64"):
        load_pair_mask(small, (64, 64))


def test_an_audit_in_which_no_sample_succeeded_fails_and_writes_nothing(tmp_path, capsys):
    path = _dataset(tmp_path, {"bomb.tif": tiff_bytes(8000, 8000), "small.png": png_bytes(3, 2)})
    out = tmp_path / "out"
    out.mkdir()
    (out / "samples.jsonl").write_text("an earlier run's\n")
    argv = ["audit", "--dataset", str(tmp_path), "--out", str(out), "--methods", "answer", "--quiet"]
    err = _one_line(capsys, argv)
    assert err.startswith(f"{path}: no sample succeeded (2 of 2 failed; nothing written to {out}); the first, line 1: ")
    assert "bomb.tif: 8000x8000" in err and f"{path}:1: {path}:1:" not in err
    assert sorted(p.name for p in out.iterdir()) == ["samples.jsonl"]
    assert (out / "samples.jsonl").read_text() == "an earlier run's\n"


def test_an_audit_with_some_failures_says_how_many_in_its_last_line(tmp_path, capsys):
    path = _dataset(tmp_path, {"small.png": png_bytes(3, 2)})
    path.write_text(path.read_text() + json.dumps(_row()) + "\n")
    out = tmp_path / "out"
    argv = ["audit", "--dataset", str(path), "--out", str(out), "--methods", "answer", "--quiet"]
    assert main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"2 samples: 1 ok, 1 failed (their errors: {out / 'summary.json'}); accuracy")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_errors"] == 1 and "mask is 3x2" in summary["errors"][0]["error"]
