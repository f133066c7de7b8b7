"""The claim specifications' relations (core.methods.validation.relations and the steps
derived from them): where each shipped relation is read on an input, checked on the token
ids; the chain's observations of a relation of the sequence's own tokens against the
model's own eager attention; the counterfactual's inserted word; the cut of a head's edges
to a sink against z recomputed by hand from the values; power refusals and a user's
specification file for a text relation through the command."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

import core.cli
from core import load_model
from core.cli import main
from core.forward.capture import capture, eager_attention
from core.methods.validation import ChainContext
from core.methods.validation.relations import Unreadable, locate, prepared, shifted
from core.methods.validation.spec import SHIPPED, ClaimSpec
from core.validate import Reading, ValidateError, parse_subject, read_chain_data, relation_words, validate
from tests.core.exactness import forwards_tol, pattern_rtol
from tests.core.test_capture_llava import tiny_llava_float64
from tests.tolerances import sum_tol

TEXT_SPECS = ["previous-token", "induction", "sink-delimiter"]


@pytest.fixture(scope="module")
def tiny():
    return tiny_llava_float64()


def _context(loaded, spec_name: str, n: int = 6) -> ChainContext:
    spec = SHIPPED[spec_name]
    reading = Reading(spec, 0, relation_words())
    search, held = read_chain_data(loaded, "scenes", n=n, n_side=0, reading=reading)
    return ChainContext(
        loaded, search.samples, search.condition, held.samples, held.condition, spec=spec, words=reading.words
    )


@pytest.mark.parametrize("name", TEXT_SPECS)
def test_each_text_relation_is_read_where_its_tokens_say(tiny, name):
    ctx = _context(tiny, name)
    a = tiny.adapter
    assert ctx.eval_condition.query == {"previous-token": "seeded word of the question (after its first)"}.get(
        name, ctx.eval_condition.query
    )
    special = set(a.tokenizer.all_special_ids)
    for s, row in zip(ctx.eval_samples, ctx.rows("eval")):
        ids = prepared(a, s).input_ids[0].tolist()
        q = row.query
        assert row.scored == row.keys == list(range(q + 1)) and row.cross_keys is None
        assert row.chance == pytest.approx(len(row.sources) / (q + 1))
        if name == "previous-token":
            assert row.sources == [q - 1]
            assert row.answer_id == ids[q - 1] and row.foil_id not in ids
        elif name == "induction":
            (src,) = row.sources
            assert ids[q] == ids[src - 1] and src - 1 < q - 1  # the token after the query token's earlier occurrence
            assert q == int(prepared(a, s).answer_positions[0]) - 2  # the question's last word ("... w_j ASSISTANT:")
            assert row.answer_id == ids[src] and row.foil_id not in ids
            words = s.question.split()
            assert len(words) > 5 and words[-1] in words[:-1]
        else:
            assert q == int(prepared(a, s).answer_positions[0]) and row.sources[0] == 0
            for p in row.sources[1:]:
                text = a.tokenizer.decode([ids[p]]).strip()
                assert ids[p] in special or not any(ch.isalnum() for ch in text), text
            assert row.answer_id == a.token_id(s.answer) and row.foil_id == a.token_id(s.foil)


def test_a_relation_that_cannot_be_read_on_an_input_says_why(tiny):
    s = read_chain_data(tiny, "scenes", n=1, n_side=0)[1].samples[0]
    a = tiny.adapter
    with pytest.raises(Unreadable, match="no token of the question repeats"):
        locate(a, SHIPPED["induction"], s, prepared(a, s), words=relation_words())
    with pytest.raises(Unreadable, match="no foil word"):
        locate(a, SHIPPED["previous-token"], s, prepared(a, s), words=())


@torch.no_grad()
def _eager_rtol(a, tr, head, query: int) -> float:
    """How far, relative to each weight, the model's eager row (its softmax in float32) may be
    from the float64 recomputation: from the row's own scores, recomputed alike on both sides."""
    q, k = a.queries_keys(tr, head.block)
    scores = (q[query, head.head] @ k[: query + 1, head.head].T) * a.score_scale(head.block)
    return pattern_rtol(a, tr, scores, 0.0)


