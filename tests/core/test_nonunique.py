"""Non-unique attention (docs/METHODS.md §4.10): alternative patterns at three
constraint levels, checked against what each level must be by construction
and against independent recomputation from the trace."""

import json
import math

import pytest
import torch
from PIL import Image

from core import load_model
from core.errors import InterventionError, ReadoutError
from core.forward.capture import capture
from core.forward.geometry import region_tokens
from core.methods.nonunique import HeadProblem, head_problem, nonunique_attention, solve, visual_token_keys, with_values
from core.zoo import scenes
from tests.core.exactness import norm_dtype, realized_scores_tol
from tests.core.test_capture_coca import tiny_coca_float64
from tests.core.test_capture_llava import tiny_llava_float64
from tests.tolerances import NORM_ROUNDINGS, abs_terms, gamma, rounding_tol, softmax_rtol, step_dtype, sum_tol

FAST = {"steps": 60}  # optimiser steps per penalty stage: enough for the properties checked here
# Thresholds given to the solver (tol=...) and the solver's own accuracy (an
# interior-point or penalty search stops short of exact: its patterns sum to 1,
# and its certificates hold, to SOLVER = 1e-9) are behaviour, not rounding; every
# other comparison below is bounded by the arithmetic.
SOLVER = 1e-9


@torch.no_grad()
def pattern_errors(m, tr, block: int, p) -> tuple[float, float]:
    """``(rtol, output)``: how far, relative to each weight, a softmax of scores
    recomputed from the trace (``p.scores``, a query through the real norm) may be
    from the model's pattern renormalised to sum 1 (its softmax dtype; the row's
    sum and the renormalisation), and what that moves ``relative_error`` by."""
    a = m.adapter
    softmax = step_dtype(a.family, tr.final_resid.dtype, "softmax")
    n = int(p.allowed.sum())
    scores = p.scores.masked_fill(~p.allowed, float("-inf"))
    rtol = softmax_rtol(scores, softmax, 2 * realized_scores_tol(a, tr, block)) + 2 * gamma(n + 4, softmax)
    return rtol, rtol * float((p.pattern.abs() @ p.values.abs()).norm() / p.output.norm())


@torch.no_grad()
def value_terms(m, tr, block: int, head: int) -> torch.Tensor:
    """``(keys, d_model)`` the sizes of the terms of each source's write ``(Norm(r) W_V + b_V) W_O``."""
    a = m.adapter
    src = tr.kv_source[block]
    r = tr.resid_pre[block][0] if src is None else src[0]
    v = abs_terms(a.kv_norm(block)(r), a.W_V(block)[head], a.b_V(block)[head])
    return v @ a.W_O(block)[head].abs().to(v.dtype)


@torch.no_grad()
def relative_error_tol(m, tr, block: int, head: int, A: torch.Tensor, P: torch.Tensor, Vw: torch.Tensor) -> float:
    """How far ``||(P - A) Vw|| / ||A Vw||`` (the model's pattern, values recomputed in
    float64 here) may be from the result's ``output_error`` (the pattern renormalised,
    values in the model's dtype, in write space): the renormalisation, the values'
    products in the model's dtype, and each side's norms."""
    a = m.adapter
    softmax = step_dtype(a.family, tr.final_resid.dtype, "softmax")
    n, d = A.shape[0], Vw.shape[1]
    terms = value_terms(m, tr, block, head).double()
    o = float((A @ Vw).norm())
    renorm = 2 * gamma(n + 4, softmax) * float((A.abs() @ Vw.abs()).norm())
    values = sum_tol(float(((P - A).abs() @ terms).norm()), a.W_V(block).shape[1] + a.d_head + 1, tr.final_resid.dtype)
    rel = float(((P - A) @ Vw).norm()) / o
    return (renorm + values) / o * (1 + rel) + rel * sum_tol(1.0, n + d, torch.float64)


def _models():
    return {"tiny-llava": tiny_llava_float64, "tiny-coca": tiny_coca_float64}


@pytest.fixture(scope="module", params=["tiny-llava", "tiny-coca", "shapes-llava", "shapes-coca"])
def case(request):
    make = _models().get(request.param)
    m = make() if make else load_model(request.param)
    s = scenes.make_sample("heldout", 5)
    inputs = m.adapter.prepare([Image.fromarray(s.image)], [s.question])
    ans = int(inputs.answer_positions[0])
    tr = capture(m, None, "", inputs=inputs, query_positions=[3, ans])
    exact = request.param.startswith("tiny")
    return request.param, m, tr, s, exact


