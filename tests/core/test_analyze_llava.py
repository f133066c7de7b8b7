"""`vlm-readout analyze` writes DESIGN.md's JSON with numbers a reader can check."""

import json

import pytest

from core.cli import main
from core.models.loading import resources_dir

SAMPLE = resources_dir() / "samples" / "sample_00.png"


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
                "what shape is the blue object?",
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


def test_numbers_are_consistent(result):
    t = result["target"]
    assert (t["answer"], t["foil"]) == ("square", "triangle")
    rd = result["residual_decomposition"]
    assert rd["target_logit"] == pytest.approx(t["logit_diff"], abs=1e-4)
    assert sum(c["dla_frozen"] for c in rd["components"]) == pytest.approx(rd["frozen_sum_expected"], abs=1e-3)
    assert result["logit_lens"][-1]["logit_diff"] == pytest.approx(t["logit_diff"], abs=1e-4)
    n = result["model"]["n_layers"] * result["model"]["n_heads"]
    assert len(result["attention"]) == n
    for h in result["attention"]:
        grid_sum = sum(map(sum, h["visual_patch_mass"]))
        assert grid_sum == pytest.approx(h["visual_mass"], abs=1e-5)
        assert h["visual_mass"] + h["bos_mass"] <= 1 + 1e-5
    vt = result["input"]["visual_tokens"]
    assert len(vt) == 64 and vt[9]["row"] == 1 and vt[9]["col"] == 1
    assert vt[0]["box"] == pytest.approx([0, 0, 16, 16])
    assert all(
        result["input"]["input_ids"][v["position"]] == result["input"]["input_ids"][vt[0]["position"]] for v in vt
    )
