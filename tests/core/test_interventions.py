"""Interventions (core/methods/interventions.py, core/forward/edits.py): each site,
ablation, activation patch and knockout is checked against what it must do by
construction, on tiny float64 models; the colour-flip bar on a small sample
of shapes-coca (bench/patching_bars.py measures it on 200+ questions)."""

import numpy as np
import pytest
import torch

from core import load_model
from core.errors import InterventionError
from core.forward.capture import capture
from core.forward.edits import Edit
from core.forward.geometry import region_tokens
from core.methods import interventions as iv
from core.zoo import scenes
from tests.core.test_capture_coca import tiny_coca_float64
from tests.core.test_capture_llava import tiny_llava_float64
from tests.tolerances import softmax_rtol, step_dtype, sum_tol


def colour_pair(index: int = 0):
    """A color_of_shape sample and the same scene with only the target's colour changed."""
    i = index
    while True:
        s = scenes.make_sample("heldout", i, kind="attribute")
        if s.template == "color_of_shape":
            break
        i += 1
    new = [c for c in scenes.COLORS if c != s.answer][i % 4]
    return s, scenes.counterfactual_sample(s, color=new)


@pytest.fixture(scope="module")
def llava():
    return tiny_llava_float64()


@pytest.fixture(scope="module")
def coca():
    return tiny_coca_float64()


@pytest.fixture(scope="module")
def pair():
    return colour_pair(0)


def prepared(m, s):
    return m.adapter.prepare([s.image], [s.question])


def same_logits(a, b):
    """Equal logits up to the answer position, exactly: every check below patches a
    run with values another run computed, so the same values go through the same ops."""
    last = int(a.answer_positions[0])
    torch.testing.assert_close(a.logits[0, : last + 1], b.logits[0, : last + 1], atol=0, rtol=0)


LLAVA_SITES = [("vision_out", None), ("projector_out", None), ("resid", 0), ("resid", 2)]
COCA_SITES = [("kv_source", None), ("kv_source", 2), ("resid", 3)]


def test_counterfactual_scene_changes_only_the_object(pair):
    s, cf = pair
    target = s.objects[s.target]
    changed = np.any(cf.image != s.image, axis=-1)
    assert changed.any() and not (changed & ~target.mask).any()
    assert cf.answer != s.answer and cf.foil == s.answer and cf.question == s.question
    assert np.array_equal(cf.objects[s.target].mask, target.mask)
    assert [o.name for i, o in enumerate(cf.objects) if i != s.target] == [
        o.name for i, o in enumerate(s.objects) if i != s.target
    ]
    with pytest.raises(ValueError, match="changes nothing"):
        scenes.counterfactual_sample(s, color=s.answer)
    # a shape change: a circle fits inside a square's or a triangle's circumcircle
    i = 0
    while True:
        t = scenes.make_sample("heldout", i, kind="attribute")
        if t.template == "shape_of_color" and t.answer != "circle":
            break
        i += 1
    circle = scenes.counterfactual_sample(t, shape="circle")
    assert circle.answer == "circle" and circle.foil == t.answer
    changed = np.any(circle.image != t.image, axis=-1)
    assert not (changed & ~(t.objects[t.target].mask | circle.objects[t.target].mask)).any()


@pytest.mark.parametrize("family", ["llava", "coca"])
def test_patching_a_run_with_its_own_features_changes_nothing(family, llava, coca, pair):
    m, sites = (llava, LLAVA_SITES) if family == "llava" else (coca, COCA_SITES)
    inputs = prepared(m, pair[0])
    for site, layer in sites:
        if site == "resid" and family == "coca":
            continue  # no visual positions in CoCa's sequence
        base, feats = iv.visual_site_features(m, inputs, site, layer)
        edit = iv.visual_patch_edit(site, range(feats.shape[0]), feats, base, layer)
        edited = capture(m, None, "", inputs=inputs, edits=[edit])
        assert edited.edits == [edit]
        same_logits(edited, base)


@pytest.mark.parametrize(
    "family,site,layer",
    [
        ("llava", "vision_out", None),
        ("llava", "projector_out", None),
        ("llava", "resid", 0),
        ("coca", "kv_source", None),
    ],
)
def test_patching_every_visual_token_from_b_reproduces_b(family, site, layer, llava, coca, pair):
    m = llava if family == "llava" else coca
    a_in, b_in = prepared(m, pair[0]), prepared(m, pair[1])
    a, _ = iv.visual_site_features(m, a_in, site, layer)
    b, b_feats = iv.visual_site_features(m, b_in, site, layer)
    assert (a.logits - b.logits).abs().max() > 1e-6  # the images differ for the model
    edit = iv.visual_patch_edit(site, range(b_feats.shape[0]), b_feats, a, layer)
    same_logits(capture(m, None, "", inputs=a_in, edits=[edit]), b)


