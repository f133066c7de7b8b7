"""Pattern estimators (docs/METHODS.md §4.2) against brute-force recomputation."""

import numpy as np
import pytest
import torch
from PIL import Image

from core import load_model
from core.forward.capture import capture
from core.forward.geometry import region_tokens
from core.methods.patterns import (
    ROLES,
    Distribution,
    paired_difference,
    pattern_statistics,
    relative_position_profile,
    role_mass,
)
from core.zoo import scenes
from tests.tolerances import rounding_tol, sum_tol


@pytest.fixture(scope="module")
def llava():
    return load_model("shapes-llava")


def test_role_masses_partition_each_heads_attention(llava):
    s = scenes.make_sample("heldout", 11)
    tr = capture(llava, s.image, s.question)
    roles = llava.adapter.token_roles(tr)
    assert roles[0] == "sink" and roles.count("visual") == 64
    rm = role_mass(llava.adapter, tr)
    n = tr.patterns[0].shape[-1]
    # float32 weights (non-negative, summing to 1): the softmax's n-key sum, then the
    # roles' sums and their total; the visual mass summed in another order
    one = sum_tol(1.0, 2 * n + len(ROLES) + 4, torch.float32)
    for block, by_role in rm.items():
        total = sum(by_role[r] for r in ROLES)
        torch.testing.assert_close(total, torch.ones_like(total), atol=one, rtol=0)
        vis = tr.patterns[block][0, :, 0, tr.visual_positions[0]].sum(-1)
        torch.testing.assert_close(by_role["visual"], vis, atol=sum_tol(1.0, n, torch.float32), rtol=0)


def test_padding_is_labelled_and_gets_no_mass(llava):
    from core.forward.capture import capture as cap

    short, long = "what color is the circle?", "is the red circle left of the blue square?"
    image = Image.fromarray(scenes.make_sample("heldout", 2).image)
    inputs = llava.adapter.prepare([image, image], [short, long])
    tr = cap(llava, None, "", inputs=inputs, query_positions=[int(inputs.answer_positions[0])])
    roles = llava.adapter.token_roles(tr, batch=0)
    n_pad = int((inputs.tensors["attention_mask"][0] == 0).sum())
    assert n_pad > 0 and roles[-n_pad:] == ["padding"] * n_pad
    rm = role_mass(llava.adapter, tr, batch=0)
    n = tr.patterns[0].shape[-1]
    one = sum_tol(1.0, 2 * n + len(ROLES) + 4, torch.float32)  # the real keys carry all the mass
    assert all(float(sum(v[r] for r in ROLES).min()) >= 1 - one for v in rm.values())


def test_relative_position_profile_matches_brute_force(llava):
    s = scenes.make_sample("heldout", 12)
    n = llava.adapter.prepare([Image.fromarray(s.image)], [s.question]).input_ids.shape[1]
    tr = capture(llava, s.image, s.question, query_positions=range(n))
    res = relative_position_profile(tr, 2, max_offset=10)
    prof = res.profile
    assert res.counts[0] == n and res.audit.method == "pattern analysis"
    A = tr.patterns[2][0]  # (heads, n, n)
    for d in (0, 1, 7):
        expected = torch.stack([A[:, p, p - d] for p in range(d, n)], -1).mean(-1)
        # a mean of non-negative float32 weights in another order: relative to the mean itself
        tol = sum_tol(float(expected.max()), n + 1, torch.float32)
        torch.testing.assert_close(prof[:, d], expected.float(), atol=tol, rtol=0)


def test_paired_difference_zero_for_same_input_and_refuses_other_layouts(llava):
    s = scenes.make_sample("heldout", 13)
    a = capture(llava, s.image, s.question)
    b = capture(llava, s.image, s.question)
    assert all(float(d.abs().max()) == 0 for d in paired_difference(a, b).differences.values())
    edited = s.image.copy()
    edited[s.objects[0].mask] = 128
    c = capture(llava, edited, s.question)
    assert max(float(d.abs().max()) for d in paired_difference(a, c).differences.values()) > 1e-4
    other = capture(llava, s.image, "is the red circle left of the blue square?")
    with pytest.raises(ValueError, match="same token layout"):
        paired_difference(a, other)


