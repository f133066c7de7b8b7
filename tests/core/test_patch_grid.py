"""Activation-patching grids (issue 29, part 3): a cell equals a forward with the same
activation copied by a hand-written hook (not the engine's edits); patching the
residual of every position that differs between the runs, before the first block,
gives the source run (metric 1); the metric is normalised as stated; the command
writes the grid, records it and refuses bad sites, columns and pairs in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import core.cli
from core import load_model
from core.cli import main
from core.errors import InterventionError
from core.files.images import load_image
from core.methods.flow.patch_grid import PatchGrid, patch_grid
from core.models.loading import resources_dir
from core.results.readout import restore_result
from tests.core.exactness import forwards_tol

SAMPLES = resources_dir() / "samples"
IMAGE, SOURCE = SAMPLES / "sample_00.png", SAMPLES / "sample_02.png"
QUESTION = "what shape is the blue object?"


@pytest.fixture(scope="module")
def llava():
    return load_model("shapes-llava")


@pytest.fixture(scope="module")
def grids(llava):
    image, source = load_image(IMAGE), load_image(SOURCE)
    return {
        site: patch_grid(llava, image, source, QUESTION, site=site, head=1 if site == "head" else None)
        for site in ("resid", "attn", "mlp", "head")
    }


@torch.no_grad()
def hooked_logit_diff(loaded, image, source_image, site, block, head, positions, answer_id, foil_id) -> float:
    """``(logit difference, logits, positions)`` of the clean run with ``site`` of ``block`` at ``positions`` set to
    the source run's, by a hook written here on the library's own modules."""
    a = loaded.adapter
    layer = a.language_model.layers[block]
    inputs, source_inputs = a.prepare([image], [QUESTION]), a.prepare([source_image], [QUESTION])
    stored = {}

    def keep_resid(module, args, kwargs):
        stored["resid"] = (args[0] if args else kwargs["hidden_states"]).clone()

    def keep_mlp(module, args, out):
        stored["mlp"] = out.clone()

    def keep_z(module, args):
        stored["z"] = args[0].clone()

    module, kind, keep = {
        "resid": (layer, "pre_kw", keep_resid),
        "mlp": (layer.mlp, "fwd", keep_mlp),
        "z": (layer.self_attn.o_proj, "pre", keep_z),
    }[site]
    register = {
        "pre_kw": lambda f: module.register_forward_pre_hook(f, with_kwargs=True),
        "pre": module.register_forward_pre_hook,
        "fwd": module.register_forward_hook,
    }[kind]
    handle = register(keep)
    a.forward_logits(source_inputs)
    handle.remove()
    src = stored[site]
    p = list(positions)
    cols = slice(None) if head is None else slice(head * a.d_head, (head + 1) * a.d_head)

    def put_resid(module, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).clone()
        x[:, p] = src[:, p]
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    def put_mlp(module, args, out):
        out = out.clone()
        out[:, p] = src[:, p]
        return out

    def put_z(module, args):
        x = args[0].clone()
        x[:, p, cols] = src[:, p, cols]
        return (x,)

    put = {"resid": put_resid, "mlp": put_mlp, "z": put_z}[site]
    handle = register(put)
    try:
        logits = a.forward_logits(inputs)[0, int(inputs.answer_positions[0])].double()
    finally:
        handle.remove()
    return float(logits[answer_id] - logits[foil_id]), logits, inputs.input_ids.shape[1]


def test_every_cell_equals_a_hand_written_hook(llava, grids):
    image, source = load_image(IMAGE), load_image(SOURCE)
    for site, grid in grids.items():
        answer_id, foil_id = grid.clean.answer_id, grid.clean.foil_id
        for b, block in enumerate(grid.blocks):
            for c, column in enumerate(grid.columns):
                hooked, logits, n_pos = hooked_logit_diff(
                    llava,
                    image,
                    source,
                    {"resid": "resid", "mlp": "mlp", "attn": "z", "head": "z"}[site],
                    b,
                    grid.head,
                    column.positions,
                    answer_id,
                    foil_id,
                )
                tol = 2 * forwards_tol(llava.adapter, logits, n_pos)  # a batched row against a single run
                assert grid.logit_diff[b][c] == pytest.approx(hooked, abs=tol), (site, block, column.name)
                span = grid.source.logit_diff - grid.clean.logit_diff
                assert grid.metric[b][c] == pytest.approx((hooked - grid.clean.logit_diff) / span, abs=tol / abs(span))


def test_the_residual_of_every_differing_position_before_the_first_block_is_the_source_run(llava, grids):
    """The runs differ only at the image's positions (the same question): their residual before
    block 0 copied is the source run itself, metric 1; the question's positions copied there change nothing."""
    grid = grids["resid"]
    image_col = [c.name for c in grid.columns].index("image")
    question_col = [c.name for c in grid.columns].index("question")
    assert grid.metric[0][image_col] == pytest.approx(1.0, abs=1e-4)
    assert grid.metric[0][question_col] == pytest.approx(0.0, abs=1e-4)
    assert grid.clean.logit_diff > 0 > grid.source.logit_diff  # the clean answer against the source's
    assert [c.name for c in grid.columns] == ["image", "question", "answer"]  # no region without a mask


