"""Qwen3.5-MoE adapter on a tiny random float64 model (tests/core/tiny_qwen3_5.py with
``moe=True``: Qwen3.5's hybrid decoder, every MLP four experts, top 2, and a
sigmoid-gated shared expert): Qwen3.5's conformance hooks, the experts through the
conformance suite's expert checks (tests/core/test_family_conformance.py), and the
hybrid and MoE machinery together: a linear layer's write and an expert's are both
components and both ablated exactly."""

import functools

import pytest
import torch

from core.forward.capture import edited_logits
from core.methods.residual import component_edit, decompose
from core.models.families.qwen3_5 import Qwen3_5MoeAdapter
from core.models.loading import LoadedModel
from tests.core import test_qwen3_5 as base
from tests.core.exactness import capture_every_position, noise_image
from tests.core.tiny_qwen3_5 import IMAGE_SIZE, LAYER_TYPES, QUESTION, tiny_model
from tests.core.tiny_qwen3_vl_moe import expert_parts_by_hand, zeroed_expert  # noqa: F401 (family hooks)


def tiny_qwen3_5_moe_float64() -> LoadedModel:
    from core.models import registry

    model, processor = tiny_model(moe=True)
    adapter = registry.adapter_for_hf(model.config.architectures[0])(model, processor, processor.tokenizer)
    return LoadedModel("tiny-qwen3_5_moe", adapter.family, model, processor, processor.tokenizer, adapter)


@functools.cache
def traced_case(kind: str):
    m = tiny_qwen3_5_moe_float64()
    tr, _ = capture_every_position(m, noise_image(IMAGE_SIZE), QUESTION)
    return m, tr


CASES = ("qwen3_5_moe",)
MOE_BLOCKS = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def traced():
    return traced_case("qwen3_5_moe")


ADAPTERS = {"Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeAdapter}
DESCRIPTION = base.DESCRIPTION
KV_LAYOUT = base.KV_LAYOUT
PADDED_BATCH = base.PADDED_BATCH
ANSWER_TOKEN = base.ANSWER_TOKEN
BAD_QUESTIONS = base.BAD_QUESTIONS
PERTURB_SIZES = base.PERTURB_SIZES
check_canonical_weights = base.check_canonical_weights
visual_inputs = base.visual_inputs
perturbation_features = base.perturbation_features
recompute_patterns = base.recompute_patterns


def check_decomposition(m, tr, r) -> None:
    """embed; per layer its mixer (linear) or heads (full), then its chosen experts, the
    shared expert and the residue, never a whole ``L{l}.mlp``."""
    names = [c.name for c in r.components]
    want = ["embed"]
    for layer, kind in enumerate(LAYER_TYPES):
        want += [f"L{layer}.linear_attn"] if kind == "linear_attention" else [f"L{layer}.H{h}" for h in range(4)]
        experts = sorted(n for n in expert_parts_by_hand(m, tr, layer, r.position) if ".E" in n)
        want += [*experts, f"L{layer}.shared_expert", f"L{layer}.experts_residue"]
    assert names == want


def test_a_linear_layer_and_an_expert_together(traced):
    """Zeroing L0's Gated DeltaNet write and L1's most weighted expert at the answer position
    in one run equals the two hand-written hooks together; the decomposition stays exact."""
    m, tr = traced
    a = m.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    answer = int(tr.answer_positions[0])
    expert = int(a._layer(1).mlp.gate(tr.mlp_in[1][0, answer][None])[2][0, 0])
    edits = [component_edit(tr, name, (answer,)) for name in ("L0.linear_attn", f"L1.E{expert}")]
    got = edited_logits(m, inputs, edits)

    def zero(module, args, out):
        out = out.clone()
        out[:, answer] = 0
        return out

    handle = a._layer(0).linear_attn.register_forward_hook(zero)
    try:
        with zeroed_expert(m, 1, expert, [answer]), torch.no_grad():
            want = a.forward_logits(inputs)
    finally:
        handle.remove()
    assert float((got - want).abs().max()) <= 1e-12
    assert float((got - tr.logits).abs().max()) > 1e-4
    assert decompose(a, tr, a.token_id("yes"), a.token_id("no")).reconstruction_ok