def _a_block(m, tr):
    """A cross-attention block for CoCa (visual keys), a middle block otherwise."""
    kinds = tr.block_kinds
    return kinds.index("cross") if "cross" in kinds else 1


@torch.no_grad()
def _independent_values(m, tr, block, head):
    """``(keys, d_model)`` the head's write per source, recomputed here: Norm(r) W_V + b_V, then W_O."""
    a = m.adapter
    src = tr.kv_source[block]
    r = (tr.resid_pre[block][0] if src is None else src[0]).double()
    v = a.kv_norm(block)(r) @ a.W_V(block)[head].double() + a.b_V(block)[head].double()
    return v @ a.W_O(block)[head].double()


def test_real_pattern_is_feasible_with_zero_error_at_every_level(case):
    name, m, tr, _, exact = case
    a = m.adapter
    block = _a_block(m, tr)
    res = nonunique_attention(a, tr, block, 1, **FAST)
    p = head_problem(a, tr, block, 1)
    n = int(p.allowed.sum())
    rtol, start_tol = pattern_errors(m, tr, block, p)
    # A @ v against the model's z: A renormalised (its float32 softmax's row sums to 1
    # only to that precision), v's products in the model's dtype
    softmax = step_dtype(a.family, tr.final_resid.dtype, "softmax")
    A_model = tr.patterns[block][0, 1, 1, : p.values.shape[0]].double()
    src = tr.kv_source[block]
    r = tr.resid_pre[block][0] if src is None else src[0]
    with torch.no_grad():
        v = abs_terms(a.kv_norm(block)(r), a.W_V(block)[1], a.b_V(block)[1]).double()
        z = tr.z[block][0, int(tr.answer_positions[0]), 1].double()
    z_terms = A_model.abs() @ v  # (d_head,)
    recon = sum_tol(float(z_terms.norm()), v.shape[0] + a.W_V(block).shape[1] + 1, r.dtype)
    recon = (recon + 2 * gamma(n + 4, softmax) * float(z_terms.norm())) / float(z.norm())
    assert res.checks["output_reconstruction_error"] <= recon
    assert res.checks["scores_pattern_max_abs_error"] <= rtol  # weights are at most 1
    assert res.checks["masked_mass"] == 0
    names = [lv.level for lv in res.levels]
    assert names == ["a", "b", "b", "c-query", "c-residual"]
    for lv in res.levels:
        assert lv.ran, lv.reason
        assert lv.start_error <= start_tol, (lv.level, lv.start_error)  # A itself, delta = 0, the real query/residual
        assert lv.feasible and lv.output_error <= res.tol
        assert lv.moved_mass >= -SOLVER  # never worse than A itself, which every level contains
        assert abs(float(lv.pattern.sum()) - 1) <= SOLVER and float(lv.pattern.min()) >= 0
        assert lv.statement
    assert res.level("a").start_error == 0
    assert res.level("a").certified_min_source_mass <= res.level("a").source_mass + SOLVER
    # the found patterns are real alternatives: each is re-checked against values recomputed here
    Vw = _independent_values(m, tr, block, 1)
    A = tr.patterns[block][0, 1, 1, : Vw.shape[0]].double()
    o = A @ Vw
    for lv in res.levels:
        err = float((lv.pattern @ Vw - o).norm() / o.norm())
        assert err == pytest.approx(lv.output_error, abs=relative_error_tol(m, tr, block, 1, A, lv.pattern, Vw))
    # strict JSON and the audit row
    d = res.to_dict()
    json.dumps(d, allow_nan=False)
    assert d["audit"]["method"] == "non-unique attention"
    assert "pattern's reality" in d["audit"]["supports"]
    assert res.verdict and res.does_not_say


