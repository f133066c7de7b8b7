"""Tuned lens (docs/METHODS.md §4.9): translators, baselines, persistence, resume,
positions, the CLI, and the issue-6 bars on the committed lenses.

CI trains only tiny lenses on the tiny random LLaVA; the bars test loads the
lenses committed under resources/models/<name>/tuned-lens/ and evaluates them
on a modest held-out sample.
"""

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from core import load_model
from core.forward.capture import capture
from core.methods import tuned_lens as tl
from core.methods.logit_lens import LensRow, lens_logits, logit_lens
from core.zoo import scenes
from core.zoo.lens_corpus import SyntheticCorpus
from tests.core.exactness import logit_terms_bound, reader_at_last_layer_tol, unembedding_tol
from tests.core.test_capture_coca import tiny_coca_float64
from tests.core.test_capture_llava import tiny_llava_float64
from tests.tolerances import kl_tol, rounding_tol, sum_tol

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = ("shapes-llava", "shapes-coca")
TINY_CFG = tl.LensConfig(steps=12, batch_size=4, lr=0.3, checkpoint_every=4)


def _tiny(fingerprint: str = "tiny-llava-test"):
    m = tiny_llava_float64()
    m.fingerprint = fingerprint
    return m


@pytest.fixture(scope="module")
def tiny():
    return _tiny()


@pytest.fixture(scope="module")
def tiny_trained(tiny):
    return tl.train_lens(tiny, SyntheticCorpus("train"), TINY_CFG)


@pytest.fixture(scope="module")
def tiny_trace(tiny):
    s = scenes.make_sample("heldout", 3)
    return capture(tiny, s.image, s.question, pattern_layers=[])


@torch.no_grad()
def logits_error(adapter, x: torch.Tensor) -> float:
    """How far two readings of ``x`` through the final norm and the unembedding
    (one state, or a stack of them in one product) may be apart once cast to
    float32: the product's order, and a float32 rounding landing either side."""
    normed = adapter.final_norm_layer()(x)
    logits = lens_logits(adapter, x)
    return unembedding_tol(adapter, normed) + rounding_tol(float(logits.abs().max()), torch.float32, 2)


def last_layer_kl_tol(adapter, dtype: torch.dtype) -> float:
    """KL in bits between the model's distribution and a reader of x_L (the
    identity, or any lens, which reads x_L as it is), evaluated in float32, for
    any input: :func:`kl_tol` with the reader's error, both cast to float32."""
    terms = logit_terms_bound(adapter)
    error = reader_at_last_layer_tol(adapter, dtype) + rounding_tol(terms, torch.float32, 2)
    return kl_tol(error, adapter.W_U.shape[1], torch.float32, terms) / math.log(2)


def test_identity_and_fresh_affine_reproduce_the_logit_lens_exactly(tiny, tiny_trace):
    """Row by row the logit lens, up to the product's order (one state against the
    stack) landing on either side of a float32 rounding, and the final distribution
    taken from the model's logits here, from the lens at x_L there."""
    a, tr = tiny.adapter, tiny_trace
    n, d = tr.n_blocks, a.d_model
    pos = int(tr.answer_positions[0])
    answer = int(tr.logits[0, pos].argmax())
    foil = int(tr.logits[0, pos].argsort()[-2])
    reference = logit_lens(a, tr, answer, foil, top_k=3)
    states = [x[0, pos] for x in tr.resid_pre + [tr.final_resid]]
    final_error = logits_error(a, tr.final_resid[0, pos])
    vocab, final = a.W_U.shape[1], lens_logits(a, tr.final_resid[0, pos]).float()
    for form in ("identity", "affine", "lowrank", "mlp"):
        lens = tl.TunedLens(n, d, form, rank=4, dtype=torch.float64)
        for layer in range(n + 1):
            x = (tr.resid_pre + [tr.final_resid])[layer]
            assert torch.equal(lens_logits(a, lens.translate(layer, x)), lens_logits(a, x)), (form, layer)
        rows = tl.tuned_lens_rows(lens, a, tr, answer, foil, top_k=3)
        assert len(rows) == len(reference.rows) == n + 1
        for r, ref, x in zip(rows, reference.rows, states):
            assert set(LensRow.__dataclass_fields__) <= set(r)  # the app's LensPanel reads these keys
            assert r["answer_rank"] == ref.answer_rank
            error = logits_error(a, x)
            assert r["answer_logit"] == pytest.approx(ref.answer_logit, abs=error)
            assert r["logit_diff"] == pytest.approx(
                ref.logit_diff, abs=2 * error + rounding_tol(ref.logit_diff, torch.float32)
            )
            lg = lens_logits(a, x).float()
            spread = 2 * float((lg - final).detach().abs().max())
            tol = kl_tol(error + final_error, vocab, torch.float32, float(lg.detach().abs().max()), spread)
            assert r["kl_to_final"] == pytest.approx(ref.kl_to_final, abs=tol)
            assert [t for t, _ in r["top"]] == [t for t, _ in ref.top]
    logit_max = float(final.detach().abs().max())
    assert rows[-1]["kl_to_final"] == pytest.approx(0.0, abs=kl_tol(final_error, vocab, torch.float32, logit_max))