def test_patch_and_reverse_symmetry(llava, pair):
    """Every token: forward-patched A is B and reverse-patched B is A, so the two
    effects are opposite; a token subset patched at projector_out equals the same
    subset at the residual entering block 0 (the projector writes those rows)."""
    m = llava
    s, cf = pair
    a = m.adapter
    ans, foil = a.token_id(s.answer), a.token_id(cf.answer)
    full = iv.patch_visual_features(m, s.image, s.question, cf.image, site="projector_out", answer=ans, foil=foil)
    row = full.rows[0]
    # every token patched: the same values through the same ops as the other run, and
    # a - b == -(b - a) in floating point
    for key in ("logit", "logit_diff", "prob"):
        assert getattr(row.forward.edited, key) == getattr(full.source, key)
        assert getattr(row.reverse.edited, key) == getattr(full.original, key)
    for key in ("logit_change", "logit_diff_change", "prob_change"):
        assert getattr(row.forward.effect, key) == -getattr(row.reverse.effect, key)
    assert row.forward_matches_source and row.reverse_matches_original
    tokens = region_tokens(a.visual_tokens((128, 128)), s.objects[s.target].mask, 1e-6)
    at_proj = iv.patch_visual_features(m, s.image, s.question, cf.image, site="projector_out", token_sets=[tokens])
    at_resid = iv.patch_visual_features(m, s.image, s.question, cf.image, site="resid", layer=0, token_sets=[tokens])
    for d in ("forward", "reverse"):  # the projector writes those rows: the same values either way
        p, r = getattr(at_proj.rows[0], d).edited, getattr(at_resid.rows[0], d).edited
        assert p.logit == r.logit and p.prob == r.prob
    assert at_proj.audit.method == "visual-feature patching" and at_proj.to_dict()["rows"][0]["tokens"] == tokens


@pytest.mark.parametrize("family", ["llava", "coca"])
def test_ablations(family, llava, coca, pair):
    """Zero equals Edit zero; mean writes the reference mean (by position and by
    role); resample writes the other input's z."""
    m = llava if family == "llava" else coca
    ad = m.adapter
    block, head = (1, 2) if family == "llava" else (3, 1)
    inputs = prepared(m, pair[0])
    base = capture(m, None, "", inputs=inputs)
    pos = int(base.answer_positions[0])
    zero = capture(m, None, "", inputs=inputs, edits=[iv.zero_ablation(block, head, pos)])
    direct = capture(m, None, "", inputs=inputs, edits=[Edit(block, head, (pos,))])
    same_logits(zero, direct)
    assert torch.all(zero.z[block][0, pos, head] == 0)

    refs = [
        capture(m, scenes.make_sample("heldout", 50 + i).image, scenes.make_sample("heldout", 50 + i).question)
        for i in range(3)
    ]
    by_pos = iv.reference_mean(ad, refs, block, head, by="position")
    edit = iv.mean_ablation(ad, base, by_pos, positions=[1, 2])
    edited = capture(m, None, "", inputs=inputs, edits=[edit])
    stacked = torch.stack([r.z[block][0, [1, 2], head] for r in refs])
    expected = stacked.mean(0)
    # a mean over the references, summed in another order
    tol = sum_tol(stacked.abs().mean(0).max(), len(refs) + 1, expected.dtype)
    torch.testing.assert_close(edited.z[block][0, [1, 2], head], expected, atol=tol, rtol=0)
    by_role = iv.reference_mean(ad, refs, block, head, by="role")
    edit = iv.mean_ablation(ad, base, by_role, positions=[pos])
    edited = capture(m, None, "", inputs=inputs, edits=[edit])
    stacked = torch.stack([r.z[block][0, int(r.answer_positions[0]), head] for r in refs])
    expected = stacked.mean(0)
    tol = sum_tol(stacked.abs().mean(0).max(), len(refs) + 1, expected.dtype)
    torch.testing.assert_close(edited.z[block][0, pos, head], expected, atol=tol, rtol=0)
    assert by_role.role_count["answer"] == 3

    src = refs[0]
    edit = iv.resample_ablation(src, block, head, positions=[pos], source_positions=[int(src.answer_positions[0])])
    edited = capture(m, None, "", inputs=inputs, edits=[edit])
    torch.testing.assert_close(  # written as given
        edited.z[block][0, pos, head], src.z[block][0, int(src.answer_positions[0]), head], atol=0, rtol=0
    )

    result = iv.run_interventions(
        m,
        inputs,
        {"zero": [iv.zero_ablation(block, head, pos)]},
        ad.token_id(pair[0].answer),
        method="ablation",
        base=base,
    )
    assert result.rows[0].edited.logit == float(direct.logits[0, pos, ad.token_id(pair[0].answer)])  # the same run
    assert result.audit.method == "ablation" and result.to_dict()["rows"][0]["edits"][0]["site"] == "z"
    with pytest.raises(InterventionError, match="role"):
        iv.mean_ablation(ad, base, iv.reference_mean(ad, refs[:1], block, head, by="position"), positions=[200])


