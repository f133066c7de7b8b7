"""Every family, tiny and random in float64, through the shared read-outs:
``analyze`` writes the analyze JSON of docs/ARCHITECTURE.md (schema 1, strict JSON, patch grids per
image), and the RoPE/q-k-norm-aware scores of qk_ov equal the model's own
pre-softmax scores recorded inside its eager attention."""

import json

import numpy as np
import pytest
import torch

from core.analyze import analyze
from core.forward.capture import capture
from core.methods.qk_ov import model_scores, realized_scores
from tests.core.exactness import frozen_sum_tol, noise_image, pattern_rtol, realized_scores_tol, stack_tol


def _case(name):
    """(loaded model, image, question) of each family's own test module."""
    if name == "llava_next":
        from tests.core import test_llava_next as t

        return t.tiny_llava_next_float64(), noise_image(t.IMAGE_SIZE), t.QUESTION
    if name == "paligemma":
        from tests.core import test_paligemma as t

        return t.tiny_paligemma_float64(), noise_image(t.IMAGE_SIZE), t.QUESTION
    if name in ("idefics3", "smolvlm"):
        from tests.core import test_idefics3 as t

        return t.tiny_model_float64(name), noise_image(t.IMAGE_SIZE), t.QUESTION
    if name == "mllama":
        from tests.core import test_mllama as t

        return t.tiny_mllama_float64(), noise_image(t.IMAGE_SIZE), t.QUESTION
    if name == "blip":
        from tests.core import test_blip as t

        return t.tiny_blip_float64(), noise_image(t.IMAGE_SIZE), t.PREFIX
    if name == "qwen3_vl":
        from tests.core import test_qwen3_vl as t

        return t.tiny_qwen3_float64(), noise_image(t.IMAGE_SIZE), t.QUESTION
    if name.startswith("qwen"):
        from tests.core import test_qwen2_vl as t

        return t.tiny_qwen_float64(name, name == "qwen2_5_vl"), noise_image(t.IMAGE_SIZE), t.QUESTION
    raise KeyError(name)


FAMILIES = ["llava_next", "paligemma", "idefics3", "smolvlm", "mllama", "blip", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    with torch.no_grad():
        return (request.param, *_case(request.param))


def test_analyze_json_is_complete_strict_and_exact(case):
    name, m, image, question = case
    result = analyze(m, image, question).to_dict()
    text = json.dumps(result, allow_nan=False)  # strict JSON: no NaN anywhere
    assert json.loads(text)["schema_version"] == 1
    for key in ("model", "input", "target", "residual_decomposition", "logit_lens", "attention", "rollout", "audit"):
        assert key in result
    # the exactness claims of the JSON's decomposition, within what the arithmetic
    # allows (float32 norm statistics in most of these float64 models)
    target = result["target"]
    tr = capture(m, image, question)
    p = target["position"]
    assert result["residual_decomposition"]["reconstruction_max_abs_err"] <= stack_tol(m.adapter, tr, p)
    comps = result["residual_decomposition"]["components"]
    tol = frozen_sum_tol(m.adapter, tr, p, target["answer_id"], target["foil_id"])
    assert sum(c["dla_frozen"] for c in comps) == pytest.approx(
        result["residual_decomposition"]["frozen_sum_expected"], abs=tol
    )
    a = m.adapter
    assert len(result["attention"]) == len(a.blocks) * a.n_heads
    assert len(result["logit_lens"]) == len(a.blocks) + 1
    tokens = result["input"]["visual_tokens"]
    assert tokens and all(set(t) >= {"index", "position", "image", "row", "col", "box"} for t in tokens)
    grid = np.array(result["rollout"]["visual_patch_mass"])
    assert grid.ndim == 2 and np.isfinite(grid).all()
    head = result["attention"][0]
    assert np.array(head["visual_patch_mass"]).shape == grid.shape
    images = {t["image"] for t in tokens if t["col"] >= 0}
    if len(images) > 1:  # tiles / base + high resolution: every image's grid is there too
        assert {g["image"] for g in result["rollout"]["visual_patch_mass_by_image"]} == images


def test_realized_scores_equal_the_models_own_scores(case):
    name, m, image, question = case
    n = m.adapter.prepare([image], [question]).input_ids.shape[1]
    try:
        tr = capture(m, image, question, query_positions=range(n), keep_qk=True)
    except NotImplementedError as e:  # attention classes without transformers' eager interface
        pytest.skip(str(e))
    a = m.adapter
    for block in range(tr.n_blocks):
        realized = realized_scores(a, tr, block)
        theirs = model_scores(tr, block)
        error = realized_scores_tol(a, tr, block)
        torch.testing.assert_close(realized.scores, theirs.to(realized.scores.dtype), atol=error, rtol=0)
        scores = realized.scores.masked_fill(~a.allowed_keys(tr, block), float("-inf"))
        rtol = pattern_rtol(a, tr, scores, error)
        torch.testing.assert_close(
            realized.pattern, tr.patterns[block][0].to(realized.pattern.dtype), atol=0, rtol=rtol
        )
