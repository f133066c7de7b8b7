"""Functional labels and the validation chain (docs/METHODS.md §4.5, §4.11): the
status logic, serialisation, and each step on shapes-coca with ~20 scenes."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from core import load_model
from core.forward.capture import capture
from core.methods import validation as L
from core.methods.validation import (
    ChainStep,
    InputCondition,
    Label,
    LabelError,
    ValidationChain,
)
from core.zoo import label_scenes, scenes
from tests.core.exactness import forwards_tol, frozen_map_terms
from tests.tolerances import abs_terms, rounding_tol, sum_tol


def _condition(split="heldout", n=20):
    return InputCondition(
        "core.zoo.scenes",
        split,
        n,
        ("attribute",),
        ("color_of_shape", "shape_of_color"),
        {"min_distractors": 1},
        {"split_seed": 2, "indices": list(range(n))},
    )


def _step(k, status="passed", value=0.5):
    return ChainStep(k, status=status, metric="m", value=value, n=20, split="heldout")


def _chain(**statuses):
    chain = ValidationChain("L1.xattn.H2", "moves colour", "shapes-coca", _condition(), search={"split": "val"})
    for k, st in statuses.items():
        chain.record(_step(int(k[1:]), st))
    return chain


# ---------------------------------------------------------------- status logic (no model)


def test_every_status_is_reachable_and_6_7_gate_supported():
    assert _chain().status().status == "not a candidate"
    four = {f"s{k}": "passed" for k in (1, 2, 3, 4)}
    assert _chain(**four).status().status == "mechanism candidate"
    assert _chain(**four, s5="failed").status().status == "mechanism candidate"
    assert _chain(**four, s5="passed").status().status == "candidate with intervention"
    assert _chain(**four, s5="passed", s6="passed").status().status == "candidate with intervention"
    assert _chain(**four, s5="passed", s7="passed").status().status == "candidate with intervention"
    status, reason = _chain(**four, s5="passed", s6="failed", s7="passed").status()
    assert status == "candidate with intervention" and "step 6 fail" in reason
    full = _chain(**four, s5="passed", s6="passed", s7="passed")
    assert full.status().status == "supported" and full.label().supported
    # 5-7 cannot make up for a missing observation step
    broken = _chain(s1="passed", s2="passed", s3="failed", s4="passed", s5="passed", s6="passed", s7="passed")
    status, reason = broken.status()
    assert status == "not a candidate" and "step 3 fail" in reason
    assert "step 4 not tested" in _chain(s1="passed", s2="passed", s3="passed").status().reason


def test_a_label_refuses_to_exist_without_its_input_condition():
    with pytest.raises(LabelError, match="input condition"):
        Label("moves colour", "L1.xattn.H2", "shapes-coca", None)
    with pytest.raises(LabelError, match="input condition"):
        Label("moves colour", "L1.xattn.H2", "shapes-coca", "heldout")  # a bare tag
    with pytest.raises(LabelError):
        ValidationChain("L1.xattn.H2", "moves colour", "shapes-coca", None)
    with pytest.raises(LabelError, match="n_samples"):
        InputCondition("core.zoo.scenes", "heldout", 0)
    with pytest.raises(LabelError, match="held-out"):  # evaluated on the split the head was found on
        ValidationChain("L1.xattn.H2", "moves colour", "shapes-coca", _condition("val"), search={"split": "val"})
    with pytest.raises(LabelError, match="n=0"):
        ChainStep(1, status="passed", n=0)
    with pytest.raises(LabelError):
        ChainStep(8)
    with pytest.raises(LabelError):
        ChainStep(1, status="maybe")
    lab = Label("moves colour", "L1.xattn.H2", "shapes-coca", _condition().to_dict())  # a dict is converted
    assert isinstance(lab.condition, InputCondition)
    assert "not a supported label" in lab.text() and "heldout" in lab.text() and "n=20" in lab.text()


def test_round_trip_to_dict_from_dict():
    chain = _chain(s1="passed", s2="failed")
    chain.steps[1].baselines.append(L.Baseline("matched random head", ["L1.xattn.H0"], 0.3, 20, {"x": 1}))
    chain.steps[2].value = float("nan")  # NaN is written as null
    d = json.loads(json.dumps(chain.to_dict()))
    assert d["schema_version"] == L.SCHEMA_VERSION and d["status"] == "not a candidate"
    back = ValidationChain.from_dict(d)
    assert back.to_dict() == d
    assert back.steps[1].baselines[0].kind == "matched random head" and back.status() == chain.status()
    lab = _chain(**{f"s{k}": "passed" for k in range(1, 8)}).label()
    ld = json.loads(json.dumps(lab.to_dict()))
    assert Label.from_dict(ld).to_dict() == ld and ld["status"] == "supported"
    assert ld["condition"]["split"] == "heldout" and ld["condition"]["n_samples"] == 20
    with pytest.raises(LabelError, match="schema_version"):
        Label.from_dict({**ld, "schema_version": 99})
    # a chain written by schema 1 ("pass" / "fail" / "not-run") reads back in today's words
    old_words = {"passed": "pass", "failed": "fail", "not tested": "not-run"}
    v1 = {
        **d,
        "schema_version": 1,
        "steps": {k: {**x, "status": old_words[x["status"]]} for k, x in d["steps"].items()},
    }
    assert ValidationChain.from_dict(v1).to_dict() == d


# ---------------------------------------------------------------- the steps on shapes-coca


def batch_tol(loaded, reference) -> float:
    """How far a value from batched runs (the labels' captures group questions of
    one length) may be from the same value from single runs: as far as two
    forwards may be apart, the longest key axis being the visual tokens or the text."""
    a = loaded.adapter
    n_keys = max(len(a.visual_tokens((128, 128))), a.context_length)
    return forwards_tol(a, reference, n_keys)


def dla_tol(loaded, trace, answer_id: int, foil_id: int, names: list[str]) -> float:
    """How far a summed frozen DLA of components ``names`` from batched runs may be
    from the single run's: each component's terms moved by :func:`batch_tol`."""
    from core.methods.residual import component_stack, target_direction

    a = loaded.adapter
    p = int(trace.answer_positions[0])
    all_names, C = component_stack(a, trace, p)
    u = target_direction(a, answer_id, foil_id).to(C.dtype)
    terms = frozen_map_terms(a.final_norm_layer(), trace.final_resid[0, p], C[[all_names.index(n) for n in names]], u)
    return batch_tol(loaded, terms.sum().reshape(1)) + sum_tol(terms.sum(), a.d_model + 4, C.dtype)


@pytest.fixture(scope="module")
def coca():
    return load_model("shapes-coca")


@pytest.fixture(scope="module")
def ctx(coca):
    return label_scenes.attribute_context(coca, n_search=20, n_eval=20, n_side=8)


@pytest.fixture(scope="module")
def cand(ctx):
    found = L.find_candidates(ctx, 1)
    assert found[0][1]["split"] == "val" and found[0][1]["rank_by_target_dla"] == 1
    return found[0]


HEAD_BASELINES = {"matched random head", "other heads of the layer", "entropy-matched heads"}


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7])
def test_each_step_returns_evidence_with_n_and_baselines(ctx, cand, k):
    head, _ = cand
    step = L.step6_baselines(ctx, head) if k == 6 else L.STEP_FUNCTIONS[k](ctx, head)
    assert step.number == k and step.status in ("passed", "failed") and step.n > 0 and step.split == "heldout"
    assert step.criterion == L.CRITERIA[k] and step.audit is not None and step.why
    kinds = {b.kind for b in step.baselines}
    if k in (1, 2, 3, 4, 5):
        assert HEAD_BASELINES <= kinds
        assert all(b.n > 0 for b in step.baselines)
    if k in (1, 2, 4):
        assert any(x.startswith("position:") for x in kinds)
    if k == 6:
        steps = {r["step"] for r in step.numbers["comparisons"]}
        assert steps == {1, 2, 4, 5} and {r["baseline"] for r in step.numbers["comparisons"]} >= HEAD_BASELINES
    if k == 7:
        assert set(step.numbers["side_effects"]) == {"relation", "count", "exist"}
        assert step.numbers["alternative_route"]["alternative"] != head.name
    json.dumps(step.to_dict())  # JSON-safe


def test_chain_on_a_candidate_and_its_label(ctx, cand):
    head, search = cand
    chain = L.run_chain(ctx, head, search)
    assert all(s.status != "not tested" for s in chain.steps.values())
    assert chain.search["split"] == "val" and chain.condition.split == "heldout"
    lab = chain.label()
    assert lab.status == chain.status().status and lab.condition.n_samples == 20
    assert ValidationChain.from_dict(json.loads(json.dumps(chain.to_dict()))).status() == chain.status()


def test_mean_ablation_value_is_the_mean_z_over_the_reference_set(coca, ctx):
    head = ctx.pool[5]
    ref = ctx.search_samples[:6]
    zs, z_terms = [], 0.0
    a = coca.adapter
    for s in ref:
        tr = capture(coca, Image.fromarray(s.image), s.question, pattern_layers=[])
        zs.append(tr.z[head.block][0, int(tr.answer_positions[0]), head.head].double())
        # z = A v, the weights summing to 1: its terms are at most the largest |x| |W_V| + |b_V| over the keys
        src = tr.kv_source[head.block]
        x = a.kv_norm(head.block)(tr.resid_pre[head.block][0] if src is None else src[0])
        with torch.no_grad():
            v = abs_terms(x, a.W_V(head.block)[head.head], a.b_V(head.block)[head.head])
        z_terms = max(z_terms, float(v.max()))
    stacked = torch.stack(zs)
    expected = stacked.mean(0)
    # batched runs against single runs (relative to z's terms), and the mean's sum in another order
    mean_tol = batch_tol(coca, z_terms) + sum_tol(stacked.abs().mean(0).max(), len(zs) + 1, torch.float64)
    rows = [ctx.locate(s) for s in ref]
    torch.testing.assert_close(L.mean_ablation_value(coca, ref, rows, head), expected, atol=mean_tol, rtol=0)
    # the context's value for attribute questions is the same mean over its whole search split
    whole = L.mean_ablation_value(coca, ctx.search_samples, ctx.rows("search"), head)
    tol = batch_tol(coca, z_terms) + sum_tol(ctx.mean_z(head).abs().max(), len(ctx.search_samples) + 1, torch.float64)
    torch.testing.assert_close(ctx.mean_z(head), whole, atol=tol, rtol=0)
    # the edited run writes exactly that value into the head's z at the answer position
    s = ctx.eval_samples[0]
    inputs = coca.adapter.prepare([Image.fromarray(s.image)], [s.question])
    pos = int(inputs.answer_positions[0])
    tr = capture(coca, None, "", inputs=inputs, edits=[L.head_edit(head, pos, expected)], pattern_layers=[])
    tol = rounding_tol(float(expected.abs().max()), tr.z[head.block].dtype)  # written in the model's float32
    torch.testing.assert_close(tr.z[head.block][0, pos, head.head].double(), expected, atol=tol, rtol=0)


def test_observations_match_decompose_and_the_rerun(coca, ctx):
    """The head's whole DLA is the residual component's dla_frozen; the
    zero-ablation drop is compare_with_rerun's total_removal."""
    from core.methods.residual import compare_with_rerun, decompose

    obs = ctx.eval_obs
    s, head = ctx.eval_samples[3], ctx.pool[6]
    a = coca.adapter
    inputs = a.prepare([Image.fromarray(s.image)], [s.question])
    tr = capture(coca, None, "", inputs=inputs)
    aid, fid = a.token_id(s.answer), a.token_id(s.foil)
    comp = {c.name: c for c in decompose(a, tr, aid, fid).components}[head.name]
    assert obs.head_dla[3, obs.col(head)] == pytest.approx(
        comp.dla_frozen, abs=dla_tol(coca, tr, aid, fid, [head.name])
    )
    row = compare_with_rerun(coca, tr, aid, fid, names=[head.name], inputs=inputs).rows[0]
    # two logit differences (four logits), each from batched against single runs
    drop_tol = 4 * batch_tol(coca, tr.logits[0, int(tr.answer_positions[0])])
    assert ctx.drop([head], "zero")[3] == pytest.approx(row.total_removal, abs=drop_tol)
    # hits: argmax of the answer row over the visual tokens lies on the target's tokens
    pat = tr.patterns[head.block][0, head.head, 0]
    assert obs.hits()[3, obs.col(head)] == float(int(pat.argmax()) in obs.sources[3])