def test_distribution_quantiles_and_histogram():
    rng = np.random.default_rng(0)
    v = rng.normal(size=501)
    d = Distribution.of(v, bins=7)
    assert d.n == 501 and sum(d.counts) == 501 and len(d.edges) == 8
    # linear interpolation between two order statistics (a difference, a product, a
    # sum and the fractional index's rounding), float64 on both sides
    for q, x in d.quantiles.items():
        assert x == pytest.approx(np.quantile(v, float(q)), abs=rounding_tol(float(np.abs(v).max()), torch.float64, 8))
    assert d.mean == pytest.approx(v.mean(), abs=sum_tol(float(np.abs(v).mean()), len(v) + 1, torch.float64))


def test_region_tokens_follow_the_mask():
    from core.forward.geometry import VisualToken

    tokens = [VisualToken(i, i, 0, 0, i, [i * 10.0, 0.0, i * 10.0 + 10, 10.0]) for i in range(4)]
    mask = np.zeros((10, 40), bool)
    mask[:, 12:25] = True  # covers token 1 by 8/10, token 2 by 5/10
    assert region_tokens(tokens, mask, 0.25) == [1, 2]
    assert region_tokens(tokens, mask, 0.6) == [1]


def test_pattern_statistics_over_samples_match_per_sample_computation(llava):
    samples = [scenes.make_sample("heldout", i) for i in range(20, 26)]
    items = [(s.image, s.question, s.objects[s.target].mask if s.target is not None else None) for s in samples]
    calls = []
    stats = pattern_statistics(llava, items, progress=lambda i, n, m: calls.append(i))
    assert stats.n_samples == 6 and calls == list(range(1, 7))
    assert len(stats.heads) == llava.adapter.n_layers * llava.adapter.n_heads
    # recompute one head by hand
    block, head = 3, 1
    hits, region_mass = [], []
    for s, (_, q, mask) in zip(samples, items):
        if mask is None:
            continue
        tr = capture(llava, s.image, q)
        toks = llava.adapter.visual_tokens((128, 128), tr.visual_positions[0].tolist())
        reg = region_tokens(toks, mask)
        vis = tr.patterns[block][0, head, 0, tr.visual_positions[0]]
        region_mass.append(float(vis[reg].sum()))
        hits.append(int(int(vis.argmax()) in reg))
    h = next(x for x in stats.heads if x.block == block and x.head == head)
    assert h.n_hit_samples == len(hits) > 0
    assert h.hit_rate == sum(hits) / len(hits)  # counts: the same division
    # float32 weights summed over the region, then a mean over samples, in other orders
    n = tr.visual_positions.shape[1] + len(region_mass)
    assert h.region_mass.mean == pytest.approx(np.mean(region_mass), abs=sum_tol(max(region_mass), n, torch.float32))
    assert 0 < h.chance_hit_rate < 1
    stopped = pattern_statistics(llava, items, cancel=lambda: True)
    assert stopped.n_samples == 0 and stopped.heads == []


def test_pattern_statistics_on_a_cross_attention_model_skips_text_only_blocks():
    coca = load_model("shapes-coca")
    samples = [scenes.make_sample("heldout", i) for i in range(20, 24)]
    items = [(s.image, s.question, s.objects[s.target].mask if s.target is not None else None) for s in samples]
    stats = pattern_statistics(coca, items)
    kinds = dict(coca.adapter.blocks)
    for h in stats.heads:
        name = h.name.rsplit(".", 1)[0]
        if kinds[name] == "self":  # no visual key: no region mass, no hit rate
            assert h.region_mass is None and h.hit_rate is None
        elif any(s.target is not None for s in samples):
            assert h.region_mass is not None and 0.0 <= h.hit_rate <= 1.0
