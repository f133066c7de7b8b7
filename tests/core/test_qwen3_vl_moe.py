"""Qwen3-VL-MoE adapter on a tiny random float64 model (tests/core/tiny_qwen3_vl_moe.py:
layer 0 dense, layers 1-2 four experts, top 2): Qwen3-VL's conformance checks, and
the experts through the conformance suite's expert checks (the MLP's write split into
one component per routed expert reconstructs the MLP output to float64 rounding; an
expert's ablation equals a forward with that expert's output zeroed by a hook on the
library's experts module: this family's hooks, from tests/core/tiny_qwen3_vl_moe.py)."""

import functools

import pytest
import torch

from core.errors import InterventionError
from core.forward.capture import edited_logits
from core.forward.edits import Edit
from core.methods.residual import decompose
from core.models.families.qwen3_vl_moe import Qwen3VLMoeAdapter
from core.models.loading import LoadedModel
from tests.core import test_qwen3_vl as base
from tests.core.exactness import capture_every_position, noise_image
from tests.core.tiny_qwen3_vl_moe import (  # noqa: F401 (expert_parts_by_hand, zeroed_expert: family hooks)
    IMAGE_SIZE,
    QUESTION,
    expert_parts_by_hand,
    route,
    tiny_model,
    zeroed_expert,
)

MOE, DENSE = [1, 2], [0]


def tiny_qwen3_vl_moe_float64() -> LoadedModel:
    from core.models import registry

    model, processor = tiny_model()
    adapter = registry.adapter_for_hf(model.config.architectures[0])(model, processor, processor.tokenizer)
    return LoadedModel("tiny-qwen3_vl_moe", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str):
    m = tiny_qwen3_vl_moe_float64()
    tr, _ = capture_every_position(m, noise_image(IMAGE_SIZE), QUESTION)
    return m, tr


CASES = ("qwen3_vl_moe",)


@pytest.fixture(scope="module")
def traced():
    return traced_case("qwen3_vl_moe")


# ---- this family's parts of the conformance checks: Qwen3-VL's, but the MLP components

ADAPTERS = {"Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeAdapter}
DESCRIPTION = base.DESCRIPTION
KV_LAYOUT = base.KV_LAYOUT
CANONICAL_LAYERS = base.CANONICAL_LAYERS
PADDED_BATCH = base.PADDED_BATCH
ANSWER_TOKEN = base.ANSWER_TOKEN
BAD_QUESTIONS = base.BAD_QUESTIONS
PERTURB_SIZES = base.PERTURB_SIZES
check_canonical_weights = base.check_canonical_weights
check_padded_batch = base.check_padded_batch
check_appended_token = base.check_appended_token
visual_inputs = base.visual_inputs
deepstack_features = base.deepstack_features
perturbation_features = base.perturbation_features
perturbation_probes = base.perturbation_probes
check_reconstruction = base.check_reconstruction


def recompute_patterns(a, tr, layer: int):
    return base._recompute_patterns(a, tr, layer)


def check_decomposition(m, tr, r) -> None:
    """embed; per layer its heads; layer 0's MLP whole; layers 1 and 2 each their two
    routed experts at this position and the residue."""
    names = [c.name for c in r.components]
    want = ["embed", *[f"L0.H{h}" for h in range(4)], "L0.mlp"]
    p = r.position
    for layer in MOE:
        _, _, chosen = route(m.adapter._layer(layer).mlp, tr.mlp_in[layer][0, p][None])
        experts = sorted(chosen[0].tolist())
        want += [*[f"L{layer}.H{h}" for h in range(4)], *[f"L{layer}.E{e}" for e in experts]]
        want.append(f"L{layer}.experts_residue")
    assert names == want


# ---- the experts


def test_moe_blocks_are_declared_and_their_inputs_recorded(traced):
    m, tr = traced
    a = m.adapter
    assert [a.moe_experts(b) for b in range(3)] == [0, 4, 4]
    assert sorted(tr.mlp_in) == MOE
    for b in MOE:  # what the MoE module read: the block's post-attention norm of its stream
        x = tr.resid_pre[b] + tr.attn_out[b]
        torch.testing.assert_close(tr.mlp_in[b], a._layer(b).post_attention_layernorm(x), atol=0, rtol=0)
    assert "expert" in a.edit_sites


def test_an_expert_edit_is_checked(traced):
    m, _ = traced
    a = m.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    with pytest.raises(InterventionError, match="4 routed experts"):
        edited_logits(m, inputs, [Edit(1, None, [3], site="expert", expert=4)])
    with pytest.raises(InterventionError, match="0 routed experts"):
        edited_logits(m, inputs, [Edit(0, None, [3], site="expert", expert=0)])
    with pytest.raises(InterventionError, match="names its expert"):
        Edit(1, None, [3], site="expert")


def test_decomposition_is_exact_with_expert_components(traced):
    m, tr = traced
    a = m.adapter
    for position in [int(tr.visual_positions[0][2]), int(tr.answer_positions[0])]:
        r = decompose(a, tr, a.token_id("yes"), a.token_id("no"), position=position)
        assert r.reconstruction_ok
        assert any(c.name.startswith("L2.E") for c in r.components)
