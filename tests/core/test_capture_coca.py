"""Capture on CoCa: the replay from canonical weights equals open_clip's own
forward, and its patterns equal nn.MultiheadAttention's weights."""

import pytest
import torch
from PIL import Image

from core import load_model
from core.capture import capture
from core.methods.logit_lens import logit_lens
from core.methods.residual import component_stack, decompose, target_direction
from core.models.loading import LoadedModel
from core.zoo import scenes


def tiny_coca_float64() -> LoadedModel:
    """A random open_clip CoCa from a tiny config, float64, with the default model's tokenizer and transform."""
    from open_clip.coca_model import CoCa

    from core.models.families.coca import CocaAdapter

    shipped = load_model("shapes-coca")
    vocab = shipped.adapter.W_U.shape[1]
    torch.manual_seed(0)
    model = CoCa(
        embed_dim=16,
        multimodal_cfg={
            "context_length": 32,
            "vocab_size": vocab,
            "width": 32,
            "heads": 4,
            "layers": 2,
            "mlp_ratio": 2,
        },
        text_cfg={
            "context_length": 32,
            "vocab_size": vocab,
            "width": 32,
            "heads": 4,
            "layers": 1,
            "embed_cls": True,
            "output_tokens": True,
            "pad_id": 0,
            "mlp_ratio": 2,
        },
        vision_cfg={
            "image_size": 128,
            "patch_size": 16,
            "width": 32,
            "layers": 1,
            "head_width": 8,
            "attentional_pool": False,
            "output_tokens": True,
        },
        pad_id=0,
    )
    torch.nn.init.normal_(model.text_decoder.text_projection, std=0.2)
    model = model.double().eval()
    adapter = CocaAdapter(model, shipped.processor, shipped.tokenizer, shipped.adapter.config)
    return LoadedModel("tiny-coca", "coca", model, shipped.processor, shipped.tokenizer, adapter)


@pytest.fixture(scope="module", params=["tiny-float64", "shapes-coca"])
def case(request):
    m = tiny_coca_float64() if request.param == "tiny-float64" else load_model("shapes-coca")
    s = scenes.make_sample("heldout", 3)
    tr = capture(
        m,
        s.image,
        s.question,
        query_positions=range(m.adapter.prepare([Image.fromarray(s.image)], [s.question]).input_ids.shape[1]),
    )
    tol = 1e-9 if request.param == "tiny-float64" else 1e-4
    return m, tr, tol, s


def test_replay_equals_open_clip_forward(case):
    m, tr, tol, s = case
    inputs = m.adapter.prepare([Image.fromarray(s.image)], [s.question])
    with torch.no_grad():
        library = m.model(inputs.tensors["image"], inputs.tensors["text"], output_labels=False)["logits"]
    torch.testing.assert_close(tr.logits, library, atol=tol * 10, rtol=0)
    assert tr.block_names[-1] == f"L{m.adapter.n_layers - 1}.xattn" and tr.block_kinds[-1] == "cross"


def test_patterns_equal_multihead_attention_weights(case):
    m, tr, tol, s = case
    a = m.adapter
    for block, kind in enumerate(tr.block_kinds):
        module = a._block(block)
        q_in = module.ln_1(tr.resid_pre[block])
        kv = module.ln_1_kv(tr.kv_source[block]) if kind == "cross" else q_in
        n = q_in.shape[1]
        mask = None if kind == "cross" else torch.full((n, n), float("-inf"), dtype=q_in.dtype).triu(1)
        with torch.no_grad():
            _, weights = module.attn(q_in, kv, kv, need_weights=True, average_attn_weights=False, attn_mask=mask)
        torch.testing.assert_close(tr.patterns[block], weights, atol=max(tol, 1e-6), rtol=0)


def test_reconstruction_dla_and_lens(case):
    m, tr, tol, s = case
    a = m.adapter
    a_id, f_id = a.token_id(s.answer), a.token_id(s.foil)
    r = decompose(a, tr, a_id, f_id)
    assert r.reconstruction_max_abs_err < tol * 10
    assert sum(c.dla_frozen for c in r.components) == pytest.approx(r.frozen_sum_expected, abs=tol * 10)
    p = r.position
    assert r.target_logit == pytest.approx(float(tr.logits[0, p, a_id] - tr.logits[0, p, f_id]), abs=tol * 10)
    names, C = component_stack(a, tr, p)
    assert any(n.endswith(".xattn.H0") for n in names) and names[0] == "embed"
    u, x_L = target_direction(a, a_id, f_id).detach(), tr.final_resid[0, p]
    norm_f = a.final_norm_layer()
    for i in (1, len(names) // 2, len(names) - 1):
        _, d = torch.autograd.functional.jvp(lambda x: norm_f(x) @ u, x_L, C[i])
        assert r.components[i].dla_jacobian == pytest.approx(float(d), abs=max(tol, 1e-5 * abs(float(d))))
    lens = logit_lens(a, tr, a_id, f_id)
    assert lens.rows[-1].kl_to_final == pytest.approx(0, abs=1e-6)
    assert len(lens.rows) == len(tr.block_names) + 1


def test_cross_attention_contributions_sum_to_head_terms(case):
    from core.methods.contributions import source_contributions

    m, tr, tol, s = case
    a = m.adapter
    a_id = a.token_id(s.answer)
    sc = source_contributions(a, tr, a_id)
    r = decompose(a, tr, a_id)
    by_name = {c.name: c for c in r.components}
    for block, name in enumerate(tr.block_names):
        if tr.block_kinds[block] == "cross":
            assert sc.projection[block].shape[-1] == 64, "sources are the 8x8 visual tokens"
        for h in range(a.n_heads):
            assert float(sc.dla_frozen[block][h].sum()) == pytest.approx(
                by_name[f"{name}.H{h}"].dla_frozen, abs=max(tol, 1e-5)
            )


def test_analyze_runs_on_coca_with_cross_attention_rows(tmp_path):
    import json

    from core.cli import main
    from core.models.loading import resources_dir

    out = tmp_path / "coca.json"
    sample = resources_dir() / "samples" / "sample_00.png"
    assert (
        main(
            [
                "analyze",
                "--model",
                "shapes-coca",
                "--image",
                str(sample),
                "--question",
                "what shape is the blue object?",
                "--json",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    cross = [h for h in result["attention"] if h["block"].endswith(".xattn")]
    assert cross and all(h["visual_mass"] == pytest.approx(1.0, abs=1e-5) and h["bos_mass"] == 0 for h in cross)
    assert all(h["visual_mass"] == 0 for h in result["attention"] if not h["block"].endswith(".xattn"))
    assert result["input"]["visual_tokens"][0]["position"] is None
    mass = sum(map(sum, result["rollout"]["visual_patch_mass"]))
    assert 0 < mass <= 1 + 1e-5
