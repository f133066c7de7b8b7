"""Capture on CoCa: the replay from canonical weights equals open_clip's own
forward, and its patterns equal nn.MultiheadAttention's weights."""

import pytest
import torch
from PIL import Image

from core import load_model
from core.forward.capture import capture
from core.methods.logit_lens import logit_lens
from core.methods.residual import component_stack, decompose
from core.models.loading import LoadedModel
from core.zoo import scenes
from tests.core.exactness import (
    assert_decomposition_is_exact,
    assert_jacobian_dla_is_autograd,
    assert_recomputed_rows_are_eager,
    assert_source_contributions_sum_to_each_heads_terms,
    forwards_tol,
    norm_replay_tol,
    pattern_rtol,
    scores_tol,
)
from tests.tolerances import sum_tol


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
        keep_attn_out=True,
    )
    return m, tr, s


def test_replay_equals_open_clip_forward(case):
    """The replay and open_clip (fused LayerNorm, nn.MultiheadAttention) are two
    forwards of one model: equal as far as two summation orders may differ."""
    m, tr, s = case
    inputs = m.adapter.prepare([Image.fromarray(s.image)], [s.question])
    with torch.no_grad():
        library = m.model(inputs.tensors["image"], inputs.tensors["text"], output_labels=False)["logits"]
    n_keys = max(tr.input_ids.shape[1], tr.kv_source[-1].shape[1])
    torch.testing.assert_close(tr.logits, library, atol=forwards_tol(m.adapter, library, n_keys), rtol=0)
    assert tr.block_names[-1] == f"L{m.adapter.n_layers - 1}.xattn" and tr.block_kinds[-1] == "cross"


def test_recomputed_rows_equal_eager_attention(case):
    """CoCa's replay computes its pattern whatever the attention option: an sdpa and an eager capture agree bitwise."""
    m, _, s = case
    assert_recomputed_rows_are_eager(m, m.adapter.prepare([Image.fromarray(s.image)], [s.question]))


def test_patterns_equal_multihead_attention_weights(case):
    """Up to the scores' summation orders, the LayerNorm kernels (the replay's
    Norm against the library's fused one) and the softmax, relative to each weight."""
    m, tr, s = case
    a = m.adapter
    for block, kind in enumerate(tr.block_kinds):
        module = a._block(block)
        q_in = module.ln_1(tr.resid_pre[block])
        kv = module.ln_1_kv(tr.kv_source[block]) if kind == "cross" else q_in
        n = q_in.shape[1]
        mask = None if kind == "cross" else torch.full((n, n), float("-inf"), dtype=q_in.dtype).triu(1)
        with torch.no_grad():
            _, weights = module.attn(q_in, kv, kv, need_weights=True, average_attn_weights=False, attn_mask=mask)
            x, src = q_in[0], kv[0]
            q = torch.einsum("pm,hmd->hpd", x, a.W_Q(block)) + a.b_Q(block)[:, None]
            k = torch.einsum("pm,hmd->hpd", src, a.W_K(block)) + a.b_K(block)[:, None]
            scores = (q @ k.transpose(-1, -2)) * a.score_scale(block)
            if mask is not None:
                scores = scores + mask
            input_rtol = norm_replay_tol(a.attn_norm(block), 1.0, x.dtype)
            error = scores_tol(
                x, src, a.W_Q(block), a.b_Q(block), a.W_K(block), a.b_K(block), a.score_scale(block), False, input_rtol
            )
            rtol = pattern_rtol(a, tr, scores, error)
        torch.testing.assert_close(tr.patterns[block], weights, atol=0, rtol=rtol)


def test_reconstruction_dla_and_lens(case):
    m, tr, s = case
    a = m.adapter
    a_id, f_id = a.token_id(s.answer), a.token_id(s.foil)
    r = assert_decomposition_is_exact(a, tr, a_id, f_id)
    names, _ = component_stack(a, tr, r.position)
    assert any(n.endswith(".xattn.H0") for n in names) and names[0] == "embed"
    assert_jacobian_dla_is_autograd(a, tr, a_id, f_id, which=(1, len(names) // 2, len(names) - 1))
    lens = logit_lens(a, tr, a_id, f_id)
    assert lens.rows[-1].kl_to_final == 0.0  # the final distribution is that row
    assert len(lens.rows) == len(tr.block_names) + 1


def test_cross_attention_contributions_sum_to_head_terms(case):
    from core.methods.contributions import source_contributions

    m, tr, s = case
    a = m.adapter
    a_id = a.token_id(s.answer)
    sc = source_contributions(a, tr, a_id)
    for block in range(tr.n_blocks):
        if tr.block_kinds[block] == "cross":
            assert sc.projection[block].shape[-1] == 64, "sources are the 8x8 visual tokens"
    assert_source_contributions_sum_to_each_heads_terms(a, tr, sc, decompose(a, tr, a_id))


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
    # a cross head reads only the 64 visual tokens: its weights sum to 1 up to the
    # float32 softmax's 64-key sum and the read-out's own sum
    n_vis = len(result["input"]["visual_tokens"])
    one = sum_tol(1.0, 2 * n_vis + 4, torch.float32)
    assert cross and all(h["visual_mass"] == pytest.approx(1.0, abs=one) and h["bos_mass"] == 0 for h in cross)
    assert all(h["visual_mass"] == 0 for h in result["attention"] if not h["block"].endswith(".xattn"))
    assert result["input"]["visual_tokens"][0]["position"] is None
    mass = sum(map(sum, result["rollout"]["visual_patch_mass"]))
    # rollout rows are products of row-stochastic float32 matrices: sums reach 1 up to
    # each block's (nodes + heads)-term products
    n_nodes = len(result["input"]["input_ids"]) + n_vis
    n_blocks = len({h["block"] for h in result["attention"]})
    assert 0 < mass <= 1 + sum_tol(1.0, n_blocks * (2 * n_nodes + 8), torch.float32)
