"""Region counterfactuals (core/methods/counterfactual.py): each fill's exact
properties, the answer effect against a direct forward, the routing read-outs
against manual recomputation, the sweep against one-by-one edits, the CLI's
JSON, and a small version of the target-versus-distractor bar."""

import functools
import json

import numpy as np
import pytest
import torch
from PIL import Image

from core import load_model
from core.cli import main
from core.forward.capture import capture
from core.forward.geometry import VisualToken
from core.methods.contributions import source_contributions
from core.methods.counterfactual import (
    INTERPOLATED_FLAG,
    Fill,
    RegionError,
    answer_numbers,
    fill_region,
    gaussian_blur,
    harmonic_inpaint,
    mask_from_box,
    mask_from_png,
    mask_from_polygon,
    mask_from_scene_object,
    object_fill_effects,
    occlusion_sweep,
    overlap_weights,
    pearson,
    region_agreement,
    region_counterfactual,
    spearman,
    sweep_cells,
)
from core.methods.patterns import rollout
from core.models.loading import resources_dir
from core.zoo import scenes
from core.zoo.distractor_scenes import scenes_with_distractor
from tests.core.exactness import forwards_tol
from tests.core.test_capture_coca import tiny_coca_float64 as _tiny_coca
from tests.core.test_capture_llava import tiny_llava_float64 as _tiny_llava
from tests.tolerances import sum_tol

SAMPLES = resources_dir() / "samples"
tiny_llava_float64 = functools.cache(_tiny_llava)  # built once per module: nothing here changes the weights
tiny_coca_float64 = functools.cache(_tiny_coca)


@pytest.fixture(scope="module")
def sample():
    return scenes_with_distractor("heldout", 2)[1]


def n_keys(adapter, inputs) -> int:
    """The longest key axis of a forward: the sequence, or the visual tokens a cross block reads."""
    return max(inputs.input_ids.shape[1], len(adapter.visual_tokens((128, 128))))


@pytest.fixture(scope="module", params=["tiny-llava", "tiny-coca"])
def tiny(request):
    return tiny_llava_float64() if request.param == "tiny-llava" else tiny_coca_float64()


# ---------------------------------------------------------------- regions and fills


def test_mask_helpers():
    m = mask_from_box((10, 8), [2, 1, 5, 4])
    assert m.shape == (8, 10) and m.sum() == 9 and m[1:4, 2:5].all()
    tri = mask_from_polygon((20, 20), [(2, 2), (17, 2), (2, 17)])
    assert tri[3, 3] and not tri[16, 16] and tri.shape == (20, 20)
    s = scenes.make_sample("heldout", 5)
    om = mask_from_scene_object(s, 0)
    assert om.dtype == bool and np.array_equal(om, s.objects[0].mask) and om is not s.objects[0].mask


def test_mask_png_white_is_region_and_size_mismatch_is_one_line(tmp_path):
    arr = np.zeros((12, 16), np.uint8)
    arr[2:5, 3:9] = 255
    Image.fromarray(arr).save(tmp_path / "m.png")
    m = mask_from_png(tmp_path / "m.png", (16, 12))
    assert m.sum() == 18 and m[2:5, 3:9].all()
    with pytest.raises(RegionError) as e:
        mask_from_png(tmp_path / "m.png", (16, 13))
    assert "16x12" in str(e.value) and "16x13" in str(e.value) and "\n" not in str(e.value)
    Image.fromarray(np.zeros((12, 16), np.uint8)).save(tmp_path / "empty.png")
    with pytest.raises(RegionError, match="no pixel"):
        mask_from_png(tmp_path / "empty.png", (16, 12))


@pytest.fixture(scope="module")
def img_and_mask():
    s = scenes.make_sample("heldout", 7)
    return s.image, s.objects[0].mask


def test_mean_fill_sets_the_image_mean_and_leaves_the_rest_bit_identical(img_and_mask):
    img, m = img_and_mask
    out = fill_region(img, m, "mean")
    mean = np.rint(img.reshape(-1, 3).astype(np.float64).mean(0)).astype(np.uint8)
    assert (out[m] == mean).all()
    assert np.array_equal(out[~m], img[~m]) and out.dtype == np.uint8
    const = fill_region(img, m, "constant", color=(1, 2, 3))
    assert (const[m] == [1, 2, 3]).all() and np.array_equal(const[~m], img[~m])


