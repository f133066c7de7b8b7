"""A tuned-lens folder that is not what it says is refused in one line
naming the file and the field: unreadable, non-object or deeply nested
lens.json; fields of the wrong type or out of range (n_blocks, d_model
negative, huge, infinite); a tensors file outside the folder, not a regular
file, with another header (names, dtypes, shapes) than the config implies,
larger than the memory available; non-finite or integer tensors; a lens of
another shape of model. Nothing is allocated from the config before the
header agrees with it."""

import json
import os
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import core.methods.tuned_lens.store as store
from core.methods.tuned_lens import LensError, LensMismatchError, load_lens

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
        (lambda c: c.update(translator=[1]), '"translator" must be an object, got an array'),
        (lambda c: c.update(model="x"), '"model" must be an object, got a string'),
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


# ---- every number of lens.json, in range before anything is built from it


def _translator(key, value):
    return lambda c: c["translator"].update({key: value})


BAD_CONFIG = {
    "n_blocks negative": (_translator("n_blocks", -4), '"translator.n_blocks" must be in 1..4,096, got -4'),
    "n_blocks zero": (_translator("n_blocks", 0), '"translator.n_blocks" must be in 1..4,096, got 0'),
    "n_blocks huge": (_translator("n_blocks", 10**9), '"translator.n_blocks" must be in 1..4,096, got 1,000,000,000'),
    "n_blocks 1e9": (_translator("n_blocks", 1e9), '"translator.n_blocks" must be an integer, got a number'),
    "n_blocks a string": (_translator("n_blocks", "4"), '"translator.n_blocks" must be an integer, got a string'),
    "n_blocks true": (_translator("n_blocks", True), '"translator.n_blocks" must be an integer, got a boolean'),
    "n_blocks missing": (lambda c: c["translator"].pop("n_blocks"), 'no "translator.n_blocks" field'),
    "d_model negative": (_translator("d_model", -128), '"translator.d_model" must be in 1..131,072, got -128'),
    "d_model huge": (_translator("d_model", 2**70), '"translator.d_model" must be in 1..131,072, got a 71-bit number'),
    "d_model null": (_translator("d_model", None), '"translator.d_model" must be an integer, got null'),
    "form unknown": (_translator("form", "quadratic"), '"translator.form" must be one of identity, affine'),
    "dtype not a dtype": (_translator("dtype", "load"), '"translator.dtype" must be one of float32'),
    "dtype int64": (_translator("dtype", "int64"), '"translator.dtype" must be one of float32'),
    "seed negative": (_translator("seed", -1), '"translator.seed" must be in 0..'),
    "rank for affine": (_translator("rank", 4), '"translator.rank" must be null for the affine form'),
    "schema version true": (lambda c: c.update(schema_version=True), "schema version True, this build reads 1"),
    "block names not text": (lambda c: c["model"].update(block_names=[1, 2]), '"model.block_names[0]" must be a string'),
    "positions unknown": (lambda c: c["training"]["config"].update(positions="some"), '"training.config.positions"'),
    "evaluations a list": (lambda c: c["report"].update(evaluations=[]), '"report.evaluations" must be an object'),
    "tensors empty": (lambda c: c.update(tensors=""), '"tensors" must name a file inside the lens folder'),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_CONFIG))
def test_each_config_field_is_checked_before_anything_is_built(lens_dir, case):
    edit, needle = BAD_CONFIG[case]
    _edit_config(lens_dir, edit)
    with pytest.raises(LensError) as e:
        load_lens(lens_dir)
    message = str(e.value)
    assert message.startswith(f"{lens_dir / 'lens.json'}: ") and "\n" not in message and needle in message, message


def test_infinity_in_lens_json_is_refused(lens_dir):
    text = (lens_dir / "lens.json").read_text()
    for literal, named in (("Infinity", "Infinity is not JSON"), ("1e999", '"translator.d_model" must be an integer')):
        head, tail = text.rsplit('"d_model": 128', 1)  # the translator's (the model block has one too)
        (lens_dir / "lens.json").write_text(f'{head}"d_model": {literal}{tail}')
        with pytest.raises(LensError, match=named):
            load_lens(lens_dir)