def test_swap_moves_the_asked_attribute_and_nothing_else():
    done = 0
    for i in range(40):
        s = scenes.make_sample("heldout", i, kind="attribute")
        sw = label_scenes.swap_attribute(s)
        if sw is None:
            continue
        t, p = s.objects[s.target], s.objects[sw.partner]
        outside = ~(sw.mask_a | sw.mask_b)
        assert np.array_equal(sw.image[outside], s.image[outside])
        assert sw.foil == s.answer and sw.answer != s.answer
        assert sw.answer == (p.color if s.template == "color_of_shape" else p.shape)
        if s.template == "shape_of_color":  # colours swapped: the target's ink now sits at the partner
            ink = np.median(sw.image[p.coverage >= 0.99].astype(float), axis=0)
            want = np.median(s.image[t.coverage >= 0.99].astype(float), axis=0)
            assert np.abs(ink - want).max() < 12
        done += 1
    assert done >= 10


def test_cancel_leaves_the_remaining_steps_not_run(coca, ctx):
    calls = []

    def progress(done, total, message):
        calls.append(message)

    stopped = L.ChainContext(
        coca,
        ctx.search_samples,
        ctx.search_condition,
        ctx.eval_samples,
        ctx.eval_condition,
        progress=progress,
        cancel=lambda: True,
    )
    chain = L.run_chain(stopped, ctx.pool[0])
    assert all(s.status == "not tested" for s in chain.steps.values()) and calls == ["L0.xattn.H0: step 1"]
    assert chain.status().status == "not a candidate"
    with pytest.raises(L.ChainCancelled):
        L.find_candidates(stopped)