def test_trained_tiny_lens_beats_identity_mean_and_random_on_its_training_data(tiny, tiny_trained):
    lens = tiny_trained.lens
    assert tiny_trained.steps_done == TINY_CFG.steps and not tiny_trained.cancelled
    assert tiny_trained.loss_history[-1] < tiny_trained.loss_history[0]
    # samples 0..47 of the train split are exactly the 12 steps x 4 pairs it was trained on
    ev = tl.evaluate_lens(tiny, lens, SyntheticCorpus("train"), TINY_CFG.steps * TINY_CFG.batch_size)
    t = ev.kl_table()
    n = lens.n_blocks
    for layer in range(n):
        assert t["trained"][layer] < 0.9 * t["identity"][layer], (layer, t)
        assert t["trained"][layer] < t["mean"][layer] and t["trained"][layer] < t["random"][layer], (layer, t)
    assert t["trained"][n] == t["identity"][n] == pytest.approx(0.0, abs=last_layer_kl_tol(tiny.adapter, torch.float64))
    assert t["random"][n] is None  # no translator at x_L
    final = ev.layers[n]["readers"]["trained"]
    assert final.top1_agreement == 1.0 and final.answer_rank_mean == 0.0
    d = ev.to_dict()
    assert d["audit"][0]["method"] == "tuned lens"
    assert any("identity baseline" in c for c in d["audit"][0]["controls"])
    assert "explicit logits" in d["audit"][0]["cannot_support"]


@torch.no_grad()
def test_capacity_report_and_baseline_translators(tiny_trained):
    lens = tiny_trained.lens
    cap = lens.capacity
    n, d = lens.n_blocks, lens.d_model
    assert cap["form"] == "affine" and cap["parameters"] == n * (d * d + d) == lens.n_parameters
    for row in cap["layers"]:
        a = lens.A[row["layer"]].double()
        # a d * d-term sum of squares in float64, its root, one division
        norm_tol = sum_tol(1.0, d * d + 3, torch.float64)
        assert row["rel_frobenius"] == pytest.approx(float(a.norm() / math.sqrt(d)), rel=norm_tol)
        assert 0 <= row["orthogonal_residual_share"] < 1 and row["sv_min"] <= row["sv_mean"] <= row["sv_max"]
    rnd = lens.random_like()
    # rescaled to the same norm: two norms of d * d (or d) terms and a rescaling, in the lens's dtype
    rel = sum_tol(1.0, d * d + 4, lens.A.dtype)
    for layer in range(n):  # same form, same norm, other direction
        assert float(rnd.A[layer].norm()) == pytest.approx(float(lens.A[layer].norm()), rel=rel)
        assert float(rnd.b[layer].norm()) == pytest.approx(float(lens.b[layer].norm()), rel=rel)
        assert not torch.allclose(rnd.A[layer], lens.A[layer])
    # a pure scaling is a scaled rotation: no residual share, spread 0
    scaled = tl.TunedLens(2, 8, "affine", dtype=torch.float64)
    with torch.no_grad():
        scaled.A[:] = 0.5 * torch.eye(8, dtype=torch.float64)
    r = scaled.capacity_report()["layers"][0]
    # an 8 x 8 SVD is backward stable: its error a multiple of u of the matrix's norm
    svd = sum_tol(1.0, 8 * 8, torch.float64)
    assert r["orthogonal_residual_share"] == pytest.approx(0.0, abs=svd) and r["sv_spread"] == pytest.approx(
        0.0, abs=svd
    )
    assert r["rel_frobenius"] == pytest.approx(0.5, abs=svd)
    orth = scaled.orthogonal_like()
    torch.testing.assert_close(orth.A, scaled.A, atol=svd, rtol=0)
    low = tl.TunedLens(3, 8, "lowrank", rank=2)
    assert low.n_parameters == 3 * (2 * 8 * 2 + 8)
    rl = low.random_like()
    with torch.no_grad():
        low.U.normal_()
        rl = low.random_like()
    rel = sum_tol(1.0, 8 * 8 + 2 * 8 + 4, low.U.dtype)  # the delta's products and both norms, in the lens's dtype
    for layer in range(3):
        assert float(rl.delta(layer).norm()) == pytest.approx(float(low.delta(layer).norm()), rel=rel)
    mlp = tl.TunedLens(3, 8, "mlp", hidden=4)
    assert mlp.summary()["stronger_reader"] and any("STRONGER" in s for s in tl.lens_audit(mlp).notes)