@pytest.mark.parametrize("kind", ["blur", "noise", "inpaint"])
def test_blur_noise_inpaint_change_only_the_region(img_and_mask, kind):
    img, m = img_and_mask
    out = fill_region(img, m, kind)
    assert np.array_equal(out[~m], img[~m])
    assert not np.array_equal(out[m], img[m])


def test_blur_is_the_whole_image_gaussian_inside_the_region(img_and_mask):
    img, m = img_and_mask
    out = fill_region(img, m, "blur", radius=2.5)
    full = np.clip(np.rint(gaussian_blur(img, 2.5)), 0, 255).astype(np.uint8)
    assert np.array_equal(out[m], full[m])
    # a region touching the image edge: the mirrored crop is still exact
    edge = mask_from_box((128, 128), [0, 0, 20, 9])
    assert np.array_equal(fill_region(img, edge, "blur", radius=3)[edge], np.rint(gaussian_blur(img, 3))[edge])


def test_noise_is_seeded(img_and_mask):
    img, m = img_and_mask
    a, b = fill_region(img, m, "noise", seed=3), fill_region(img, m, "noise", seed=3)
    c = fill_region(img, m, "noise", seed=4)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_inpaint_is_harmonic_and_reproduces_a_linear_ramp():
    h, w = 40, 50
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    ramp = np.stack([2 * xx + 10, yy * 3 + 5, 0.5 * xx + yy], -1)
    hole = mask_from_box((w, h), [10, 8, 35, 30])
    filled = harmonic_inpaint(ramp, hole, tol=1e-10)
    np.testing.assert_allclose(filled[hole], ramp[hole], atol=1e-6)  # the iterative solver's accuracy at tol=1e-10
    # on a noisy image: every region pixel is the mean of its four neighbours
    rng = np.random.default_rng(0)
    noisy = rng.uniform(0, 255, (h, w, 3))
    f = harmonic_inpaint(noisy, hole, tol=1e-10)
    ys, xs = np.nonzero(hole)
    nb = (f[ys - 1, xs] + f[ys + 1, xs] + f[ys, xs - 1] + f[ys, xs + 1]) / 4
    np.testing.assert_allclose(f[ys, xs], nb, atol=1e-6)
    assert np.array_equal(f[~hole], noisy[~hole])


def test_paste_copies_the_other_images_region_resized(img_and_mask):
    img, m = img_and_mask
    other = scenes.make_sample("heldout", 8).image
    out = fill_region(img, m, "paste", paste_from=other)
    assert np.array_equal(out[m], other[m]) and np.array_equal(out[~m], img[~m])
    big = np.asarray(Image.fromarray(other).resize((256, 200)))
    resized = np.asarray(Image.fromarray(big).resize((128, 128), Image.BILINEAR))
    assert np.array_equal(fill_region(img, m, "paste", paste_from=big)[m], resized[m])


def test_bad_fills_are_region_errors(img_and_mask):
    img, m = img_and_mask
    with pytest.raises(RegionError, match="unknown fill"):
        Fill("smudge")
    with pytest.raises(RegionError, match="paste"):
        Fill("paste")
    with pytest.raises(RegionError, match="must match"):
        fill_region(img, m[:-1], "mean")


# ---------------------------------------------------------------- geometry of the routing weights


def test_overlap_weights_equal_brute_force_area_on_fractional_boxes():
    a = tiny_llava_float64().adapter
    size = (200, 150)  # resize + centre crop: boxes have fractional pixel edges
    tokens = a.visual_tokens(size)
    assert any(t.box[0] != int(t.box[0]) for t in tokens)
    mask = mask_from_polygon(size, [(20, 10), (180, 40), (90, 140)])
    w = overlap_weights(tokens + [VisualToken(99, None, 0, -1, -1, [0, 0, 200, 150])], mask)
    ss = 8  # each pixel sampled 8 x 8 times: exact for boxes on 1/8-pixel edges, close otherwise
    fine = np.kron(mask, np.ones((ss, ss)))
    for i, t in enumerate(tokens):
        x0, y0, x1, y1 = t.box
        # sub-samples whose centre (j + 0.5) / ss lies in [x0, x1) x [y0, y1)
        ix0, ix1, iy0, iy1 = (max(0, int(np.ceil(v * ss - 0.5))) for v in (x0, x1, y0, y1))
        covered = fine[iy0:iy1, ix0:ix1].sum() / ss**2
        assert w[i] == pytest.approx(covered / ((x1 - x0) * (y1 - y0)), abs=0.02)  # the 8 x 8 sampling's error
    assert w[-1] == 0  # no patch of its own


