"""`vlm-readout analyze` writes the analyze JSON of docs/ARCHITECTURE.md with numbers a reader can check."""

import json

import pytest
import torch

from core.cli import main
from core.models.loading import resources_dir
from tests.core.exactness import frozen_sum_tol, lens_logit_tol, target_tol
from tests.tolerances import sum_tol

SAMPLE = resources_dir() / "samples" / "sample_00.png"
QUESTION = "what shape is the blue object?"


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("analyze") / "out.json"
    assert (
        main(
            [
                "analyze",
                "--model",
                "shapes-llava",
                "--image",
                str(SAMPLE),
                "--question",
                QUESTION,
                "--answer",
                "square",
                "--foil",
                "triangle",
                "--json",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    return json.loads(out.read_text())


def test_every_design_field_is_present(result):
    assert result["schema_version"] == 1
    assert {"spec", "family", "n_layers", "n_heads", "d_model", "final_norm", "attention_kind"} <= set(result["model"])
    assert {"question", "prompt", "input_ids", "tokens", "image_sha256", "image_size", "visual_tokens"} <= set(
        result["input"]
    )
    assert {"index", "position", "image", "row", "col", "box"} == set(result["input"]["visual_tokens"][0])
    assert {"position", "answer", "answer_id", "foil", "foil_id", "logit", "logit_diff", "prob", "predicted"} <= set(
        result["target"]
    )
    comp = result["residual_decomposition"]["components"][0]
    assert {"name", "norm", "projection", "dla_frozen", "dla_jacobian"} <= set(comp)
    assert {"layer", "answer_rank", "answer_logit", "logit_diff", "kl_to_final", "top"} <= set(result["logit_lens"][0])
    head = result["attention"][0]
    assert {"layer", "head", "visual_mass", "bos_mass", "entropy", "argmax_source", "visual_patch_mass"} <= set(head)
    assert {"alpha", "visual_patch_mass"} <= set(result["rollout"])
    assert {"method", "question", "operation", "controls", "supports", "cannot_support", "parameters"} <= set(
        result["audit"][0]
    )


@pytest.fixture(scope="module")
def trace():
    """A capture of the same input: the magnitudes the tolerances below are relative to."""
    from core import load_model
    from core.forward.capture import capture

    return load_model("shapes-llava"), capture(load_model("shapes-llava"), SAMPLE, QUESTION)


def test_numbers_are_consistent(result, trace):
    m, tr = trace
    t = result["target"]
    assert (t["answer"], t["foil"]) == ("square", "triangle")
    p, ids = t["position"], (t["answer_id"], t["foil_id"])
    rd = result["residual_decomposition"]
    assert rd["target_logit"] == pytest.approx(t["logit_diff"], abs=target_tol(m.adapter, tr, p, *ids))
    tol = frozen_sum_tol(m.adapter, tr, p, *ids)
    assert sum(c["dla_frozen"] for c in rd["components"]) == pytest.approx(rd["frozen_sum_expected"], abs=tol)
    tol = lens_logit_tol(m.adapter, tr, p, list(ids))
    assert result["logit_lens"][-1]["logit_diff"] == pytest.approx(t["logit_diff"], abs=tol)
    n = result["model"]["n_layers"] * result["model"]["n_heads"]
    assert len(result["attention"]) == n
    # float32 weights (non-negative, at most 1 in all): the grid's cells against the
    # visual keys' sum, in other orders; a row sums to 1 up to its softmax over every key
    n_keys = len(result["input"]["input_ids"])
    for h in result["attention"]:
        grid_sum = sum(map(sum, h["visual_patch_mass"]))
        assert grid_sum == pytest.approx(h["visual_mass"], abs=sum_tol(1.0, 2 * 64, torch.float32))
        assert h["visual_mass"] + h["bos_mass"] <= 1 + sum_tol(1.0, n_keys + 6, torch.float32)
    vt = result["input"]["visual_tokens"]
    assert len(vt) == 64 and vt[9]["row"] == 1 and vt[9]["col"] == 1
    assert vt[0]["box"] == pytest.approx([0, 0, 16, 16])
    assert all(
        result["input"]["input_ids"][v["position"]] == result["input"]["input_ids"][vt[0]["position"]] for v in vt
    )