def test_save_load_round_trip_and_wrong_fingerprint_refused(tiny, tiny_trained, tiny_trace, tmp_path):
    lens = tiny_trained.lens
    lens.report = {"note": "test"}
    tl.save_lens(lens, tmp_path / "lens")
    config = json.loads((tmp_path / "lens" / "lens.json").read_text())
    assert config["schema_version"] == 1 and config["model"]["fingerprint"] == tiny.fingerprint
    assert config["translator"]["form"] == "affine" and config["capacity"]["layers"]
    assert config["training"]["data"]["n_samples"] == 48 and "KL" in config["training"]["objective"]
    assert (tmp_path / "lens" / "REPORT.md").read_text().startswith("# Tuned lens")
    back = tl.load_lens(tmp_path / "lens", tiny)
    for k, v in lens.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    a, tr = tiny.adapter, tiny_trace
    answer = int(tr.logits[0, int(tr.answer_positions[0])].argmax())
    assert tl.tuned_lens_rows(back, a, tr, answer) == tl.tuned_lens_rows(lens, a, tr, answer)
    other = _tiny("another-model")
    with pytest.raises(tl.LensMismatchError) as err:
        tl.load_lens(tmp_path / "lens", other)
    msg = str(err.value)
    assert "\n" not in msg and tiny.fingerprint in msg and "another-model" in msg
    with pytest.raises(tl.LensMismatchError):
        tl.evaluate_lens(other, back, SyntheticCorpus("heldout"), 2)
    with pytest.raises(tl.LensError, match="no lens.json"):
        tl.load_lens(tmp_path)


def test_checkpoint_resume_equals_an_uninterrupted_run(tiny, tmp_path):
    cfg = tl.LensConfig(steps=6, batch_size=3, lr=0.3, checkpoint_every=2, seed=3)
    corpus = SyntheticCorpus("train", offset=100)
    full = tl.train_lens(tiny, corpus, cfg).lens
    ck = tmp_path / "ck.pt"
    part = tl.train_lens(tiny, corpus, cfg, checkpoint=ck, stop_after=3)
    assert part.steps_done == 3 and ck.is_file()
    resumed = tl.train_lens(tiny, corpus, cfg, checkpoint=ck, resume=True)
    assert resumed.steps_done == 6
    for k, v in full.state_dict().items():
        assert torch.equal(resumed.lens.state_dict()[k], v), k
    assert resumed.lens.training_info["data"]["n_samples"] == 18
    with pytest.raises(tl.LensError, match="another configuration"):
        tl.train_lens(tiny, corpus, tl.LensConfig(steps=7, batch_size=3), checkpoint=ck, resume=True)