@pytest.mark.parametrize("name", ["previous-token", "induction"])
def test_observations_are_the_models_eager_attention_at_each_query(tiny, name):
    ctx = _context(tiny, name, n=4)
    obs, a = ctx.eval_obs, tiny.adapter
    hits = obs.hits()
    for i, (s, row) in enumerate(zip(ctx.eval_samples, ctx.rows("eval"))):
        inputs = prepared(a, s)
        with torch.no_grad(), eager_attention(tiny.model):
            own = tiny.model(**inputs.tensors, output_attentions=True).attentions
        tr = capture(tiny, None, "", inputs=inputs, query_positions=[row.query])
        for c, h in enumerate(obs.heads):
            want = own[h.block][0, h.head, row.query, : row.query + 1].numpy()
            rtol = _eager_rtol(a, tr, h, row.query)
            np.testing.assert_allclose(obs.attn[i, c, : row.query + 1], want, atol=0, rtol=rtol)
            assert hits[i, c] == float(int(want.argmax()) in row.sources)
        logits = tr.logits[0, row.query].double()
        # the observation's forward is batched with the inputs of its length and query: two forwards apart
        tol = 2 * forwards_tol(a, logits[[row.answer_id, row.foil_id]], inputs.input_ids.shape[1])
        assert obs.logit_diff[i] == pytest.approx(float(logits[row.answer_id] - logits[row.foil_id]), abs=tol)


def test_the_inserted_word_moves_the_sources_one_position_on(tiny):
    ctx = _context(tiny, "previous-token", n=4)
    a, sw = tiny.adapter, ctx.swap_obs
    assert sw.rows and not sw.stays
    for r, i in enumerate(sw.rows):
        s, row = ctx.eval_samples[i], ctx.rows("eval")[i]
        cf = shifted(a, ctx.spec, s, row, seed=ctx.seed, words=ctx.words)
        ids, moved = prepared(a, s).input_ids[0].tolist(), a.prepare([Image.fromarray(s.image)], [cf.question])
        got = moved.input_ids[0].tolist()
        assert got[: row.query - 1] == ids[: row.query - 1] and got[row.query :] == ids[row.query - 1 :]
        assert cf.query == row.query + 1 and cf.a == [row.query - 1] and cf.b == [row.query]
        with torch.no_grad(), eager_attention(tiny.model):
            own = tiny.model(**moved.tensors, output_attentions=True).attentions
        tr = capture(tiny, None, "", inputs=moved, query_positions=[cf.query])
        for c, h in enumerate(sw.heads):
            after = own[h.block][0, h.head, cf.query].double()
            rtol = _eager_rtol(a, tr, h, cf.query)
            for got, where in ((sw.mass_b_swap, cf.b), (sw.mass_a_swap, cf.a)):  # one weight each
                assert got[r, c] == pytest.approx(float(after[where].sum()), rel=rtol, abs=0)