def test_each_position_column_and_a_region(llava):
    image, source = load_image(IMAGE), load_image(SOURCE)
    grid = patch_grid(llava, image, source, QUESTION, site="mlp", columns="each")
    n = llava.adapter.prepare([image], [QUESTION]).input_ids.shape[1]
    assert [c.name for c in grid.columns] == [f"p{p}" for p in range(n)]
    assert all(v is not None for row in grid.metric for v in row)
    restored = restore_result("patch-grid", json.loads(json.dumps(grid.to_dict())))
    assert isinstance(restored, PatchGrid) and restored.to_dict() == json.loads(json.dumps(grid.to_dict()))


def test_pairs_the_metric_cannot_read_are_refused(llava):
    image = load_image(IMAGE)
    with pytest.raises(InterventionError, match="both answer"):
        patch_grid(llava, image, image, QUESTION)
    with pytest.raises(InterventionError, match="patch site"):
        patch_grid(llava, image, load_image(SOURCE), QUESTION, site="logits")
    with pytest.raises(InterventionError, match="only that site"):
        patch_grid(llava, image, load_image(SOURCE), QUESTION, site="mlp", head=1)


def test_the_command_writes_the_grid_and_records_it(llava, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(core.cli, "_load", lambda args: llava)
    out, session = tmp_path / "g.json", tmp_path / "s.vlmr"
    argv = ["patch-grid", "--image", str(IMAGE), "--question", QUESTION, "--source-image", str(SOURCE)]
    argv += [
        "--site",
        "head",
        "--head",
        "1",
        "--columns",
        "image,answer",
        "--json",
        str(out),
        "--session",
        str(session),
    ]
    assert main([*argv, "--quiet"]) == 0
    doc = json.loads(out.read_text())
    assert doc["site"] == "head" and doc["head"] == 1 and [c["name"] for c in doc["columns"]] == ["image", "answer"]
    assert len(doc["metric"]) == len(doc["blocks"]) == 4 and "LD_source - LD_clean" in doc["metric_definition"]
    assert "patch grid (head H1, 4 x 2)" in capsys.readouterr().out
    from core.session import Session

    with Session.open(session) as s:
        (info,) = s.runs("patch-grid")
        assert s.run(info.id).readout.to_dict() == doc
        assert s.run(info.id).parameters["source_image"] == str(SOURCE)


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--site", "head"], "only that site"),
        (["--site", "head", "--head", "9"], "the model has heads 0-"),
        (["--columns", "pixels"], "source set 'pixels'"),
        (["--columns", "region"], "needs a painted region"),
        (["--source-image", str(IMAGE)], "both answer"),
    ],
)
def test_bad_grids_are_one_line(llava, tmp_path, monkeypatch, capsys, extra, said):
    monkeypatch.setattr(core.cli, "_load", lambda args: llava)
    out = tmp_path / "g.json"
    argv = ["patch-grid", "--image", str(IMAGE), "--question", QUESTION, "--source-image", str(SOURCE)]
    assert main([*argv, *extra, "--json", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and said in err and "\n" not in err and not out.exists()


def test_a_cross_attention_model_has_no_image_positions_in_its_text():
    coca = load_model("shapes-coca")
    grid = patch_grid(coca, load_image(IMAGE), load_image(SOURCE), QUESTION, site="attn")
    names = [c.name for c in grid.columns]
    assert "image" in names and all(row[names.index("image")] is None for row in grid.metric)
    assert all(v is not None for row in grid.metric for v in row[names.index("answer") :])


def test_a_source_made_by_filling_the_painted_region(llava, tmp_path, monkeypatch, capsys):
    """--source-fill: the source is the image with the --mask region filled; the image's positions
    copied before the first block make it the source run (metric 1); without a mask, or with both
    sources, one line."""
    monkeypatch.setattr(core.cli, "_load", lambda args: llava)
    from PIL import Image

    mask = tmp_path / "mask.png"
    region = np.zeros((128, 128), dtype=np.uint8)
    region[20:64, 30:80] = 255  # the blue square of sample_00
    Image.fromarray(region).save(mask)
    out = tmp_path / "g.json"
    argv = ["patch-grid", "--image", str(IMAGE), "--question", QUESTION, "--source-fill", "mean", "--foil", "triangle"]
    assert main([*argv, "--mask", str(mask), "--columns", "image,region,answer", "--json", str(out), "--quiet"]) == 0
    doc = json.loads(out.read_text())
    assert doc["metric"][0][0] == pytest.approx(1.0, abs=1e-4)
    assert [c["name"] for c in doc["columns"]] == ["image", "region", "answer"]
    assert main([*argv, "--json", str(out), "--quiet"]) == 2
    assert "needs a painted region" in capsys.readouterr().err
    assert main([*argv, "--source-image", str(SOURCE), "--json", str(out), "--quiet"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