# ---------------------------------------------------------------- routes: several heads of one block


def test_a_route_is_two_or_more_heads_of_one_block():
    route = L.RouteRef(1, (3, 1), "L1.xattn")
    assert route.heads == (1, 3) and route.name == "L1.xattn.H1+H3"
    assert [m.name for m in route.members] == ["L1.xattn.H1", "L1.xattn.H3"]
    for bad in ((2,), (2, 2)):
        with pytest.raises(LabelError, match="two or more distinct heads"):
            L.RouteRef(1, bad, "L1")


def test_route_columns_are_the_heads_mean_pattern_and_summed_write(coca, ctx):
    """A route's attention is its heads' mean answer row, its DLA their summed
    write (checked against the residual decomposition's components), its
    ablation theirs (checked against a run with the edits written out)."""
    from core.methods.residual import decompose

    block = ctx.pool[4].block  # L1.xattn
    route = L.RouteRef(block, (1, 2), ctx.pool[4].name.rsplit(".H", 1)[0])
    obs = ctx.eval_obs
    c, members = obs.col(route), [obs.col(m) for m in route.members]
    assert c == len(obs.heads) + obs.routes.index(route) and obs.col(route) == c  # added once
    # the route's column is its members' mean / sum, taken again here in another order (float64)
    n = len(members) + 1
    mass = np.abs(obs.attn[:, members]).mean(1).max()
    np.testing.assert_allclose(
        obs.attn[:, c], obs.attn[:, members].mean(1), rtol=0, atol=sum_tol(mass, n, torch.float64)
    )
    terms = np.abs(obs.dla[:, members]).sum(1).max()
    np.testing.assert_allclose(obs.dla[:, c], obs.dla[:, members].sum(1), rtol=0, atol=sum_tol(terms, n, torch.float64))
    assert torch.isnan(obs.z[:, c]).all()  # no single z: ablation goes through the heads

    s = ctx.eval_samples[2]
    a = coca.adapter
    tr = capture(coca, Image.fromarray(s.image), s.question)
    comps = {x.name: x for x in decompose(a, tr, a.token_id(s.answer), a.token_id(s.foil)).components}
    names = [m.name for m in route.members]
    tol = dla_tol(coca, tr, a.token_id(s.answer), a.token_id(s.foil), names)
    assert obs.head_dla[2, c] == pytest.approx(sum(comps[m].dla_frozen for m in names), abs=tol)

    by_hand = L.run_edited(
        coca,
        ctx.eval_samples,
        ctx.rows("eval"),
        lambda row: [L.head_edit(m, row.query, ctx.mean_z(m)) for m in route.members],
    )
    # the same edits, batched alike: two logits each, as far as two forwards may be apart
    np.testing.assert_allclose(
        ctx.ablated([route], "mean").logit_diff, by_hand.logit_diff, atol=2 * batch_tol(coca, tr.logits[0, -1])
    )
    with pytest.raises(LabelError, match="no single z"):
        ctx.mean_z(route)

    sw = ctx.swap_obs
    sc = sw.col(route)
    cols = [sw.col(m) for m in route.members]
    mass = np.abs(sw.mass_a_orig[:, cols]).mean(1).max()
    np.testing.assert_allclose(
        sw.mass_a_orig[:, sc], sw.mass_a_orig[:, cols].mean(1), rtol=0, atol=sum_tol(mass, len(cols) + 1, torch.float64)
    )