def test_position_selection_visual_text_answer(tiny):
    a = tiny.adapter
    ss = [scenes.make_sample("heldout", i) for i in (0, 1, 2)]
    inputs = a.prepare([s.image for s in ss], [s.question for s in ss])
    tr = capture(tiny, None, "", inputs=inputs, pattern_layers=[])
    masks = {g: tl.position_mask(a, tr, g) for g in tl.POSITION_SETS}
    for row in range(3):
        real = tr.attention_mask[row].bool()
        visual = torch.zeros_like(real)
        visual[tr.visual_positions[row]] = True
        assert torch.equal(masks["visual"][row], visual)
        assert torch.equal(masks["text"][row], real & ~visual)
        assert torch.equal(masks["all"][row], real)
        assert masks["answer"][row].nonzero().flatten().tolist() == [int(tr.answer_positions[row])]
    assert int(masks["visual"].sum()) == 3 * tr.visual_positions.shape[1]
    cfg = tl.LensConfig(steps=2, batch_size=2, positions="visual")
    r = tl.train_lens(tiny, SyntheticCorpus("train"), cfg)
    assert r.lens.training_info["data"]["n_tokens"] == 4 * tr.visual_positions.shape[1]
    ev = tl.evaluate_lens(tiny, r.lens, SyntheticCorpus("heldout"), 3, groups=("text", "visual", "answer"))
    assert ev.primary == "visual" and set(ev.layers[0]["by_positions"]) == {"text", "answer"}
    assert ev.layers[0]["readers"]["trained"].n_tokens == 3 * tr.visual_positions.shape[1]
    assert ev.layers[0]["by_positions"]["answer"]["identity"].n_tokens == 3
    # cross-attention models have no visual tokens in the stream
    coca = tiny_coca_float64()
    ctr = capture(coca, ss[0].image, ss[0].question, pattern_layers=[])
    assert not tl.position_mask(coca.adapter, ctr, "visual").any()
    with pytest.raises(tl.LensError, match="no visual tokens"):
        tl.train_lens(coca, SyntheticCorpus("train"), cfg)


def test_train_lens_cli_on_a_tiny_model(tiny, tmp_path):
    import argparse

    from core.cli import lens

    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    lens.add_command(sub, lambda args: tiny)
    out = tmp_path / "tiny-lens"
    args = p.parse_args(["train-lens", "--out", str(out), "--steps", "2", "--batch-size", "2", "--no-eval", "--quiet"])
    assert args.func(args) == 0
    lens = tl.load_lens(out, tiny)
    assert lens.training_info["steps_done"] == 2 and lens.form == "affine"
    args = p.parse_args(["train-lens", "--out", str(out), "--form", "lowrank", "--quiet"])
    with pytest.raises(tl.LensError, match="rank"):
        args.func(args)


# ---------------------------------------------------------------- the committed lenses


@pytest.fixture(scope="module", params=DEFAULTS)
def committed(request):
    loaded = load_model(request.param)
    lens = tl.load_lens(ROOT / "resources" / "models" / request.param / "tuned-lens", loaded)
    return request.param, loaded, lens


def _assert_bars(t: dict, rel: float, gap: float, x_l_kl: float) -> None:
    n = len(t["layer"]) - 1  # the last row reads x_L: identity = trained = the model's own distribution
    for i in range(n):
        assert t["trained"][i] <= rel * t["identity"][i] and t["identity"][i] - t["trained"][i] >= gap, (i, t)
        assert t["trained"][i] <= rel * t["random"][i] and t["random"][i] - t["trained"][i] >= gap, (i, t)
    for i in range(n + 1):
        assert t["trained"][i] <= rel * t["mean"][i] and t["mean"][i] - t["trained"][i] >= gap, (i, t)
    # KL at x_L, where every reader is the model up to rounding (float32 models and lenses)
    assert t["trained"][n] == pytest.approx(0.0, abs=x_l_kl) and t["identity"][n] == pytest.approx(0.0, abs=x_l_kl)