@pytest.mark.parametrize("family", ["llava", "coca"])
def test_activation_patching_of_residual_head_and_mlp(family, llava, coca, pair):
    """Patching from B (same question, other image) into A writes B's values at
    the position; for LLaVA, patching the whole residual entering a block
    reproduces B's logits (the image only enters through the positions)."""
    m = llava if family == "llava" else coca
    a_in, b_in = prepared(m, pair[0]), prepared(m, pair[1])
    a, b = capture(m, None, "", inputs=a_in), capture(m, None, "", inputs=b_in)
    pos = int(a.answer_positions[0])
    block = 2 if family == "llava" else 3
    edited = capture(m, None, "", inputs=a_in, edits=[iv.activation_patch(b, "resid", block, positions=[pos])])
    torch.testing.assert_close(edited.resid_pre[block][0, pos], b.resid_pre[block][0, pos], atol=0, rtol=0)
    edited = capture(m, None, "", inputs=a_in, edits=[iv.activation_patch(b, "z", block, 1, positions=[pos])])
    torch.testing.assert_close(edited.z[block][0, pos, 1], b.z[block][0, pos, 1], atol=0, rtol=0)
    torch.testing.assert_close(edited.z[block][0, pos, 0], a.z[block][0, pos, 0], atol=0, rtol=0)  # head 0 untouched
    edited = capture(m, None, "", inputs=a_in, edits=[iv.activation_patch(b, "mlp", block, positions=[pos])])
    torch.testing.assert_close(edited.mlp_out[block][0, pos], b.mlp_out[block][0, pos], atol=0, rtol=0)
    if family == "llava":
        whole = capture(m, None, "", inputs=a_in, edits=[iv.activation_patch(b, "resid", 1, target=a)])
        same_logits(whole, b)
    with pytest.raises(InterventionError, match="past the source"):
        iv.activation_patch(b, "mlp", block, positions=[0], source_positions=[10_000])


