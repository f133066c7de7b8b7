"""Qwen3-VL-MoE adapter on a tiny random float64 model (tests/core/tiny_qwen3_vl_moe.py:
layer 0 dense, layers 1-2 four experts, top 2): Qwen3-VL's conformance checks, and
the experts: the MLP's write split into one component per routed expert (router
weight times expert output) reconstructs the MLP output to float64 rounding, and an
expert's ablation equals a forward with that expert's output zeroed by a hook written
here on the library's experts module."""

import functools

import pytest
import torch

from core.errors import InterventionError
from core.forward.capture import edited_logits
from core.forward.edits import Edit
from core.methods.residual import component_edit, decompose
from core.models.families.qwen3_vl_moe import Qwen3VLMoeAdapter
from core.models.loading import LoadedModel
from tests.core import test_qwen3_vl as base
from tests.core.exactness import capture_every_position, noise_image
from tests.core.tiny_qwen3_vl_moe import IMAGE_SIZE, QUESTION, expert_output, route, tiny_model
from tests.tolerances import sum_tol

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
check_question_errors = base.check_question_errors
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


def test_expert_components_reconstruct_the_mlp_output(traced):
    """At every position the routed experts' writes (by hand here: the router's own
    choice, weight times the fused SwiGLU) sum to the MoE block's output to float64
    rounding; each chosen expert's component is that product; the residue is tiny."""
    m, tr = traced
    a = m.adapter
    n_pos = tr.input_ids.shape[1]
    for b in MOE:
        block = a._layer(b).mlp
        x = tr.mlp_in[b][0]
        _, weights, chosen = route(block, x)
        for p in range(n_pos):
            parts = dict(a.mlp_components(tr, b, p))
            assert sorted(parts) == sorted([f"L{b}.E{e}" for e in chosen[p].tolist()] + [f"L{b}.experts_residue"])
            for slot, e in enumerate(chosen[p].tolist()):
                want = weights[p, slot] * expert_output(block.experts, e, x[p][None])[0]
                torch.testing.assert_close(parts[f"L{b}.E{e}"], want, atol=0, rtol=1e-13)
            write = tr.mlp_out[b][0, p]
            total = sum(v for name, v in parts.items() if not name.endswith("residue"))
            # the same k products summed in other orders (the model's k adds into zeros, ours), each side
            # k + 1 roundings; len(parts) = k + 1 with the residue
            tol = sum_tol(float(sum(v.abs() for v in parts.values()).max()), 2 * len(parts), torch.float64)
            assert float((total - write).abs().max()) <= tol
            assert float(parts[f"L{b}.experts_residue"].abs().max()) <= tol


def test_expert_ablation_equals_a_hand_written_hook(traced):
    """Edit site "expert" (component_edit of ``L1.E{e}``) at some positions equals a
    forward whose experts module, patched here, zeroes expert e's output for those tokens;
    a routed expert's ablation moves the logits, an expert no token at those positions
    chose changes nothing."""
    m, tr = traced
    a = m.adapter
    inputs = a.prepare([noise_image(IMAGE_SIZE)], [QUESTION])
    answer = int(tr.answer_positions[0])
    positions = [*tr.visual_positions[0][:4].tolist(), answer]
    _, _, chosen = route(a._layer(1).mlp, tr.mlp_in[1][0])
    used = int(chosen[answer, 0])
    for expert in range(4):
        edit = component_edit(tr, f"L1.E{expert}", tuple(positions))
        assert (edit.site, edit.block, edit.expert) == ("expert", 1, expert)
        got = edited_logits(m, inputs, [edit])
        experts = a._layer(1).mlp.experts
        real = type(experts).forward

        def zeroed(module, hidden, top_k_index, top_k_weights, expert=expert, real=real):
            weights = top_k_weights.clone()
            at = torch.zeros(hidden.shape[0], dtype=torch.bool)
            at[positions] = True  # one batch row: token index = position
            weights[at[:, None] & (top_k_index == expert)] = 0  # that expert's output zeroed there
            return real(module, hidden, top_k_index, weights)

        experts.forward = zeroed.__get__(experts)
        try:
            with torch.no_grad():
                want = a.forward_logits(inputs)
        finally:
            del experts.forward
        diff = float((got - want).abs().max())
        assert diff <= 1e-12, (expert, diff)
        moved = float((got - tr.logits).abs().max())
        chose = bool((chosen[positions] == expert).any())
        assert (moved > 1e-6) if chose else (moved == 0), (expert, moved)
        if expert == used:
            assert moved > 1e-3


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