# ---------------------------------------------------------------- answer effect and routing on tiny models


def test_answer_effect_equals_direct_forward(tiny, sample):
    a = tiny.adapter
    m = sample.objects[sample.target].mask
    r = region_counterfactual(tiny, sample.image, sample.question, m, "mean", answer=sample.answer, foil=sample.foil)
    edited = fill_region(sample.image, m, "mean")
    assert np.array_equal(r.edited_image, edited)
    with torch.no_grad():
        inputs = a.prepare([sample.image], [sample.question])
        z0 = a.next_token_logits(inputs)[0].double()
        z1 = a.next_token_logits(a.prepare([edited], [sample.question]))[0].double()
    ai, fi = a.token_id(sample.answer), a.token_id(sample.foil)
    # the counterfactual runs both images as one batch: each logit as far as two
    # forwards may be apart; a probability moves by at most p * 2 max |dz|
    logit = forwards_tol(a, torch.cat([z0, z1]), n_keys(a, inputs))
    for got, z in ((r.original, z0), (r.edited, z1)):
        p = float(z.softmax(-1)[ai])
        prob = 2 * p * logit + sum_tol(p, z.shape[0], z.dtype)
        assert got.logit == pytest.approx(float(z[ai]), abs=logit)
        assert got.logit_diff == pytest.approx(float(z[ai] - z[fi]), abs=2 * logit)
        assert got.prob == pytest.approx(p, abs=prob)
        assert got.predicted_id == int(z.argmax())
    assert r.effect.logit_diff_change == pytest.approx(float((z1[ai] - z1[fi]) - (z0[ai] - z0[fi])), abs=4 * logit)
    prob = 2 * (float(z0.softmax(-1)[ai]) + float(z1.softmax(-1)[ai])) * logit + sum_tol(1.0, z0.shape[0], z0.dtype)
    assert r.effect.prob_change == pytest.approx(float(z1.softmax(-1)[ai] - z0.softmax(-1)[ai]), abs=prob)
    assert r.effect.flipped == (int(z1.argmax()) != int(z0.argmax()))
    assert r.mask_area_px == int(m.sum())
    assert r.audit[0].method == "region counterfactual"


def test_routing_equals_manual_computation(tiny, sample):
    a = tiny.adapter
    m = sample.objects[sample.target].mask
    ai, fi = a.token_id(sample.answer), a.token_id(sample.foil)
    r = region_counterfactual(tiny, sample.image, sample.question, m, "mean", answer=ai, foil=fi)
    n = a.prepare([sample.image], [sample.question]).input_ids.shape[1]
    tr = capture(tiny, sample.image, sample.question, query_positions=range(n))
    pos = int(tr.answer_positions[0])
    tokens = a.visual_tokens((128, 128))
    # manual weights: patch boxes are whole 16 px squares here
    w = np.array([m[int(t.box[1]) : int(t.box[3]), int(t.box[0]) : int(t.box[2])].mean() for t in tokens])
    sc = source_contributions(a, tr, ai, fi)
    vis = tr.visual_positions[0]
    expected_mass, dla = [], 0.0
    dla_keys, dla_count = [], 0
    for b in range(tr.n_blocks):
        if tr.block_kinds[b] == "cross":
            keys = torch.arange(len(tokens))
        elif vis.numel():
            keys = vis
        else:
            dla_keys.append(torch.zeros(0, dtype=torch.long))
            continue
        dla_keys.append(keys)
        dla_count += a.n_heads * len(keys)
        pat = tr.patterns[b][0, :, pos, keys].double().numpy()  # (heads, tokens)
        expected_mass += list(pat @ w)
        dla += float(sc.dla_frozen[b][:, keys].double().sum(0).numpy() @ w)
    # the same capture's numbers, weighted and summed here in another order (float64)
    got = [x.mass for x in r.routing.attention_mass]
    np.testing.assert_allclose(got, expected_mass, atol=sum_tol(1.0, len(tokens), torch.float64))
    dla_terms = sum(float(d.abs().double().sum(0)[k].numpy() @ w) for d, k in zip(sc.dla_frozen, dla_keys) if len(k))
    assert r.routing.dla_through_region == pytest.approx(dla, abs=sum_tol(dla_terms, dla_count, torch.float64))
    R = rollout(tr, 0.5)[pos].double()
    nodes = vis if vis.numel() else torch.arange(n, R.shape[0])
    # the routing's rollout was fed block by block during its capture (RolloutStream), this one is the
    # product of full patterns: both float32, summed in other orders (one node-long sum per block)
    tol = sum_tol(1.0, tr.n_blocks * R.shape[0] + len(w), torch.float32)
    assert r.routing.rollout_mass == pytest.approx(float(R[nodes].numpy() @ w), abs=tol)
    assert {x["index"] for x in r.routing.token_weights} == set(np.nonzero(w)[0].tolist())
    assert {a_.method for a_ in r.audit} >= {"pattern analysis", "rollout / flow", "source contribution"}