def recomputed_pattern(trace, block, qi):
    """softmax of the captured q k^T * scale over the keys the model may read:
    ``(heads, keys)`` for kept query index ``qi``."""
    pos = int(trace.query_positions[qi])
    q = trace.q[block][0, pos]  # (heads, d_head)
    k = trace.k[block][0]  # (keys, kv_heads, d_head)
    k = k.repeat_interleave(q.shape[0] // k.shape[1], dim=1)
    return torch.einsum("hd,khd->hk", q, k) * trace.score_scale[block]


@pytest.mark.parametrize("family", ["llava", "coca-cross", "coca-self"])
def test_knockout_zeroes_the_edges_and_renormalises_the_rest(family, llava, coca, pair):
    m = llava if family == "llava" else coca
    ad = m.adapter
    inputs = prepared(m, pair[0])
    block = {"llava": 1, "coca-cross": 2, "coca-self": 3}[family]
    base = capture(m, None, "", inputs=inputs, keep_qk=[block])
    pos = int(base.answer_positions[0])
    tokens = region_tokens(ad.visual_tokens((128, 128)), pair[0].objects[pair[0].target].mask, 1e-6)
    keys = iv.visual_keys(base, block, tokens) if family != "coca-self" else (0, 2)
    head = 1
    edited = capture(m, None, "", inputs=inputs, keep_qk=[block], edits=[iv.knockout(block, keys, [pos], head)])
    pattern = edited.patterns[block][0, :, 0]  # (heads, keys)
    assert torch.all(pattern[head, list(keys)] == 0)
    allowed = ad.allowed_keys(edited, block)[pos].clone()
    allowed[list(keys)] = False
    scores = recomputed_pattern(edited, block, 0)[head].masked_fill(~allowed, float("-inf"))
    expected = scores.softmax(-1)
    # the model's own q and k: the scores differ only by the d_head-term dot product's order;
    # then the softmax's dtype (LLaVA's eager softmax runs in float32, CoCa's in float64)
    q = edited.q[block][0, pos, head]
    k = edited.k[block][0][:, head // (ad.n_heads // edited.k[block].shape[2])]
    error = sum_tol((k.abs() @ q.abs()).max() * edited.score_scale[block], ad.d_head, q.dtype)
    softmax = step_dtype(ad.family, q.dtype, "softmax")
    torch.testing.assert_close(pattern[head], expected, atol=0, rtol=softmax_rtol(scores, softmax, error))
    assert float(pattern[head].sum()) == pytest.approx(1.0, abs=sum_tol(1.0, scores.shape[-1] + 4, softmax))
    others = [h for h in range(ad.n_heads) if h != head]
    torch.testing.assert_close(pattern[others], base.patterns[block][0, others, 0], atol=0, rtol=0)
    assert edited.edits[0].site == "knockout" and "knocked out" in edited.edits[0].describe()
    edits = iv.region_knockout(base, [block], tokens) if family != "coca-self" else [iv.knockout(block, keys, [pos])]
    assert edits[0].keys == tuple(keys) and edits[0].positions == (pos,) and edits[0].head is None
    every_head = capture(m, None, "", inputs=inputs, edits=edits)
    assert torch.all(every_head.patterns[block][0, :, 0][:, list(keys)] == 0)


def test_knockout_of_every_key_is_refused(llava, coca, pair):
    for m, block in ((llava, 0), (coca, 2)):
        inputs = prepared(m, pair[0])
        base = capture(m, None, "", inputs=inputs)
        n_keys = base.patterns[block].shape[-1]
        pos = int(base.answer_positions[0])
        with pytest.raises(InterventionError, match="no key left"):
            capture(m, None, "", inputs=inputs, edits=[iv.knockout(block, range(n_keys), [pos])])


def test_sites_a_family_lacks_and_malformed_edits_are_refused(llava, coca, pair):
    with pytest.raises(InterventionError, match="kv_source"):
        capture(llava, None, "", inputs=prepared(llava, pair[0]), edits=[Edit(None, site="kv_source")])
    with pytest.raises(InterventionError, match="vision_out"):
        capture(coca, None, "", inputs=prepared(coca, pair[0]), edits=[Edit(None, site="vision_out")])
    with pytest.raises(InterventionError, match="not a cross"):
        capture(coca, None, "", inputs=prepared(coca, pair[0]), edits=[Edit(1, site="kv_source")])
    with pytest.raises(InterventionError, match="rows"):
        Edit(0, 1, (1, 2), torch.zeros(1, 16))
    with pytest.raises(InterventionError, match="unknown edit site"):
        Edit(0, site="attn")
    with pytest.raises(InterventionError, match="key positions"):
        Edit(0, site="knockout")
    with pytest.raises(InterventionError, match="out of range"):
        capture(llava, None, "", inputs=prepared(llava, pair[0]), edits=[Edit(None, None, (64,), site="vision_out")])
    assert Edit(1).site == "mlp" and Edit(1, 2).site == "z"  # the original constructor keeps its meaning


def test_colour_flip_bar_small_sample_on_shapes_coca():
    """Patching the target object's tokens at kv_source from a scene where only
    its colour differs flips the answer to the new colour (30 questions; the
    bench measures 200+ with the >= 90% bar)."""
    m = load_model("shapes-coca")
    ad = m.adapter
    flips, n, i = 0, 0, 0
    while n < 30:
        s, cf = colour_pair(1000 + i)
        i = s.index - 1000 + 1
        tokens = region_tokens(ad.visual_tokens((128, 128)), s.objects[s.target].mask, 1e-6)
        r = iv.patch_visual_features(
            m,
            s.image,
            s.question,
            cf.image,
            site="kv_source",
            token_sets={"target": tokens},
            answer=s.answer,
            foil=cf.answer,
            reverse=False,
        )
        flips += r.rows[0].forward.edited.predicted == cf.answer
        n += 1
    assert flips / n >= 0.8, f"{flips}/{n}"
