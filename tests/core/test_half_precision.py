"""The exactness suite in bfloat16 and float16 (issue 25): every served family's
tiny model, converted from its float64 build, passes the checks the float64
models pass (tests/core/exactness.py, test_generate.py, test_answer_text.py),
with the half-precision tolerances of tests/tolerances.py (``gamma``: a float32
accumulation rounded once to the half dtype; the read-outs accumulate in
float32, ``core.shell.precision.accumulation_dtype``).

One converted model and one capture per model and dtype, cached for the session."""

import copy
import functools

import pytest
import torch

from core.forward.capture import capture
from core.methods.logit_lens import logit_lens
from core.methods.residual import component_stack, decompose, target_direction
from core.models.loading import LoadedModel
from tests.core.exactness import (
    assert_decomposition_is_exact,
    assert_heads_sum_to_attention_output,
    assert_jacobian_dla_is_autograd,
    assert_lens_last_row_is_the_model,
    assert_recomputed_rows_are_eager,
    assert_reconstruction_and_lens_at_last_layer,
    frozen_map_terms,
    frozen_sum_tol,
    head_write_terms,
)
from tests.core.test_answer_text import assert_every_answer_token_reads_the_plain_forward
from tests.core.test_family_conformance import _id
from tests.core.test_generate import (
    FAMILY_CASES,
    assert_cached_steps_equal_a_rerun,
    case_of,
    no_end_tokens,  # noqa: F401 (a fixture)
)
from tests.tolerances import HALF_DTYPES, unit_roundoff

# One key per served tiny model (test_generate.case_of): LLaVA-1.5 and CoCa of their own
# files, then one per model of the family files (llava_next, qwen2_vl, qwen2_5_vl,
# paligemma, idefics3, smolvlm, mllama, blip).
MODELS = [("own", "tiny-llava"), ("own", "tiny-coca")] + FAMILY_CASES
MODEL_IDS = ["llava", "coca"] + [_id(c) for c in FAMILY_CASES]
DTYPE_IDS = ["bf16", "fp16"]
# The (answer, foil) words each tiny vocabulary has (BLIP's captioner reads its own pair).
WORDS = {"tiny-llava": ("circle", "square"), "tiny-coca": ("circle", "square"), "blip": ("cat", "dog")}
# Post-norm (BLIP), sandwich norms (Gemma 3, GLM-4V: attn_out before its post-norm): x_L is not x_0 plus
# attn_out and mlp_out; the stack is checked through decompose.
POST_NORM = {"blip", "gemma3", "glm4v"}
# Several residual streams (Gemma 3n's AltUp): x_L has no additive decomposition; it is refused
# (tests/core/test_gemma3n.py), in any dtype.
NO_DECOMPOSITION = {"gemma3n"}
# The models whose vocabularies spell test_answer_text.ANSWER (teacher forcing).
TEACHER_FORCED = [("own", "tiny-llava"), ("own", "tiny-coca"), ("qwen2_vl", "qwen2_vl")]


def _params(keys, ids):
    """``(key, dtype)`` for every key and half dtype."""
    return [
        pytest.param(key, dtype, id=f"{name}-{dtype_id}")
        for key, name in zip(keys, ids)
        for dtype, dtype_id in zip(HALF_DTYPES, DTYPE_IDS)
    ]


CAPTURED = _params(MODELS, MODEL_IDS)


@functools.cache
def half_model(key, dtype: torch.dtype):
    """``(model, image, question, cross_keys)`` of ``key`` with its weights in ``dtype``:
    a copy of the session's float64 model converted, and the family's adapter built on it."""
    m, image, question, cross = case_of(key)
    model = copy.deepcopy(m.model).to(dtype)
    config = {"config": m.adapter.config} if m.family == "coca" else {}  # open_clip's adapter reads its vlm_readout
    adapter = type(m.adapter)(model, m.processor, m.tokenizer, **config)
    loaded = LoadedModel(m.spec, m.family, model, m.processor, m.tokenizer, adapter)
    return loaded, image, question, cross


@functools.cache
def half_trace(key, dtype: torch.dtype):
    """``(model, inputs, trace)``: one default (sdpa) capture, every query position kept."""
    m, image, question, _ = half_model(key, dtype)
    inputs = m.adapter.prepare([image], [question])
    n = inputs.input_ids.shape[1]
    trace = capture(m, None, "", inputs=inputs, query_positions=range(n), keep_attn_out=True)
    assert trace.final_resid.dtype == dtype
    return m, inputs, trace


def _words(key, adapter) -> tuple[int, int]:
    answer, foil = WORDS.get(key[1], ("yes", "no"))
    return adapter.token_id(answer), adapter.token_id(foil)