@torch.no_grad()
def test_cutting_a_head_off_its_sink_is_its_z_renormalised_over_the_other_keys(tiny):
    """Knocking out the edges from the query to the sources, before the softmax, leaves the
    head's z the attention-weighted values of the other keys over their mass: recomputed here
    from the clean capture's values (nothing upstream of the head's own block changes)."""
    ctx = _context(tiny, "sink-delimiter", n=3)
    a = tiny.adapter
    for head in ctx.pool[:: max(1, len(ctx.pool) // 4)]:
        rise = ctx.unparked(head)
        for i, (s, row) in enumerate(zip(ctx.eval_samples, ctx.rows("eval"))):
            tr = capture(tiny, None, "", inputs=prepared(a, s), query_positions=[row.query])
            x = a.kv_norm(head.block)(tr.resid_pre[head.block][0])
            v = x @ a.W_V(head.block)[head.head] + a.b_V(head.block)[head.head]  # (positions, d_head)
            p = tr.patterns[head.block][0, head.head, 0, : row.query + 1].double()
            keep = torch.ones_like(p, dtype=torch.bool)
            keep[row.sources] = False
            z = tr.z[head.block][0, row.query, head.head].double()
            z_cut = (p[keep, None] * v[: row.query + 1][keep]).sum(0) / p[keep].sum()
            torch.testing.assert_close((p[:, None] * v[: row.query + 1]).sum(0), z, atol=1e-12, rtol=0)
            tol = sum_tol(float(v.abs().max()), row.query + 2, torch.float64) * 4
            assert rise[i] == pytest.approx(float(z_cut.norm() - z.norm()), abs=tol)


def test_text_relations_read_the_self_attention_heads_only():
    coca = load_model("shapes-coca")
    with pytest.raises(ValidateError, match="reads none of the sequence's own tokens"):
        parse_subject("L1.xattn.H1", coca, SHIPPED["previous-token"])
    with pytest.raises(ValidateError, match="reads no visual token"):
        parse_subject("T0.H1", coca, SHIPPED["attribute-moving"])
    assert parse_subject("T0.H1", coca, SHIPPED["induction"]).name == "T0.H1"


def test_a_held_out_set_too_small_is_refused_before_any_forward(monkeypatch):
    llava = load_model("shapes-llava")
    import core.methods.validation.observations as observations

    monkeypatch.setattr(observations, "capture", lambda *a, **k: pytest.fail("refused before any forward"))
    with pytest.raises(ValidateError, match=r"held-out n=1 is too small.*step 1 could pass is 2"):
        validate(llava, ["L1.H1"], claim="copies", dataset="scenes", n=1, n_side=0, spec="previous-token")
    stated = dict(SHIPPED["induction"].to_dict(), name="stated", stated_r=0.5)
    with pytest.raises(ValidateError, match=r"n=6 is too small.*step 3's Fisher 95% interval.*from n=16"):
        validate(llava, ["L1.H1"], claim="copies", dataset="scenes", n=6, n_side=0, spec=stated)


def test_a_users_text_relation_file_round_trips_through_the_command(tmp_path, monkeypatch):
    llava = load_model("shapes-llava")
    monkeypatch.setattr(core.cli, "_load", lambda args: llava)
    mine = dict(SHIPPED["previous-token"].to_dict(), name="my-previous", hit_ratio=3.0, follow_rate=0.6)
    spec_file, out, session = tmp_path / "mine.json", tmp_path / "v.json", tmp_path / "s.vlmr"
    spec_file.write_text(json.dumps(mine))
    args = ["validate", "--claim", "copies the previous word", "--head", "L0.H1", "--dataset", "scenes"]
    args += ["--n", "6", "--n-side", "3", "--spec", str(spec_file), "--json", str(out), "--session", str(session)]
    assert main([*args, "--quiet"]) == 0
    got = json.loads(out.read_text())
    assert got["specification"] == mine and ClaimSpec.from_dict(got["specification"]) == ClaimSpec.from_dict(mine)
    assert got["claim"]["relation"] == mine["relation"]
    assert got["heldout"]["query"] == "seeded word of the question (after its first)"
    (verdict,) = got["verdicts"]
    assert verdict["relation"] == mine["relation"] and verdict["n"] == 6 and verdict["steps_tested"] == 7
    assert f"steps passed: {len(verdict['steps_passed'])} of 7" in verdict["verdict"]
    assert "3 x chance" in got["criteria"]["1"] and "0.6" in got["criteria"]["4"]
    from core.validate import Validation

    again = Validation.from_dict(got)  # reopened: the same specification, the same verdicts
    assert again.spec == ClaimSpec.from_dict(mine)
    assert json.loads(json.dumps(again.to_dict()))["verdicts"] == got["verdicts"]
    assert main(["export", "--session", str(session), "--format", "md", "--out", str(tmp_path / "a.md")]) == 0
    assert mine["relation"] in (tmp_path / "a.md").read_text()


def test_a_users_file_gives_an_induction_claim_its_lines_with_a_repeat(tmp_path):
    """A JSONL of images and questions, without answers or masks: the induction relation reads
    the lines whose question repeats a token (its S is the copied token against a foil word), and
    the input condition counts the lines it could not read and why."""
    from core.zoo import scenes

    llava = load_model("shapes-llava")
    lines = []
    for i in range(8):
        s = scenes.make_sample("val", i)
        Image.fromarray(s.image).save(tmp_path / f"{i}.png")
        question = "red circle blue square red circle" if i % 2 else s.question  # half repeat a token
        lines.append({"image": f"{i}.png", "question": question})
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    reading = Reading(SHIPPED["induction"], 0, relation_words())
    search, held = read_chain_data(llava, str(tmp_path / "d.jsonl"), n=10, n_side=0, reading=reading)
    assert search.n + held.n == 4 and all("red circle blue" in s.question for s in search.samples + held.samples)
    why = "no token of the question repeats an earlier one with another token after it"
    assert sum(d.condition.filters.get("relation_left_out", {}).get(why, 0) for d in (search, held)) == 4
    assert held.condition.query == "question's last token that occurred before"
    ctx = ChainContext(
        llava, search.samples, search.condition, held.samples, held.condition, spec=reading.spec, words=reading.words
    )
    ids = prepared(llava.adapter, held.samples[0]).input_ids[0].tolist()
    (row,) = ctx.rows("eval")[:1]
    assert llava.adapter.tokenizer.decode([ids[row.query]]).strip() == "circle"
    assert (
        llava.adapter.tokenizer.decode([ids[row.sources[0]]]).strip()
        == "blue"
        == llava.adapter.tokenizer.decode([row.answer_id]).strip()
    )


@pytest.mark.parametrize(
    "fields, refused",
    [
        ({"sources": "first_token", "content": "quiet", "counterfactual": "other_image", "effect": "unparks"}, None),
        ({"query": "question_word", "sources": "previous_token", "content": "answer"}, "'content' 'answer'"),
        ({"sources": "previous_token", "content": "answer"}, "'counterfactual' 'shift' does not fit: the word"),
        ({"query": "question_word", "sources": "first_token"}, "'content' 'copy' does not fit"),
        ({"query": "repeat", "sources": "after_earlier_occurrence", "effect": "unparks"}, None),
    ],
)
def test_a_users_combination_of_fields_runs_every_step_or_names_the_field(tiny, fields, refused):
    """A specification the shipped ones do not make: its steps come from its fields (each of the
    seven tested, the criteria worded for them), or one line names the field that does not fit."""
    from core.methods.validation import SpecError, run_chain
    from core.methods.validation.spec import criteria

    base = {"name": "mine", "relation": "my relation", "counterfactual": "shift", "content": "copy"}
    if refused:
        with pytest.raises(SpecError, match=refused):
            ClaimSpec.from_dict({**base, **fields})
        return
    spec = ClaimSpec.from_dict({**base, **fields})
    reading = Reading(spec, 0, relation_words())
    search, held = read_chain_data(tiny, "scenes", n=5, n_side=2, reading=reading)
    ctx = ChainContext(
        tiny,
        search.samples,
        search.condition,
        held.samples,
        held.condition,
        side_samples=held.side,
        side_reference=search.side,
        spec=spec,
        words=reading.words,
    )
    chain = run_chain(ctx, ctx.pool[1])
    assert [s.status != "not tested" for s in chain.steps.values()] == [True] * 7
    assert chain.criteria == {k: v for k, v in criteria(spec).items()}
    sources = {"first_token": "the first token", "after_earlier_occurrence": "the token after"}[spec.sources]
    assert sources in chain.criteria[1] and chain.relation == "my relation"
    if spec.sources == "first_token":
        assert all(row.sources == [0] for row in ctx.rows("eval"))
        kinds = {b.kind for b in chain.steps[1].baselines}
        if ctx.plan(ctx.pool[1]).fixed_patch == 0:  # a head always at position 0 is the relation itself
            assert "no fixed-position baseline" in " ".join(chain.steps[1].notes)
            assert "position: fixed patch" not in kinds
        else:
            assert "position: fixed patch" in kinds
