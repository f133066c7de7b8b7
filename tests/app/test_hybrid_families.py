"""The hybrid and mixture-of-experts families of issue 30 (their tiny models:
tests/core/test_<family>.py), each saved as a user's folder and read out through the
window: a layer without attention pattern is marked in the Attention tab with the
reason (never a row of zeros), the rollout map is not drawn and the note above the
image says why, the DLA tab shows the linear layers' writes and the experts as their
own components; Gemma 3n's decomposition is refused and the DLA tab says why."""

import importlib
import json

import pytest

from app.panels.dla_panel import component_kind
from tests.app.test_canvas_views import shown_analysis
from tests.app.test_window import run_until_idle
from tests.core.exactness import noise_image

# family -> (blocks without pattern, a component of each kind it adds); Gemma 3n: no decomposition
FAMILIES = {
    "gemma3n": ([], None),
    "llama4": ([], {"L1.shared_expert": "expert"}),
    "lfm2_vl": (["L0", "L3"], {"L0.conv": "token mixer (no heads)"}),
    "qwen3_5": (["L0", "L2"], {"L0.linear_attn": "token mixer (no heads)"}),
    "qwen3_vl_moe": ([], {}),
    "qwen3_5_moe": (["L0", "L2"], {"L0.linear_attn": "token mixer (no heads)", "L1.shared_expert": "expert"}),
}


def open_folder(qtbot, window, tmp_path, family):
    module = importlib.import_module(f"tests.core.test_{family}")
    tiny = module.traced_case(module.CASES[0])[0]
    tiny.model.save_pretrained(tmp_path / family, safe_serialization=True)
    tiny.processor.save_pretrained(tmp_path / family)
    window.inputs.model_picker.setCurrentText(str(tmp_path / family))
    assert window.set_image(noise_image(module.IMAGE_SIZE), name="noise")
    window.set_question(module.QUESTION)
    run_until_idle(qtbot, window, window.actions.run_readout)
    analysis = shown_analysis(window)
    assert analysis is not None, window.inputs.error_label.text()
    return analysis


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_familys_folder_reads_out_with_undefined_readouts_marked(qtbot, window, tmp_path, family):
    analysis = open_folder(qtbot, window, tmp_path, family)
    adapter = window.loaded_model().adapter
    assert adapter.family == family
    no_pattern, kinds = FAMILIES[family]
    attending = [name for name, kind in adapter.blocks if kind in ("self", "cross")]
    title = window.attention_panel.title.text()
    assert sorted(analysis.block_names.values()) == sorted(attending)  # rows of the blocks that attend only
    if kinds is None:  # several residual streams: the decomposition is refused, and the DLA tab says why
        assert analysis.residual_decomposition is None
        assert "residual decomposition not defined: " in window.dla_panel.target_label.text()
        assert "AltUp" in window.dla_panel.target_label.text() and window.dla_panel.components() == []
        # stored and restored (a session reopened): still refused, still saying why
        back = type(analysis).from_dict(json.loads(json.dumps(analysis.to_dict())))
        assert back.residual_decomposition is None and back.undefined("residual DLA") == analysis.undefined(
            "residual DLA"
        )
        return
    names = [c.name for c in analysis.residual_decomposition.components]
    for name, kind in kinds.items():
        assert name in names and component_kind(name) == kind
    if no_pattern:
        assert f"no attention pattern and no heads at {', '.join(no_pattern)}" in title
        assert analysis.rollout is None
        assert "rollout not defined" in window.canvas.token_note()
    else:
        assert "no attention pattern" not in title and analysis.rollout is not None
    if any(adapter.moe_experts(b) for b in range(adapter.n_layers)):
        experts = [n for n in names if component_kind(n) == "expert"]
        moe_blocks = {f"L{b}" for b in range(adapter.n_layers) if adapter.moe_experts(b)}
        assert experts and {n.split(".")[0] for n in experts} == moe_blocks


@pytest.mark.parametrize("family,row", [("qwen3_5", "rollout_value"), ("gemma3n", "dla_value")])
def test_the_counterfactual_tab_says_what_is_not_defined(qtbot, window, tmp_path, family, row):
    """A region counterfactual on a hybrid decoder (no rollout) and on Gemma 3n (no source
    contributions): the effect is measured, and the routing row without a number says why."""
    import numpy as np

    open_folder(qtbot, window, tmp_path, family)
    mask = np.zeros((window.image.height, window.image.width), bool)
    mask[: mask.shape[0] // 2] = True
    window.counterfactual_panel.canvas.set_mask(mask)
    run_until_idle(qtbot, window, lambda: window.actions.run_counterfactual(mask, "mean", {}))
    text = getattr(window.counterfactual_panel, row).text()
    assert text.startswith("— (not defined: ") and ("rollout" in text if family == "qwen3_5" else "W_V" in text)