def test_committed_lens_meets_the_bars_on_held_out_scenes(committed):
    spec, loaded, lens = committed
    # the report's table: 1000 held-out scenes, all four readers, every layer
    heldout = lens.report["evaluations"]["heldout"]
    table = heldout["kl_tables"][heldout["positions"]]
    assert {"identity", "mean", "random", "trained"} <= set(table)
    assert lens.report["evaluations"]["heldout"]["data"]["n_samples"] == 1000
    assert {"shifted_more_objects", "alt_renderer"} <= set(lens.report["evaluations"])
    # Issue 6's bar is "below each baseline"; the margin asked here is stricter. 0.6x, not 0.5x:
    # the stage-2 shapes-llava computes relations in its last block, and there its lens reaches
    # 0.51x the identity (0.147 vs 0.286 bits).
    x_l_kl = last_layer_kl_tol(loaded.adapter, lens.A.dtype)
    _assert_bars(table, rel=0.6, gap=0.1, x_l_kl=x_l_kl)
    assert lens.training_info["seconds"] < 600 and lens.form == "affine"
    # a fresh modest held-out sample (scenes 1000-1063, not in the report's 0-999)
    ev = tl.evaluate_lens(loaded, lens, SyntheticCorpus("heldout", offset=1000), 64, groups=("text", "visual"))
    _assert_bars(ev.kl_table(), rel=0.6, gap=0.05, x_l_kl=x_l_kl)
    if spec == "shapes-llava":  # visual and text positions reported separately
        assert ev.kl_table("visual")["trained"][0] is not None and ev.kl_table("text")["trained"][0] is not None
    else:
        visual = ev.layers[0]["by_positions"]["visual"].values()  # no visual tokens in CoCa's text stream
        assert all(m.n_tokens == 0 and m.kl_bits is None for m in visual)