def test_route_baselines_are_routes_of_the_same_size(ctx):
    block_name = ctx.pool[4].name.rsplit(".H", 1)[0]
    route = L.RouteRef(ctx.pool[4].block, (1, 2, 3), block_name)
    plan = ctx.plan(route)
    assert isinstance(plan.random_head, L.RouteRef) and plan.random_head.block == route.block
    assert plan.random_head != route and len(plan.random_head.heads) == 3
    assert [h.name for h in plan.layer_heads] == [f"{block_name}.H0"]  # the rest of the block
    assert len(plan.entropy_matched) == 2 and not plan.each_matched
    assert all(isinstance(r, L.RouteRef) and r.block != route.block and len(r.heads) == 3 for r in plan.entropy_matched)

    whole = L.RouteRef(route.block, (0, 1, 2, 3), block_name)
    wplan = ctx.plan(whole)
    other_blocks = {h.block for h in ctx.pool} - {route.block}
    assert wplan.random_head is None and wplan.layer_heads == [] and wplan.each_matched
    assert {r.block for r in wplan.entropy_matched} == other_blocks  # every other block, whole
    step = L.step5_ablation(ctx, whole)
    matched = [b for b in step.baselines if b.kind == "entropy-matched heads"]
    assert len(matched) == len(other_blocks) and all(len(b.subjects) == 1 for b in matched)  # each apart

    head_plan = ctx.plan(ctx.pool[4])  # heads keep the head plan
    assert not head_plan.each_matched and all(isinstance(h, L.HeadRef) for h in head_plan.entropy_matched)


