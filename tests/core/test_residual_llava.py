"""Residual decomposition and DLA on LLaVA against independent computations."""

import pytest

from core.capture import capture
from core.methods.residual import decompose
from core.zoo import scenes
from tests.core.exactness import assert_jacobian_dla_is_autograd
from tests.core.test_capture_llava import tiny_llava_float64


@pytest.fixture(scope="module", params=["tiny-float64", "shapes-llava"])
def case(request):
    from core import load_model

    m = tiny_llava_float64() if request.param == "tiny-float64" else load_model("shapes-llava")
    s = scenes.make_sample("heldout", 9)
    tr = capture(m, s.image, s.question)
    tol = 1e-9 if request.param == "tiny-float64" else 2e-4
    return m, tr, tol, m.adapter.token_id(s.answer), m.adapter.token_id(s.foil)


def test_frozen_dla_sums_to_logit_difference_minus_bias(case):
    m, tr, tol, a_id, f_id = case
    r = decompose(m.adapter, tr, a_id, f_id)
    p = r.position
    model_diff = float(tr.logits[0, p, a_id] - tr.logits[0, p, f_id])
    assert r.target_logit == pytest.approx(model_diff, abs=tol)
    assert sum(c.dla_frozen for c in r.components) == pytest.approx(r.frozen_sum_expected, abs=tol)
    assert r.reconstruction_max_abs_err < tol
    assert r.components[0].name == "embed" and r.components[-1].name == f"L{m.adapter.n_layers - 1}.mlp"


def test_jacobian_dla_equals_autograd_directional_derivative(case):
    m, tr, tol, a_id, f_id = case
    r, _ = assert_jacobian_dla_is_autograd(m.adapter, tr, a_id, f_id, tol, 1e-5)
    assert r.audit.method == "residual DLA" and "does not sum" in " ".join(r.audit.notes)


def test_logit_lens_last_row_is_the_model_and_kl_is_zero_there(case):
    from core.methods.logit_lens import logit_lens

    m, tr, tol, a_id, f_id = case
    lens = logit_lens(m.adapter, tr, a_id, f_id)
    assert [r.layer for r in lens.rows] == list(range(m.adapter.n_layers + 1))
    last = lens.rows[-1]
    p = lens.position
    assert last.answer_logit == pytest.approx(float(tr.logits[0, p, a_id]), abs=max(tol, 1e-5))
    assert last.kl_to_final == pytest.approx(0.0, abs=1e-6)
    assert last.answer_rank == int((tr.logits[0, p] > tr.logits[0, p, a_id]).sum())
    assert all(r.kl_to_final >= -1e-6 for r in lens.rows)


def test_source_contributions_sum_to_each_heads_direct_terms(case):
    """Summed over sources, each head's contributions equal its residual
    component under every convention (the value path is exact)."""
    from core.methods.contributions import source_contributions

    m, tr, tol, a_id, f_id = case
    a = m.adapter
    sc = source_contributions(a, tr, a_id, f_id)
    r = decompose(a, tr, a_id, f_id)
    by_name = {c.name: c for c in r.components}
    for layer in range(a.n_layers):
        for h in range(a.n_heads):
            comp = by_name[f"L{layer}.H{h}"]
            for field in ("projection", "dla_frozen", "dla_jacobian"):
                got = float(getattr(sc, field)[layer][h].sum())
                assert got == pytest.approx(getattr(comp, field), abs=max(tol, 1e-5)), (layer, h, field)
    # norms: one source's contribution recomputed directly
    j = int(tr.visual_positions[0, 10])
    x = a.attn_norm(1)(tr.resid_pre[1][0, j])
    v = x @ a.W_V(1)[2] + a.b_V(1)[2]
    qi = int((tr.query_positions == sc.position).nonzero()[0])
    c = tr.patterns[1][0, 2, qi, j] * (v @ a.W_O(1)[2])
    assert float(sc.norm[1][2, j]) == pytest.approx(float(c.norm()), rel=1e-5, abs=1e-9)