def test_level_b_respects_the_bound_and_is_a_softmax_of_bounded_scores(case):
    _, m, tr, _, _ = case
    block = _a_block(m, tr)
    p = head_problem(m.adapter, tr, block, 2)
    res = solve(p, score_bounds=(0.5, 2.0), levels=("b",), **FAST)
    for lv, B in zip(res.levels, (0.5, 2.0)):
        assert lv.parameters["score_bound"] == B
        assert float(lv.delta.abs().max()) <= B + rounding_tol(B, torch.float64)  # B tanh(theta), |tanh| <= 1
        assert float(lv.delta[~p.allowed].abs().sum()) == 0
        scores = (p.scores + lv.delta).masked_fill(~p.allowed, float("-inf"))
        expected = scores.softmax(-1)
        rtol = softmax_rtol(scores, torch.float64, rounding_tol(float(p.scores.abs().max()) + B, torch.float64))
        torch.testing.assert_close(lv.pattern, expected, atol=0, rtol=rtol)
        assert lv.output_error == p.relative_error(lv.pattern)  # the same function on the same pattern
        # the bound alone caps what can be removed, whatever the output
        assert lv.source_mass >= lv.certified_min_source_mass - 1e-12  # the certificate's own slack


def test_level_c_is_the_softmax_of_the_optimised_query_against_the_real_keys(case):
    name, m, tr, _, exact = case
    a = m.adapter
    block = _a_block(m, tr)
    pos = int(tr.answer_positions[0])
    head = 3
    res = nonunique_attention(a, tr, block, head, levels=("c-query", "c-residual"), **FAST)
    d_head = a.d_head
    with torch.no_grad():
        q_all, k_all = a.queries_keys(tr, block)  # recomputed from the trace here, not taken from the result
    K = k_all[:, head].double()
    allowed = a.allowed_keys(tr, block)[pos]
    Vw = _independent_values(m, tr, block, head)
    A = tr.patterns[block][0, head, 1, : Vw.shape[0]].double()
    for lv in res.levels:
        scores = ((K @ lv.query) * a.score_scale(block)).masked_fill(~allowed, float("-inf"))
        expected = scores.softmax(-1)
        # the same keys and query, float64: the d_head-term dot products' order, then the softmax
        error = sum_tol(float((K.abs() @ lv.query.abs()).max()) * abs(a.score_scale(block)), d_head, K.dtype)
        torch.testing.assert_close(lv.pattern, expected, atol=0, rtol=softmax_rtol(scores, torch.float64, error))
        err = float(((lv.pattern - A) @ Vw).norm() / (A @ Vw).norm())
        assert lv.output_error == pytest.approx(err, abs=relative_error_tol(m, tr, block, head, A, lv.pattern, Vw))
    cq, cr = res.level("c-query"), res.level("c-residual")
    assert cq.extra["query_reachable"] == (cq.extra["reach_ratio"] < 1)
    # the residual goes through the real norm, W_Q, b_Q and the position rotation
    r = cr.residual.to(tr.resid_pre[block].dtype)
    with torch.no_grad():
        normed = a.attn_norm(block)(r)
        q = normed @ a.W_Q(block)[head] + a.b_Q(block)[head]
        if a.position_scheme == "rope" and tr.kv_source[block] is None:
            q = a.rotate(q.view(1, 1, -1), torch.tensor([pos]))[0, 0]
        # the model's dtype here against float64 there: the residual's rounding to it, the
        # norm's roundings, a (d_model + 1)-term product, RoPE mixing rotate_half partners
        terms = abs_terms(normed, a.W_Q(block)[head], a.b_Q(block)[head])
        terms = float((terms + terms.roll(d_head // 2, -1)).max())
    dtype = tr.resid_pre[block].dtype
    tol = sum_tol(terms, a.d_model + 4, dtype) + rounding_tol(terms, norm_dtype(a, tr), NORM_ROUNDINGS + 1)
    torch.testing.assert_close(q.double(), cr.query, atol=tol, rtol=0)
    # the query through the real norm against the closed form: the norm's roundings
    # in its own dtype, and the pseudo-inverse's float64 error (relative: cond(M) u)
    with torch.no_grad():
        norm = a.attn_norm(block)
        M = (norm.weight_offset + norm.weight.double()).view(-1, 1) * a.W_Q(block)[head].double()
        if norm.kind == "layernorm":
            M = M - M.mean(0, keepdim=True)
        sv = torch.linalg.svdvals(M)
    construction = rounding_tol(1.0, norm_dtype(a, tr), NORM_ROUNDINGS + 2) + float(sv[0] / sv[-1]) * sum_tol(
        1.0, 4 * a.d_model, torch.float64
    )
    assert cr.extra["query_reachable"] and cr.extra["construction_error"] <= construction
    # Norm(r) has a fixed RMS: the built residual has the real residual's scale (float64 throughout)
    assert cr.extra["residual_rms_ratio"] == pytest.approx(1.0, abs=sum_tol(1.0, 4 * a.d_model, torch.float64))


def test_duplicated_values_let_mass_move_freely_with_zero_error(case):
    name, m, tr, _, _ = case
    if name.startswith("shapes"):
        pytest.skip("constructed case on the tiny models (float64)")
    block = 0  # self-attention at position 3: four keys, fewer than d_head, so the values are independent
    p = head_problem(m.adapter, tr, block, 0, position=3)
    keys = p.allowed.nonzero().flatten()
    assert len(keys) == 4 and p.values.shape[1] >= 4
    j = int(p.pattern.argmax())
    k = next(int(i) for i in keys if int(i) != j)
    tight = {"tol": 1e-12, "levels": ("a",)}
    alone = solve(p, **tight).level("a")
    assert alone.moved_mass < 1e-6  # nothing can move: the values are linearly independent
    V = p.values.clone()
    V[k] = V[j]
    dup = solve(with_values(p, V), **tight)
    lv = dup.level("a")
    assert dup.null_dimension == 1
    # all of j's mass moves to its twin (the interior-point solution keeps ~1e-9 on j), error within 1e-12
    assert lv.moved_mass == pytest.approx(float(p.pattern[j]), abs=1e-7)
    assert lv.feasible and lv.output_error <= 1e-12 and lv.certified_min_source_mass < 1e-7
    expected = p.pattern.clone()
    expected[k] += expected[j]
    expected[j] = 0
    assert dup.to_dict()["levels"][0]["feasible"]
    torch.testing.assert_close(lv.pattern, expected, atol=1e-7, rtol=0)  # the interior-point solver's accuracy
    # exactly zero error, up to the float64 rounding of (expected - A) @ V
    dup_p = with_values(p, V)
    rounding = sum_tol(float(((expected - p.pattern).abs() @ V.abs()).norm()), len(expected), torch.float64)
    assert dup_p.relative_error(expected) <= rounding / float(dup_p.output.norm())


def test_only_the_real_pattern_reproduces_independent_values(case):
    name, m, tr, _, _ = case
    if name.startswith("shapes"):
        pytest.skip("exact-uniqueness case on the tiny models (float64)")
    p = head_problem(m.adapter, tr, 0, 1, position=3)
    res = solve(p, tol=1e-6, levels=("a", "b", "c-query"), score_bounds=2.0, **FAST)
    assert res.null_dimension == 0
    a = res.level("a")
    assert a.moved_mass < 1e-3 and a.certified_min_source_mass > res.real_source_mass - 1e-3
    assert not a.alternative and "pins" in a.statement
    assert all(not lv.alternative for lv in res.levels)
    assert "No alternative" in res.verdict


def test_constructed_tensors_duplicates_and_orthonormal_values():
    g = torch.Generator().manual_seed(1)
    n, d = 6, 12
    keys, query = torch.randn(n, 8, generator=g), torch.randn(8, generator=g)
    V = torch.linalg.qr(torch.randn(d, n, generator=g, dtype=torch.float64)).Q.T * 3.0  # orthonormal rows x 3
    p = HeadProblem.from_tensors(V, keys, query)
    res = solve(p, tol=1e-4, levels=("a",))
    bound = 1e-4 * float(p.output.norm()) / 3.0 * math.sqrt(n)
    assert res.level("a").moved_mass <= bound
    V2 = V.clone()
    j = int(p.pattern.argmax())
    V2[(j + 1) % n] = V2[j]
    lv = solve(with_values(p, V2), tol=1e-12, levels=("a",)).level("a")
    assert lv.moved_mass == pytest.approx(float(p.pattern[j]), abs=1e-7) and lv.output_error <= 1e-12


def test_mask_and_padding_get_no_mass_at_any_level():
    m = tiny_llava_float64()
    s = scenes.make_sample("heldout", 2)
    image = Image.fromarray(s.image)
    inputs = m.adapter.prepare(
        [image, image], ["what color is the circle?", "is the red circle left of the blue square?"]
    )
    mask = inputs.tensors["attention_mask"][0]
    assert int((mask == 0).sum()) > 0  # row 0 is padded
    ans = int(inputs.answer_positions[0])
    mid = ans - 6
    tr = capture(m, None, "", inputs=inputs, query_positions=[mid, ans])
    for pos in (mid, ans):
        res = nonunique_attention(m.adapter, tr, 2, 0, position=pos, tol=0.2, **FAST)
        allowed = m.adapter.allowed_keys(tr, 2)[pos]
        assert not bool(allowed[mask == 0].any()) and not bool(allowed[pos + 1 :].any())
        for lv in res.levels:
            assert float(lv.pattern[~allowed].abs().max()) == 0, lv.level
            if lv.delta is not None:
                assert float(lv.delta[~allowed].abs().max()) == 0
    with pytest.raises(InterventionError, match="masked"):
        nonunique_attention(m.adapter, tr, 2, 0, position=mid, sources=[mid + 1])
    with pytest.raises(InterventionError, match="no pattern for query position"):
        nonunique_attention(m.adapter, tr, 2, 0, position=mid - 1)
    with pytest.raises(ReadoutError, match="out of range"):
        nonunique_attention(m.adapter, tr, 2, 9)


def test_region_sources_on_the_default_models_and_determinism(case):
    name, m, tr, s, _ = case
    if not name.startswith("shapes"):
        pytest.skip("visual regions on the default models")
    block = _a_block(m, tr)
    tokens = m.adapter.visual_tokens((128, 128), tr.visual_positions[0].tolist() or None)
    region = region_tokens(tokens, s.objects[s.target].mask if s.target is not None else s.objects[0].mask)
    keys = visual_token_keys(tr, block, region)
    if tr.block_kinds[block] == "self":
        roles = m.adapter.token_roles(tr)
        assert all(roles[k] == "visual" for k in keys)
    else:
        assert keys == region
    head = int(tr.patterns[block][0, :, 1, keys].sum(-1).argmax())  # the head with the most mass on the object
    calls = []
    res = nonunique_attention(m.adapter, tr, block, head, sources=keys, progress=lambda i, n, msg: calls.append(i))
    assert calls == [1, 2, 3, 4, 5] and res.sources == sorted(keys)
    # renormalised (the softmax's row sum, in its dtype) and summed in float64, against a sum
    # in the pattern's dtype
    mass = float(tr.patterns[block][0, head, 1, keys].sum())
    n = tr.patterns[block].shape[-1]
    softmax = step_dtype(m.adapter.family, tr.final_resid.dtype, "softmax")
    tol = sum_tol(mass, n + 4, softmax) + sum_tol(mass, len(keys), tr.patterns[block].dtype)
    assert res.real_source_mass == pytest.approx(mass, abs=tol)
    again = nonunique_attention(m.adapter, tr, block, head, sources=keys)
    for x, y in zip(res.levels, again.levels):
        assert torch.equal(x.pattern, y.pattern)  # seeded, deterministic
    a = res.level("a")
    assert a.certified_min_source_mass <= a.source_mass + SOLVER
    print(name, {lv.level + str(lv.parameters.get("score_bound", "")): round(lv.moved_mass, 3) for lv in res.levels})
    cut = nonunique_attention(m.adapter, tr, block, head, sources=keys, cancel=lambda: True)
    assert cut.cancelled and cut.levels == []


def test_total_variation_objective_is_at_least_the_mass_objective(case):
    name, m, tr, _, _ = case
    if name.startswith("shapes"):
        pytest.skip("objective bookkeeping on the tiny models")
    p = head_problem(m.adapter, tr, _a_block(m, tr), 0)
    kw = {"levels": ("a", "b"), "score_bounds": 1.0, "tol": 0.02, **FAST}
    by_mass, by_tv = solve(p, **kw), solve(p, objective="tv", **kw)
    assert by_tv.objective == "tv"
    for x, y in zip(by_mass.levels, by_tv.levels):
        # the source set is one of the candidate sets, searched from the same seeded starts
        assert y.total_variation >= x.total_variation - 1e-12 and y.feasible  # the searches' own slack
        assert y.extra["target_set"]
    with pytest.raises(InterventionError, match="objective"):
        solve(p, objective="kl")