def test_find_routes_and_a_chain_on_a_route(ctx, cand):
    head, search = cand
    partner = next(h for h in ctx.pool if h.block == head.block and h != head)
    block_name = head.name.rsplit(".H", 1)[0]
    routes = L.find_routes(ctx, [(head, search), (partner, search)])
    assert [r for r, _ in routes] == [
        L.RouteRef(head.block, (head.head, partner.head), block_name),  # the two candidates together
        L.RouteRef(head.block, tuple(h.head for h in ctx.pool if h.block == head.block), block_name),  # the block
    ]
    assert L.find_routes(ctx, [(head, search)]) == []  # one candidate in a block: no route
    route, info = routes[0]
    assert info["members"] == sorted([head.name, partner.name]) and info["split"] == "val"
    chain = L.run_chain(ctx, route, info)
    assert chain.subject == route.name and chain.subject_kind == "route"
    assert all(s.status != "not tested" for s in chain.steps.values())
    assert chain.steps[7].numbers["alternative_route"]["alternative"] not in info["members"]
    names = {x for r in chain.steps[6].numbers["comparisons"] for x in r["subjects"]}
    assert names >= {chain.steps[6].numbers["plan"]["random_head"]}  # routes by name, not repr
    assert not any("RouteRef" in x for x in names)
    back = ValidationChain.from_dict(json.loads(json.dumps(chain.to_dict())))
    assert back.subject_kind == "route" and back.status() == chain.status()
    # the search table still lists heads only, whatever routes were planned before
    assert all(".H" in row["head"] and "+" not in row["head"] for row in L.find_candidates(ctx, 1)[0][1]["table"])
