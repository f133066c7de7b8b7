"""The command line's layout holds: one module per command under core/cli/,
a parser that imports nothing heavy, the zoo's scripts below the command line,
and one pairs reader (core.files.pairs.read_pairs) with one mask convention."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from core.cli import COMMANDS, build_parser, main
from core.errors import ImageLoadError, InputFileError
from core.files.pairs import Pair, load_pair_image, load_pair_mask, pairs_file, read_pairs

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "numpy", "open_clip", "PIL")
COMMAND_NAMES = [
    "answer",
    "generate",
    "analyze",
    "evaluate-zoo",
    "audit",
    "counterfactual",
    "ablate",
    "patch",
    "patch-grid",
    "attribution-patching",
    "knockout",
    "export",
    "train-lens",
    "eval-lens",
    "nonunique",
    "qk-ov",
    "validate",
]


def _fresh(probe: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(probe)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r


@pytest.mark.parametrize("command", ["export", "analyze", "answer", "evaluate-zoo", "ablate", "patch"])
def test_help_imports_no_torch_transformers_or_numpy(command):
    """``vlm-readout COMMAND --help`` in a fresh process (the real ``core``
    package, as the console script runs it) imports none of the heavy libraries."""
    r = _fresh(
        f"""
        import contextlib, io, sys
        from core.cli import main
        with contextlib.redirect_stdout(io.StringIO()) as out:
            code = main([{command!r}, "--help"])
        assert code == 0 and "usage:" in out.getvalue(), (code, out.getvalue())
        print(" ".join(m for m in {HEAVY!r} if m in sys.modules))
        """
    )
    assert r.stdout.strip() == "", f"{command} --help imported {r.stdout.strip()}"


def test_building_the_parser_imports_no_command_code():
    """Building the whole parser (every command's options) imports none of the
    heavy libraries, nor the modules the commands run (analyze, dataset_audit, export, session, the methods)."""
    r = _fresh(
        f"""
        import sys
        from core.cli import build_parser
        build_parser().parse_args(["audit", "--dataset", "d", "--out", "o", "--limit", "3"])
        loaded = [m for m in {HEAVY!r} if m in sys.modules]
        ran = ("core.analyze", "core.dataset_audit", "core.export", "core.session", "core.methods", "core.models")
        loaded += [m for m in sys.modules if m.startswith(ran)]
        print(" ".join(loaded))
        """
    )
    assert r.stdout.strip() == "", f"building the parser imported {r.stdout.strip()}"


def test_the_help_lists_every_command_in_order(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = out.split("{", 1)[1].split("}", 1)[0].split(",")
    assert listed == COMMAND_NAMES
    sub = build_parser()._subparsers._group_actions[0]
    assert list(sub.choices) == COMMAND_NAMES


def test_every_model_command_takes_dtype_and_device():
    """Every command that loads a model offers ``--dtype`` (auto, float32, bfloat16,
    float16; default auto) and ``--device``, from the one place (core.cli.args)."""
    from core.shell.precision import DTYPE_CHOICES

    sub = build_parser()._subparsers._group_actions[0]
    model_commands = [name for name in COMMAND_NAMES if name != "export"]
    assert len(model_commands) == 16
    for name in model_commands:
        options = sub.choices[name]._option_string_actions
        assert "--device" in options, name
        dtype = options.get("--dtype")
        assert dtype is not None, name
        assert tuple(dtype.choices) == DTYPE_CHOICES and dtype.default == "auto", name
        assert "float32 on the CPU" in dtype.help, name
    assert "--dtype" not in sub.choices["export"]._option_string_actions


def test_a_dtype_not_offered_is_refused_in_one_line(capsys):
    assert main(["analyze", "--image", "x.png", "--question", "q", "--dtype", "fp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--dtype" in err and "bfloat16" in err, err


def test_every_command_module_has_add_command_and_run():
    for module in COMMANDS:
        assert module.__name__.startswith("core.cli."), module
        assert callable(module.add_command), module
        assert callable(getattr(module, "run", None) or getattr(module, "run_train", None)), module


def test_the_zoo_scripts_do_not_import_the_command_line():
    """core.zoo sits below core.cli (core.cli's lens and evaluate-zoo commands
    use the zoo): the zoo's scripts take their argument helpers from core.shell.arguments."""
    r = _fresh(
        """
        import sys
        import core.zoo.dataset, core.zoo.evaluate, core.zoo.build, core.zoo.samples
        print(" ".join(m for m in sys.modules if m == "core.cli" or m.startswith("core.cli.")))
        """
    )
    assert r.stdout.strip() == "", f"the zoo imported {r.stdout.strip()}"


def test_python_m_core_cli_runs_the_command_line():
    r = subprocess.run([sys.executable, "-m", "core.cli", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "train-lens" in r.stdout, r.stderr


# ---------------------------------------------------------------- one pairs reader


def _image(path: Path, size=(32, 24)) -> Path:
    Image.new("RGB", size, (200, 10, 10)).save(path)
    return path


def _mask(path: Path, size=(32, 24)) -> Path:
    m = np.zeros((size[1], size[0]), np.uint8)
    m[4:10, 2:12] = 255
    Image.fromarray(m).save(path)
    return path


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_read_pairs_reads_every_field_into_a_pair(tmp_path):
    _image(tmp_path / "a.png")
    _mask(tmp_path / "a_mask.png")
    row = {
        "id": 7,
        "image": "a.png",
        "question": "what color is the square?",
        "answer": "red",
        "foil": "blue",
        "target_mask": "a_mask.png",
        "kind": "attribute",
        "template": "color_of_shape",
        "objects": [{"color": "red"}],  # other keys are ignored
    }
    path = _write(tmp_path / "pairs.jsonl", [row, "", {"image": "a.png", "question": "is there a circle?"}])
    first, second = read_pairs(path)
    assert isinstance(first, Pair) and first.index == 0 and second.index == 1
    assert (first.line, first.where) == (1, f"{path}:1") and second.where == f"{path}:3"
    assert first.image == "a.png" and first.image_path == tmp_path / "a.png"
    assert (first.answer, first.foil, first.id, first.kind, first.template) == (
        "red",
        "blue",
        "7",
        "attribute",
        "color_of_shape",
    )
    assert first.target_mask == tmp_path / "a_mask.png" and second.target_mask is None
    assert second.answer is None and second.foil is None and second.id is None
    # attributes are the interface: no dict view to fall back on
    with pytest.raises(TypeError):
        first["question"]
    assert first.to_dict()["image_path"] == tmp_path / "a.png"
    assert read_pairs(path, limit=1) == [first]


def test_read_pairs_limit_leaves_later_lines_unchecked(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"image": "a.png", "question": "q?"}, '{"image": 3}'])
    assert len(read_pairs(path, limit=1)) == 1
    with pytest.raises(InputFileError, match=r"p\.jsonl:2: \"image\" must be a string"):
        read_pairs(path)


def test_a_folder_holds_dataset_jsonl_or_exactly_one_jsonl(tmp_path):
    row = {"image": "a.png", "question": "q?"}
    one = tmp_path / "one"
    one.mkdir()
    _write(one / "mine.jsonl", [row])
    assert pairs_file(one) == one / "mine.jsonl" and read_pairs(one)[0].where == f"{one / 'mine.jsonl'}:1"
    _write(one / "other.jsonl", [row])
    with pytest.raises(InputFileError, match="is a folder, not a pairs file; expected dataset.jsonl or exactly one"):
        read_pairs(one)
    _write(one / "dataset.jsonl", [row, row])
    assert pairs_file(one) == one / "dataset.jsonl" and len(read_pairs(one)) == 2
    with pytest.raises(InputFileError, match="no such dataset file"):
        read_pairs(tmp_path / "none", what="dataset file")


def test_pair_files_load_and_name_the_line(tmp_path):
    _image(tmp_path / "a.png")
    _mask(tmp_path / "ok.png")
    _mask(tmp_path / "small.png", size=(16, 12))
    path = _write(
        tmp_path / "p.jsonl",
        [
            {"image": "a.png", "question": "q?", "target_mask": "ok.png"},
            {"image": "a.png", "question": "q?", "target_mask": "small.png"},
            {"image": "a.png", "question": "q?", "target_mask": "gone.png"},
            {"image": "a.png", "question": "q?"},
        ],
    )
    ok, small, gone, none = read_pairs(path)
    image = load_pair_image(ok)
    mask = load_pair_mask(ok, image.size)
    assert mask.shape == (24, 32) and mask.dtype == bool and mask.sum() == 6 * 10 and mask[4, 2] and not mask[0, 0]
    with pytest.raises(ImageLoadError, match=r"p\.jsonl:2: .*mask is 16x12, the image is 32x24"):
        load_pair_mask(small, image.size)
    with pytest.raises(ImageLoadError, match=r"p\.jsonl:3: "):
        load_pair_mask(gone, image.size)
    assert load_pair_mask(none, image.size) is None
