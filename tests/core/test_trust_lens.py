"""A tuned-lens folder that is not what it says is refused in one line:
unreadable or non-object lens.json, fields of the wrong type, a tensors file
outside the folder, non-finite or integer tensors."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.methods.tuned_lens import LensError, load_lens

SHIPPED = Path(__file__).resolve().parents[2] / "resources" / "models" / "shapes-llava" / "tuned-lens"


@pytest.fixture
def lens_dir(tmp_path):
    d = tmp_path / "lens"
    shutil.copytree(SHIPPED, d)
    return d


def _edit_config(d: Path, edit) -> None:
    cfg = json.loads((d / "lens.json").read_text())
    edit(cfg)
    (d / "lens.json").write_text(json.dumps(cfg))


def test_the_copied_lens_loads(lens_dir):
    assert load_lens(lens_dir).n_blocks > 0


@pytest.mark.parametrize(
    "content, named",
    [
        (b"[1, 2]", "expected a JSON object"),
        (b"\xff\xfe{\x00}\x00", "not UTF-8"),
        (b"{", "not valid JSON"),
    ],
)
def test_lens_json_that_is_not_an_object(lens_dir, content, named):
    (lens_dir / "lens.json").write_bytes(content)
    with pytest.raises(LensError, match=named):
        load_lens(lens_dir)


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda c: c.update(translator=[1]), "'translator' must be an object"),
        (lambda c: c.update(model="x"), "'model' must be an object"),
        (lambda c: c.update(tensors="../lens.safetensors"), "inside the lens folder"),
        (lambda c: c.update(tensors=7), "inside the lens folder"),
    ],
)
def test_lens_fields_of_the_wrong_type(lens_dir, edit, named):
    _edit_config(lens_dir, edit)
    with pytest.raises(LensError, match=named):
        load_lens(lens_dir)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_lens_tensors_are_refused(lens_dir, bad):
    path = lens_dir / "lens.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = bad
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(LensError, match=f"not finite.*{name}"):
        load_lens(lens_dir)


def test_integer_lens_tensors_are_refused(lens_dir):
    path = lens_dir / "lens.safetensors"
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(path))
    with pytest.raises(LensError, match=name):
        load_lens(lens_dir)


def test_cli_names_the_bad_lens_in_one_line(lens_dir, tmp_path, capsys):
    from core.cli import main

    (lens_dir / "lens.json").write_text("[1]")
    sample = Path(__file__).resolve().parents[2] / "resources" / "samples" / "sample_00.png"
    code = main(
        [
            "analyze",
            "--image",
            str(sample),
            "--question",
            "what shape is the blue object?",
            "--lens",
            str(lens_dir),
            "--json",
            str(tmp_path / "out.json"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err and "lens.json" in err
    assert not (tmp_path / "out.json").exists()