def test_eval_lens_cli_json_and_wrong_model(tmp_path, capsys):
    from core.cli import main

    lens_dir = ROOT / "resources" / "models" / "shapes-llava" / "tuned-lens"
    lines = []
    for i in range(3):
        s = scenes.make_sample("heldout", 2000 + i)
        Image.fromarray(s.image).save(tmp_path / f"im{i}.png")
        lines.append(json.dumps({"image": f"im{i}.png", "question": s.question}))
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "eval.json"
    argv = ["eval-lens", "--lens", str(lens_dir), "--pairs", str(tmp_path / "pairs.jsonl"), "--json", str(out)]
    assert main(["eval-lens", "--model", "shapes-llava", *argv[1:], "--quiet"]) == 0
    d = json.loads(out.read_text())
    assert d["schema_version"] == 1
    assert {"form", "rank", "parameters"} <= set(d["lens"]) and d["lens"]["form"] == "affine"
    assert d["data"]["n_samples"] == 3 and len(d["layers"]) == 5
    for row in d["layers"]:
        assert {"layer", "readers"} <= set(row)
        want = {"identity", "mean", "trained"} | ({"random"} if row["layer"] < 4 else set())
        assert want <= set(row["readers"])
        for m in row["readers"].values():
            assert {"kl_bits", "cross_entropy", "top1_agreement", "answer_rank_mean"} <= set(m)
    x_l_kl = last_layer_kl_tol(load_model("shapes-llava").adapter, torch.float32)
    assert d["layers"][-1]["readers"]["identity"]["kl_bits"] == pytest.approx(0.0, abs=x_l_kl)
    assert d["audit"][0]["method"] == "tuned lens"
    capsys.readouterr()
    assert main(["eval-lens", "--model", "shapes-coca", *argv[1:], "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "fingerprint" in err and "\n" not in err


def test_analyze_overlays_the_tuned_lens_in_its_own_capture(committed):
    """analyze(tuned=lens): the readers' rows come from the one capture of the
    analysis; a middle row is the lens's translator read through the final norm
    and unembedding, recomputed here from a separate capture."""
    spec, loaded, lens = committed
    from core.analyze import analyze

    s = scenes.make_sample("heldout", 7)
    result = analyze(loaded, s.image, s.question, foil=s.foil, tuned=lens).to_dict()
    t = result["target"]
    rows = result["tuned_lens"]["tuned lens"]
    assert [r["layer"] for r in rows] == [r["layer"] for r in result["logit_lens"]]
    # the last row reads x_L with the identity: the same numbers as the logit lens, up
    # to the product's order and a float32 rounding either side
    a = loaded.adapter
    x_L_error = reader_at_last_layer_tol(a, lens.A.dtype) + rounding_tol(logit_terms_bound(a), torch.float32, 2)
    assert rows[-1]["answer_logit"] == pytest.approx(result["logit_lens"][-1]["answer_logit"], abs=x_L_error)
    assert rows[-1]["kl_to_final"] == pytest.approx(0.0, abs=last_layer_kl_tol(a, lens.A.dtype) * math.log(2))
    trace = capture(loaded, Image.fromarray(s.image), s.question, pattern_layers=[])
    pos = int(trace.answer_positions[0])
    with torch.no_grad():
        x = trace.resid_pre[1][0, pos].to(lens.mean.dtype)
        want = lens_logits(loaded.adapter, lens.translate(1, x)).float()
        # two captures of one input, both eager: the same residual, read once per state
        # here and there, up to the product's order and a float32 rounding either side
        error = logits_error(a, lens.translate(1, x))
    assert rows[1]["answer_logit"] == pytest.approx(float(want[t["answer_id"]]), abs=error)
    assert rows[1]["answer_logit"] != pytest.approx(result["logit_lens"][1]["answer_logit"], abs=1e-3)  # it moved
    assert len(result["tuned_lens"]["tuned lens: random baseline"]) == len(rows) - 1
    assert any(a["method"] == "tuned lens" for a in result["audit"])
    from core.analyze import AnalyzeResult

    back = AnalyzeResult.from_dict(result)  # the typed readers hold every row, their reader named
    assert back.to_dict() == result and {r.reader for r in back.tuned_lens.readers["tuned lens"]} == {"trained"}


def test_the_lens_reads_through_a_post_ln_head(tmp_path):
    """BLIP's final norm is the LM head's own transform (not a norm dataclass):
    a fresh lens on it reads exactly what the logit lens reads, and trains."""
    from tests.core.exactness import noise_image
    from tests.core.test_blip import IMAGE_SIZE, PREFIX, tiny_blip_float64

    class NoiseCorpus:  # the tiny BLIP's vocabulary has no scene questions: its own prefix on noise
        def batch(self, step, batch_size):
            return tl.Batch(
                [noise_image(IMAGE_SIZE, seed=step * 10 + i) for i in range(batch_size)],
                [PREFIX] * batch_size,
                [None] * batch_size,
            )

        def describe(self):
            return {"source": "noise images"}

    m = tiny_blip_float64()
    m.fingerprint = "tiny-blip-test"
    tr = capture(m, noise_image(IMAGE_SIZE), PREFIX)
    pos = int(tr.answer_positions[0])
    answer = int(tr.logits[0, pos].argmax())
    lens = tl.TunedLens(tr.n_blocks, m.adapter.d_model, "affine", dtype=torch.float64)
    reference = logit_lens(m.adapter, tr, answer)
    rows = tl.tuned_lens_rows(lens, m.adapter, tr, answer)
    error = max(logits_error(m.adapter, x[0, pos]) for x in tr.resid_pre + [tr.final_resid])
    assert [r["answer_logit"] for r in rows] == pytest.approx([r.answer_logit for r in reference.rows], abs=error)
    trained = tl.train_lens(m, NoiseCorpus(), tl.LensConfig(steps=2, batch_size=2, lr=0.1))
    assert trained.steps_done == 2 and all(p.requires_grad for p in m.model.parameters())


@pytest.mark.parametrize("form", ["affine", "lowrank", "mlp"])
def test_one_layer_and_all_layers_translate_alike(form):
    """translate(l, x) is row l of translate_all, for any shape of x."""
    lens = tl.TunedLens(3, 8, form, rank=2, hidden=4, dtype=torch.float64)
    with torch.no_grad():
        for p in lens.parameters():
            p.normal_(generator=torch.Generator().manual_seed(p.numel()))
    xs = torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    every = lens.translate_all(xs)
    magnitude = copy.deepcopy(lens)
    with torch.no_grad():
        for p in magnitude.parameters():
            p.abs_()
    for layer in range(3):
        # the same translator batched or not: its products in another order (float64),
        # relative to its terms (the translator with |parameters| on |x|)
        terms = float(magnitude.translate(layer, xs[layer].abs()).detach().abs().max())
        tol = sum_tol(terms, 2 * 8 + 4 + 4, torch.float64)
        torch.testing.assert_close(lens.translate(layer, xs[layer]), every[layer], rtol=0, atol=tol)
        torch.testing.assert_close(lens.translate(layer, xs[layer, 0]), every[layer, 0], rtol=0, atol=tol)
    assert not torch.allclose(every, xs)  # the translators did something
    assert torch.equal(lens.translate(3, xs[0]), xs[0])  # x_L is read as it is
