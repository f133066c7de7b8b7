"""Residual decomposition and DLA on LLaVA against independent computations."""

import pytest
import torch

from core.forward.capture import capture
from core.methods.residual import decompose
from core.zoo import scenes
from tests.core.exactness import (
    assert_decomposition_is_exact,
    assert_jacobian_dla_is_autograd,
    assert_lens_last_row_is_the_model,
    assert_source_contributions_sum_to_each_heads_terms,
)
from tests.core.test_capture_llava import tiny_llava_float64
from tests.tolerances import abs_terms, rounding_tol, sum_tol


@pytest.fixture(scope="module", params=["tiny-float64", "shapes-llava"])
def case(request):
    from core import load_model

    m = tiny_llava_float64() if request.param == "tiny-float64" else load_model("shapes-llava")
    s = scenes.make_sample("heldout", 9)
    tr = capture(m, s.image, s.question)
    return m, tr, m.adapter.token_id(s.answer), m.adapter.token_id(s.foil)


def test_frozen_dla_sums_to_logit_difference_minus_bias(case):
    """Exact up to the float32 rounding of the model's RMSNorm (its statistics in
    float32 even in the float64 model), relative to the logit's terms."""
    m, tr, a_id, f_id = case
    r = assert_decomposition_is_exact(m.adapter, tr, a_id, f_id)
    assert r.components[0].name == "embed" and r.components[-1].name == f"L{m.adapter.n_layers - 1}.mlp"


def test_jacobian_dla_equals_autograd_directional_derivative(case):
    m, tr, a_id, f_id = case
    r, _ = assert_jacobian_dla_is_autograd(m.adapter, tr, a_id, f_id)
    assert r.audit.method == "residual DLA" and "does not sum" in " ".join(r.audit.notes)


def test_logit_lens_last_row_is_the_model_and_kl_is_zero_there(case):
    from core.methods.logit_lens import logit_lens

    m, tr, a_id, f_id = case
    lens = logit_lens(m.adapter, tr, a_id, f_id)
    assert [r.layer for r in lens.rows] == list(range(m.adapter.n_layers + 1))
    assert_lens_last_row_is_the_model(m.adapter, tr, lens, a_id, f_id)
    last = lens.rows[-1]
    p = lens.position
    assert last.answer_rank == int((tr.logits[0, p] > tr.logits[0, p, a_id]).sum())
    # KL >= 0 up to its float32 sum over the vocabulary (terms p |log p - log q| <= 2 |logits|_max)
    kl_floor = -rounding_tol(2 * float(tr.logits[0, p].abs().max()), torch.float32, tr.logits.shape[-1])
    assert all(r.kl_to_final >= kl_floor for r in lens.rows)


def test_source_contributions_sum_to_each_heads_direct_terms(case):
    """Summed over sources, each head's contributions equal its residual
    component under every convention (the value path is exact)."""
    from core.methods.contributions import source_contributions

    m, tr, a_id, f_id = case
    a = m.adapter
    sc = source_contributions(a, tr, a_id, f_id)
    assert_source_contributions_sum_to_each_heads_terms(a, tr, sc, decompose(a, tr, a_id, f_id))
    # norms: one source's contribution recomputed directly
    j = int(tr.visual_positions[0, 10])
    x = a.attn_norm(1)(tr.resid_pre[1][0, j])
    v = x @ a.W_V(1)[2] + a.b_V(1)[2]
    qi = int((tr.query_positions == sc.position).nonzero()[0])
    weight = tr.patterns[1][0, 2, qi, j]
    c = weight * (v @ a.W_O(1)[2])
    # sc.norm is A sqrt(v^T (W_O W_O^T) v): the squared norm's terms are those of
    # |v| |W_O| squared, and sqrt halves a relative error
    terms = weight.abs() * (abs_terms(x, a.W_V(1)[2], a.b_V(1)[2]) @ a.W_O(1)[2].abs())  # (d_model,)
    n = a.d_model + 2 * a.d_head + 4
    size, value = float(terms.detach().norm()), float(c.detach().norm())
    tol = sum_tol(size**2 / value, n, c.dtype) + sum_tol(size, n, c.dtype)
    assert float(sc.norm[1][2, j]) == pytest.approx(value, abs=tol)