@torch.no_grad()
def test_sweep_map_equals_one_by_one_edits(tiny, sample):
    a = tiny.adapter
    ai, fi = a.token_id(sample.answer), a.token_id(sample.foil)
    for k in (1, 3):
        sw = occlusion_sweep(tiny, sample.image, sample.question, k=k, answer=ai, foil=fi, batch_size=5)
        rows = -(-8 // k)
        assert sw.logit_diff_change.shape == (rows, rows) and sw.complete
        cells = sweep_cells(a.visual_tokens((128, 128)), (128, 128), k)
        inputs = a.prepare([sample.image], [sample.question])
        z0 = a.next_token_logits(inputs)[0].double()
        for idx in (0, len(cells) // 2, len(cells) - 1):
            c = cells[idx]
            z = a.next_token_logits(a.prepare([fill_region(sample.image, c["mask"], "mean")], [sample.question]))[0]
            z = z.double()
            # batches of 5 against single runs: each logit as far as two forwards may be apart
            logit = forwards_tol(a, torch.cat([z0, z]), n_keys(a, inputs))
            want = float((z[ai] - z[fi]) - (z0[ai] - z0[fi]))
            assert sw.logit_diff_change[c["row"], c["col"]] == pytest.approx(want, abs=4 * logit)
            assert sw.logit_change[c["row"], c["col"]] == pytest.approx(float(z[ai] - z0[ai]), abs=2 * logit)
        # the last cell of k = 3 on an 8 x 8 grid holds 2 x 2 patches
        if k == 3:
            assert len(cells[-1]["patches"]) == 4 and cells[-1]["mask"].sum() == 32 * 32
    assert sw.to_dict()["sweep"]["granularity"].startswith("patch grid")


def test_interpolated_map_only_on_request_and_always_flagged(sample):
    tiny = tiny_coca_float64()
    sw = occlusion_sweep(tiny, sample.image, sample.question, k=2, answer=sample.answer, foil=sample.foil)
    d = sw.to_dict()
    assert "interpolated_map" not in d and "interpolated" not in json.dumps(d["sweep"]).replace("not interpolated", "")
    im = sw.interpolated()
    assert im.interpolated == INTERPOLATED_FLAG and im.values.shape == (128, 128)
    assert im.to_dict()["interpolated"] == "visual smoothing, not a causal pixel mask"
    assert sw.to_dict(interpolated=True)["interpolated_map"]["interpolated"] == INTERPOLATED_FLAG


def test_region_agreement_reports_the_correlations_of_its_rows(sample):
    tiny = tiny_llava_float64()
    cells = sweep_cells(tiny.adapter.visual_tokens((128, 128)), (128, 128), 2)
    regions = {f"cell{c['row']}{c['col']}": c["mask"] for c in cells}
    regions.update({o.name: o.mask for o in sample.objects})
    ag = region_agreement(tiny, sample.image, sample.question, regions, answer=sample.answer, foil=sample.foil)
    assert len(ag.rows) == len(regions) and len(ag.disagreements) == 3
    mass, drop = [r.attention_mass for r in ag.rows], [r.drop for r in ag.rows]
    assert ag.correlations["attention_mass"]["spearman"] == pytest.approx(spearman(mass, drop))
    assert ag.correlations["attention_mass"]["pearson"] == pytest.approx(pearson(mass, drop))
    assert all(r.drop == pytest.approx(-r.effect.logit_diff_change) for r in ag.rows)
    gaps = [abs(d["rank_gap"]) for d in ag.disagreements]
    assert gaps == sorted(gaps, reverse=True)
    json.dumps(ag.to_dict(), allow_nan=False)


def test_rank_correlations_by_hand():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)
    # ties get averaged ranks: ranks (0.5, 0.5, 2, 3) against (0, 1, 2, 3)
    assert spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(
        float(np.corrcoef([0.5, 0.5, 2, 3], [0, 1, 2, 3])[0, 1])
    )
    assert pearson([1, 1, 1], [1, 2, 3]) is None


def test_answer_numbers_without_a_foil():
    a = tiny_llava_float64().adapter
    z = torch.zeros(a.W_U.shape[1], dtype=torch.float64)
    z[5] = 2.0
    n = answer_numbers(a, z, 5, None)
    assert n.logit == 2.0 and n.logit_diff is None and n.predicted_id == 5


# ---------------------------------------------------------------- CLI


DESIGN_KEYS = {"schema_version", "fill", "mask_area_px", "original", "edited", "effect", "routing", "audit"}
NUMBER_KEYS = {"answer", "answer_id", "foil", "foil_id", "logit", "logit_diff", "prob", "predicted"}


def test_cli_json_has_every_design_field(tmp_path):
    out = tmp_path / "cf.json"
    args = ["counterfactual", "--model", "shapes-coca", "--image", str(SAMPLES / "sample_00.png")]
    args += ["--question", "what shape is the blue object?", "--mask", str(SAMPLES / "sample_00_obj1.png")]
    assert main([*args, "--fill", "inpaint", "--answer", "square", "--foil", "triangle", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert DESIGN_KEYS <= set(d) and d["schema_version"] == 1 and d["fill"] == "inpaint"
    assert NUMBER_KEYS <= set(d["original"]) and NUMBER_KEYS <= set(d["edited"])
    assert d["original"]["answer"] == d["edited"]["answer"] == "square"
    assert {"logit_diff_change", "prob_change", "flipped"} <= set(d["effect"])
    assert {"attention_mass", "rollout_mass", "dla_through_region"} <= set(d["routing"])
    assert {"layer", "head", "mass"} <= set(d["routing"]["attention_mass"][0])
    assert d["mask_area_px"] == int((np.asarray(Image.open(SAMPLES / "sample_00_obj1.png")) >= 128).sum())
    assert {"method", "question", "operation", "controls", "supports", "cannot_support", "parameters"} <= set(
        d["audit"][0]
    )
    assert d["effect"]["logit_diff_change"] == d["edited"]["logit_diff"] - d["original"]["logit_diff"]  # as computed
    sweep = tmp_path / "sw.json"
    assert main([*args[:5], "--question", "what?", "--sweep", "4", "--interpolated", "--json", str(sweep)]) == 0
    s = json.loads(sweep.read_text())
    assert s["sweep"]["grid_shape"] == [2, 2] and s["interpolated_map"]["interpolated"] == INTERPOLATED_FLAG


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    Image.new("L", (100, 128), 255).save(tmp_path / "bad.png")
    base = ["counterfactual", "--model", "shapes-coca", "--image", str(SAMPLES / "sample_00.png"), "--question", "q"]
    for extra, needle in [
        (["--mask", str(tmp_path / "bad.png")], "100x128"),
        (["--mask", str(SAMPLES / "sample_00_obj1.png"), "--fill", "paste"], "--paste-from"),
        ([], "--mask"),
    ]:
        assert main([*base, *extra, "--json", str(tmp_path / "o.json")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and needle in err[0]
    assert not (tmp_path / "o.json").exists()


# ---------------------------------------------------------------- the target-versus-distractor bar, small


def test_target_fill_hurts_the_answer_more_than_a_distractor_fill_on_shapes_coca():
    """Issue 4 bar #1 at 40 scenes (bench/counterfactual_bars.py runs 500 and
    measures 0.986 for shapes-coca), relation questions included."""
    m = load_model("shapes-coca")
    res = object_fill_effects(m, scenes_with_distractor("heldout", 40), "mean")
    s = res.summary()
    assert s["n"] == 40
    assert s["median_target_drop"] > 0 and s["median_target_drop"] >= 3 * s["median_distractor_drop"]
    assert s["median_abs_target_change"] >= 3 * s["median_abs_distractor_change"]
    relations = res.summary([r for r in res.rows if r["kind"] == "relation"])
    assert relations["n"] >= 5 and relations["share_target_fill_lowers_logit_diff"] >= 0.9
    assert s["share_target_fill_lowers_logit_diff"] >= 0.95
    json.dumps(res.to_dict(), allow_nan=False)