def test_lowrank_needs_a_rank_within_the_width(lens_dir):
    _edit_config(lens_dir, lambda c: c["translator"].update(form="lowrank"))
    with pytest.raises(LensError, match='"translator.rank" must be an integer, got null'):
        load_lens(lens_dir)
    _edit_config(lens_dir, lambda c: c["translator"].update(rank=129))
    with pytest.raises(LensError, match='"translator.rank" must be in 1..128, got 129'):
        load_lens(lens_dir)


def test_a_config_of_terabytes_is_refused_by_the_header_without_allocating(lens_dir):
    """n_blocks and d_model at their bounds (an affine lens of 4096 x 131072^2
    floats, 281 TB): refused by the tensors file's header, at once."""
    _edit_config(lens_dir, lambda c: c["translator"].update(n_blocks=4096, d_model=2**17))
    start = time.perf_counter()
    with pytest.raises(
        LensError, match=r"tensor 'A' has shape \[4, 128, 128\]; lens.json implies \[4096, 131072, 131072\]"
    ):
        load_lens(lens_dir)
    assert time.perf_counter() - start < 5


# ---- the tensors file


def _retensor(d: Path, edit) -> None:
    path = d / "lens.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda t: t.update(A=t["A"].to(torch.int64)), "tensor 'A' is I64; lens.json says float32 (F32)"),
        (lambda t: t.update(b=t["b"].double()), "tensor 'b' is F64; lens.json says float32"),
        (lambda t: t.update(mean=t["mean"][:3]), "tensor 'mean' has shape [3, 128]; lens.json implies [5, 128]"),
        (lambda t: t.update(extra=torch.zeros(1)), "do not match a affine lens"),
        (lambda t: t.pop("A"), "do not match a affine lens"),
    ],
)
def test_a_header_that_disagrees_with_the_config(lens_dir, edit, named):
    _retensor(lens_dir, edit)
    with pytest.raises(LensError) as e:
        load_lens(lens_dir)
    message = str(e.value)
    assert message.startswith(f"{lens_dir / 'lens.safetensors'}: ") and named in message, message


