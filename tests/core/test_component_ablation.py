"""Ablating a component named by the read-outs (core.methods.component_ablation),
against a forward with plain torch hooks that do the same thing by hand."""

import pytest
import torch
from PIL import Image

from core.errors import InterventionError
from core.forward.capture import capture
from core.methods.component_ablation import ablation_edits, parse_component
from core.methods.interventions import run_interventions
from core.zoo import scenes
from tests.core.exactness import forwards_tol
from tests.core.test_capture_llava import tiny_llava_float64


@pytest.fixture(scope="module")
def tiny():
    loaded = tiny_llava_float64()
    s = scenes.make_sample("heldout", 3)
    image = Image.fromarray(s.image)
    inputs = loaded.adapter.prepare([image], [s.question])
    base = capture(loaded, None, "", pattern_layers=[], inputs=inputs)
    return loaded, image, s.question, inputs, base


@torch.no_grad()
def _hand_ablated_logits(loaded, inputs, block: int, head: int | None, positions, mlp: bool = False):
    """Answer-position logits with a head's slice of o_proj's input (or the MLP's
    output) zeroed at ``positions`` by a hook written here."""
    layer = loaded.model.model.language_model.layers[block]
    d_head = loaded.adapter.d_head

    def zero_head(module, args):
        x = args[0].clone()
        x[0, positions, head * d_head : (head + 1) * d_head] = 0
        return (x,)

    def zero_mlp(module, args, out):
        out = out.clone()
        out[0, positions] = 0
        return out

    handle = (
        layer.mlp.register_forward_hook(zero_mlp)
        if mlp
        else layer.self_attn.o_proj.register_forward_pre_hook(zero_head)
    )
    try:
        logits = loaded.model(**inputs.tensors, use_cache=False).logits
    finally:
        handle.remove()
    return logits[0, int(inputs.answer_positions[0])]


def test_names_parse_to_the_components_the_views_show(tiny):
    loaded, *_, base = tiny
    names = base.block_names
    assert parse_component("L1.H2", names).head == 2
    assert parse_component("L2.mlp", names).part == "mlp"
    assert parse_component("L0", names).part == "block"
    assert parse_component("L0.attn", names).sites(4) == [("z", 0), ("z", 1), ("z", 2), ("z", 3)]
    for bad, message in (
        ("embed", "constant write"),
        ("bias.L0.attn_out", "constant write"),
        ("deepstack.L0", "constant write"),  # Qwen3-VL's image write: no forward removes it
        ("L9.H0", "no component"),
    ):
        with pytest.raises(InterventionError, match=message):
            parse_component(bad, names)


@pytest.mark.parametrize("name, head, mlp", [("L1.H2", 2, False), ("L2.mlp", None, True)])
def test_zero_ablation_at_the_target_is_the_hand_made_edit(tiny, name, head, mlp):
    loaded, _, _, inputs, base = tiny
    component = parse_component(name, base.block_names)
    pos = int(base.answer_positions[0])
    edits = ablation_edits(loaded.adapter, base, component, kind="zero", positions="target")
    result = run_interventions(loaded, inputs, {name: edits}, answer_id=5, base=base)
    want = _hand_ablated_logits(loaded, inputs, component.block, head, [pos], mlp=mlp)
    tol = forwards_tol(loaded.adapter, want, inputs.input_ids.shape[1])
    assert result.rows[0].edited.logit == pytest.approx(float(want[5]), abs=tol)


def test_zero_ablation_of_every_position_and_of_a_region(tiny):
    loaded, _, _, inputs, base = tiny
    c = parse_component("L1.H0", base.block_names)
    every = ablation_edits(loaded.adapter, base, c, positions="all")
    assert every[0].positions is None
    region = ablation_edits(loaded.adapter, base, c, positions="region", region_tokens=[0, 3])
    assert list(region[0].positions) == [int(base.visual_positions[0][0]), int(base.visual_positions[0][3])]
    result = run_interventions(loaded, inputs, {"region": region}, answer_id=5, base=base)
    want = _hand_ablated_logits(loaded, inputs, 1, 0, list(region[0].positions))
    assert result.rows[0].edited.logit == pytest.approx(float(want[5]), abs=forwards_tol(loaded.adapter, want, 80))
    with pytest.raises(InterventionError, match="paint a region"):
        ablation_edits(loaded.adapter, base, c, positions="region")


def test_mean_and_resample_from_the_run_itself_change_nothing(tiny):
    """Replacing a write with its own value (mean over one reference: itself;
    resampled from itself) must leave the answer as it was."""
    loaded, _, _, inputs, base = tiny
    c = parse_component("L1", base.block_names)  # every head and the MLP
    for kind, extra in (("mean", {"references": [base]}), ("resample", {"source": base})):
        edits = ablation_edits(loaded.adapter, base, c, kind=kind, positions="all", **extra)
        assert len(edits) == loaded.adapter.n_heads + 1
        result = run_interventions(loaded, inputs, {kind: edits}, answer_id=5, base=base)
        logits = base.logits[0, int(base.answer_positions[0])]
        tol = forwards_tol(loaded.adapter, logits, inputs.input_ids.shape[1])
        assert result.rows[0].edited.logit == pytest.approx(result.original.logit, abs=tol)


def test_resample_from_another_image_reads_its_answer_position(tiny):
    loaded, _, question, inputs, base = tiny
    other = Image.fromarray(scenes.make_sample("heldout", 4).image)
    source = capture(loaded, other, question, pattern_layers=[])
    c = parse_component("L2.H1", base.block_names)
    (edit,) = ablation_edits(loaded.adapter, base, c, kind="resample", positions="target", source=source)
    pos = int(source.answer_positions[0])
    torch.testing.assert_close(edit.value, source.z[2][0, [pos], 1], atol=0, rtol=0)
    with pytest.raises(InterventionError, match="another input"):
        ablation_edits(loaded.adapter, base, c, kind="resample")
    with pytest.raises(InterventionError, match="heads 0..3"):
        ablation_edits(loaded.adapter, base, parse_component("L0.H7", base.block_names))


def test_a_cross_attention_model_has_no_region_positions():
    from tests.core.test_capture_coca import tiny_coca_float64

    loaded = tiny_coca_float64()
    s = scenes.make_sample("heldout", 3)
    base = capture(loaded, Image.fromarray(s.image), s.question, pattern_layers=[])
    c = parse_component(base.block_names[-1] + ".H0", base.block_names)
    with pytest.raises(InterventionError, match="cross-attention"):
        ablation_edits(loaded.adapter, base, c, positions="region", region_tokens=[0])