@pytest.mark.parametrize("key,dtype", CAPTURED)
def test_recomputed_rows_equal_eager_attention(key, dtype):
    m, inputs, _ = half_trace(key, dtype)
    assert_recomputed_rows_are_eager(m, inputs)


@pytest.mark.parametrize("key,dtype", CAPTURED)
def test_heads_sum_to_attention_output(key, dtype):
    m, _, trace = half_trace(key, dtype)
    assert_heads_sum_to_attention_output(m.adapter, trace)


@pytest.mark.parametrize("key,dtype", [p for p in CAPTURED if p.values[0][1] not in POST_NORM | NO_DECOMPOSITION])
def test_reconstruction_and_lens_at_last_layer(key, dtype):
    m, _, trace = half_trace(key, dtype)
    assert_reconstruction_and_lens_at_last_layer(m.adapter, trace)


@pytest.mark.parametrize("key,dtype", CAPTURED)
def test_lens_last_row_is_the_model(key, dtype):
    m, _, trace = half_trace(key, dtype)
    a_id, f_id = _words(key, m.adapter)
    lens = logit_lens(m.adapter, trace, a_id, f_id)
    assert_lens_last_row_is_the_model(m.adapter, trace, lens, a_id, f_id)


DECOMPOSED = [p for p in CAPTURED if p.values[0][1] not in NO_DECOMPOSITION]


@pytest.mark.parametrize("key,dtype", DECOMPOSED)
def test_frozen_dla_sums_to_logit_difference_minus_bias(key, dtype):
    m, _, trace = half_trace(key, dtype)
    assert_decomposition_is_exact(m.adapter, trace, *_words(key, m.adapter))


@pytest.mark.parametrize("key,dtype", DECOMPOSED)
def test_jacobian_dla_equals_autograd_directional_derivative(key, dtype):
    m, _, trace = half_trace(key, dtype)
    assert_jacobian_dla_is_autograd(m.adapter, trace, *_words(key, m.adapter), which=(0, 3))


@pytest.mark.parametrize("key,dtype", CAPTURED)
def test_cached_steps_equal_a_rerun_of_the_prefix(key, dtype, no_end_tokens):  # noqa: F811 (the fixture)
    assert_cached_steps_equal_a_rerun(*half_model(key, dtype), no_end_tokens)


@pytest.mark.parametrize("key,dtype", _params(TEACHER_FORCED, ["llava", "coca", "qwen2_vl"]))
def test_every_answer_token_reads_the_plain_forward_of_its_prefix(key, dtype):
    m, image, question, _ = half_model(key, dtype)
    assert_every_answer_token_reads_the_plain_forward(m, image, question)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=DTYPE_IDS)
def test_a_few_units_of_roundoff_in_one_component_are_caught(dtype):
    """The negative control: the half-precision tolerances can fail.

    Heads sum: the bound is 3 u_half of the block's largest write term (the
    engine's and the model's rounding of the o_proj, a gate's) plus float32
    accumulation; one write off by 4 u_half of it, away from the
    model, is caught. Frozen DLA sum: the bound must allow the model's own
    2 n_blocks residual-add roundings and one rounding of each stored component
    (7 u_half of the components' terms ``sum_c |c| |F| |u|`` for 3 blocks: x_L is no more exact than
    that), so a shift below that cannot be told from the model's arithmetic;
    8 u_half in one component is caught."""
    key = ("own", "tiny-llava")
    m, _, trace = half_trace(key, dtype)
    a, u = m.adapter, unit_roundoff(dtype)
    assert trace.n_blocks == 3
    block = 1
    positions = torch.arange(trace.input_ids.shape[1])
    terms = float(head_write_terms(a, trace, block, positions).max())
    heads = trace.head_output(a, block, positions).float().sum(1) + a.b_O(block).float()
    away = 1.0 if float((trace.attn_out[block][0, -1, 0].float() - heads[-1, 0]).detach()) >= 0 else -1.0
    shifted = copy.copy(trace)
    shifted.attn_out = list(trace.attn_out)
    shifted.attn_out[block] = trace.attn_out[block].float()
    shifted.attn_out[block][0, -1, 0] += away * 4 * u * terms
    with pytest.raises(AssertionError):
        assert_heads_sum_to_attention_output(a, shifted)
    a_id, f_id = _words(key, a)
    r = decompose(a, trace, a_id, f_id)
    tol = frozen_sum_tol(a, trace, r.position, a_id, f_id)
    _, C = component_stack(a, trace, r.position)
    u_dir = target_direction(a, a_id, f_id).float()
    components = float(
        frozen_map_terms(a.final_norm_layer(), trace.final_resid[0, r.position], C, u_dir).sum().detach()
    )
    off = sum(c.dla_frozen for c in r.components) - r.frozen_sum_expected
    shift = (1.0 if off >= 0 else -1.0) * 8 * u * components
    assert abs(off + shift) > tol