def test_a_lying_or_truncated_header_is_unreadable(lens_dir):
    path = lens_dir / "lens.safetensors"
    header = json.dumps(
        {"A": {"dtype": "F32", "shape": [4, 128, 128], "data_offsets": [0, 4 * 128 * 128 * 4]}}
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    with pytest.raises(LensError, match=r"lens.safetensors: unreadable safetensors \(SafetensorError"):
        load_lens(lens_dir)
    path.write_bytes(struct.pack("<Q", 2**40))
    with pytest.raises(LensError, match="unreadable safetensors"):
        load_lens(lens_dir)


def test_a_lens_larger_than_the_memory_available(lens_dir, monkeypatch):
    monkeypatch.setenv("VLM_READOUT_MEMORY_AVAILABLE", "1000")
    with pytest.raises(
        LensError, match=r"lens.safetensors: the lens needs 0.3 GB and 0.0 GB of memory is available|needs"
    ):
        load_lens(lens_dir)


def _loads_within(target, seconds: float = 10.0) -> str:
    """The LensError message of ``load_lens(target)``, failing if it blocks."""
    result = {}

    def run():
        try:
            load_lens(target)
        except LensError as e:
            result["message"] = str(e)

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    reader.join(seconds)
    assert not reader.is_alive(), "load_lens blocked"
    return result["message"]


def test_fifos_and_files_that_are_not_folders_do_not_hang(lens_dir, tmp_path):
    config = lens_dir / "lens.json"
    config.unlink()
    os.mkfifo(config)
    assert "not a regular file" in _loads_within(lens_dir)
    config.unlink()
    shutil.copy(SHIPPED / "lens.json", config)
    tensors = lens_dir / "lens.safetensors"
    tensors.unlink()
    os.mkfifo(tensors)
    assert _loads_within(lens_dir) == f"{tensors}: not a regular file (a FIFO, socket or device)"
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert _loads_within(afile).startswith(f"{afile}: not a folder")
    assert _loads_within(tmp_path / "none").startswith(f"{tmp_path / 'none'}: not a folder")


def test_deep_or_oversized_lens_json(lens_dir, monkeypatch):
    (lens_dir / "lens.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(LensError, match="lens.json: JSON nested deeper than 64 levels"):
        load_lens(lens_dir)
    shutil.copy(SHIPPED / "lens.json", lens_dir / "lens.json")
    monkeypatch.setattr(store, "MAX_LENS_CONFIG_BYTES", 100)
    with pytest.raises(LensError, match=r"lens.json: [0-9,]+ bytes, over the 100-byte limit"):
        load_lens(lens_dir)


def test_a_lens_of_another_shape_of_model_is_refused_before_its_tensors_are_read(lens_dir):
    from core import load_model

    loaded = load_model("shapes-llava")
    assert load_lens(lens_dir, loaded).n_blocks == len(loaded.adapter.blocks)
    _edit_config(lens_dir, lambda c: c["translator"].update(n_blocks=7))
    (lens_dir / "lens.safetensors").write_bytes(b"not read")  # the shape check comes first
    with pytest.raises(LensMismatchError, match="has 7 blocks of width 128; the model has 4 of width 128"):
        load_lens(lens_dir, loaded)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (_translator("d_model", -1), '"translator.d_model" must be in 1..131,072, got -1'),
        (_translator("n_blocks", 10**9), '"translator.n_blocks" must be in 1..4,096'),
        (lambda c: c.update(translator="affine"), '"translator" must be an object, got a string'),
    ],
)
def test_the_cli_answers_each_with_one_error_line(lens_dir, tmp_path, capsys, edit, needle):
    from core.cli import main

    _edit_config(lens_dir, edit)
    sample = Path(__file__).resolve().parents[2] / "resources" / "samples" / "sample_00.png"
    argv = ["analyze", "--image", str(sample), "--question", "what shape is the blue object?", "--lens", str(lens_dir)]
    assert main([*argv, "--json", str(tmp_path / "out.json"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {lens_dir / 'lens.json'}: ") and needle in err and "\n" not in err
    assert not (tmp_path / "out.json").exists()


# ---------------------------------------------------------------- corpora: a batch at a time


def test_an_evaluation_set_is_decoded_a_batch_at_a_time(tmp_path, monkeypatch):
    """eval-lens --pairs used to decode every image before the first forward (a
    million pairs, a million images in memory): take() decodes none, a slice
    decodes its own."""
    import core.methods.tuned_lens.data as data
    from core.files.pairs import Pair
    from core.zoo.lens_corpus import SyntheticCorpus

    decoded = []
    monkeypatch.setattr(data, "load_pair_image", lambda pair: decoded.append(pair.line) or pair.line)
    pairs = [Pair(i, i + 1, f"pairs.jsonl:{i + 1}", f"{i}.png", tmp_path / f"{i}.png", f"q{i}") for i in range(10_000)]
    taken = data.PairsCorpus(pairs).take()
    assert len(taken.images) == 10_000 and decoded == []
    assert taken.images[16:19] == [17, 18, 19] and taken.images[-1] == 10_000 and decoded == [17, 18, 19, 10_000]
    synthetic = SyntheticCorpus("heldout").take(1_000_000)  # drawn as read: returns at once
    assert (
        len(synthetic.questions) == 1_000_000
        and synthetic.questions[0] == SyntheticCorpus("heldout").sample(0).question
    )


def test_eval_lens_names_a_bad_image_before_the_model_loads(tmp_path):
    from core.cli import build_parser
    from core.cli.lens import run_eval
    from core.errors import ReadoutError

    pairs = tmp_path / "pairs.jsonl"
    (tmp_path / "bad.png").write_bytes(b"not a png")
    good = Path(__file__).resolve().parents[2] / "resources" / "samples" / "sample_00.png"
    pairs.write_text(f'{{"image": "{good}", "question": "q"}}\n{{"image": "bad.png", "question": "q"}}\n')

    def never(args):
        raise AssertionError("the model loaded before the images were checked")

    argv = ["eval-lens", "--model", "shapes-llava", "--lens", str(SHIPPED), "--pairs", str(pairs)]
    with pytest.raises(ReadoutError) as e:
        run_eval(build_parser().parse_args([*argv, "--json", str(tmp_path / "e.json"), "--quiet"]), load=never)
    assert str(e.value).startswith(f"{pairs}:2: ") and "bad.png" in str(e.value), e.value
