"""QK / OV read-outs checked against independent computations: the model's
own pre-softmax scores (q and k recorded inside its eager attention), its
eager patterns, dense SVDs, and the model's own modules for the OV write."""

import pytest
import torch
from PIL import Image

from core import load_model
from core.capture import capture
from core.methods.qk_ov import copying_score, model_scores, ov_circuit, qk_circuit, realized_scores
from core.zoo import scenes
from tests.core.exactness import noise_image
from tests.core.test_capture_coca import tiny_coca_float64
from tests.core.test_capture_llava import tiny_llava_float64
from tests.core.test_qwen2_vl import IMAGE_SIZE, QUESTION, tiny_qwen_float64

CASES = ["tiny-llava", "shapes-llava", "tiny-qwen2_vl", "tiny-qwen2_5_vl", "tiny-coca", "shapes-coca"]


def _build(name):
    if name == "tiny-llava":
        return tiny_llava_float64(), 1e-10
    if name.startswith("tiny-qwen"):
        kind = name.removeprefix("tiny-")
        return tiny_qwen_float64(kind, kind == "qwen2_5_vl"), 1e-10
    if name == "tiny-coca":
        return tiny_coca_float64(), 1e-9
    return load_model(name), 1e-4


@pytest.fixture(scope="module", params=CASES)
def traced(request):
    m, tol = _build(request.param)
    if request.param.startswith("tiny-qwen"):
        image, question = noise_image(IMAGE_SIZE), QUESTION
    else:
        s = scenes.make_sample("heldout", 6)
        image, question = Image.fromarray(s.image), s.question
    n = m.adapter.prepare([image], [question]).input_ids.shape[1]
    tr = capture(m, image, question, query_positions=range(n), keep_qk=True)
    return m, tr, tol


def test_realized_scores_equal_the_models_pre_softmax_scores(traced):
    m, tr, tol = traced
    for block in range(tr.n_blocks):
        ours = realized_scores(m.adapter, tr, block)
        theirs = model_scores(tr, block)
        scale = max(1.0, float(theirs.abs().max()))
        torch.testing.assert_close(ours.scores, theirs, atol=tol * scale, rtol=0)
        assert ours.level == "activation" and ours.audit.method == "qk/ov circuit"


def test_realized_patterns_equal_eager_patterns(traced):
    m, tr, tol = traced
    for block in range(tr.n_blocks):
        ours = realized_scores(m.adapter, tr, block).pattern
        torch.testing.assert_close(ours, tr.patterns[block][0].to(ours.dtype), atol=max(tol, 1e-6), rtol=0)


def test_qk_and_ov_factored_svd_match_dense(traced):
    m, _, _ = traced
    a = m.adapter
    for block in range(len(a.blocks)):
        for head in (0, a.n_heads - 1):
            for circuit in (qk_circuit(a, block, head), ov_circuit(a, block, head)):
                dense = circuit.full()
                torch.testing.assert_close(
                    circuit.singular_values, torch.linalg.svdvals(dense)[: a.d_head], atol=1e-4, rtol=1e-4
                )
                torch.testing.assert_close(
                    circuit.U @ torch.diag(circuit.singular_values) @ circuit.Vh, dense, atol=1e-4, rtol=1e-4
                )
                assert circuit.level == "weight"


def test_rope_scores_depend_on_relative_position_only():
    """(R_p q) . (R_j k) == (R_{p+t} q) . (R_{j+t} k): the RoPE-aware form
    r_p^T W_Q^T R_p^T R_j W_K r_j only sees p - j (plain RoPE)."""
    a = tiny_llava_float64().adapter
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, a.n_heads, a.d_head, generator=g, dtype=torch.float64)
    k = torch.randn(1, a.n_heads, a.d_head, generator=g, dtype=torch.float64)
    for p, j, t in [(5, 2, 3), (7, 7, 11), (3, 0, 40)]:
        s1 = (a.rotate(q, torch.tensor([p])) * a.rotate(k, torch.tensor([j]))).sum(-1)
        s2 = (a.rotate(q, torch.tensor([p + t])) * a.rotate(k, torch.tensor([j + t]))).sum(-1)
        # transformers builds the cos/sin tables in float32 even for a float64 model
        torch.testing.assert_close(s1, s2, atol=1e-6, rtol=0)
    s_near = (a.rotate(q, torch.tensor([1])) * a.rotate(k, torch.tensor([0]))).sum(-1)
    s_far = (a.rotate(q, torch.tensor([30])) * a.rotate(k, torch.tensor([0]))).sum(-1)
    assert not torch.allclose(s_near, s_far)


def test_copying_matrix_equals_the_models_own_value_and_output_projections():
    """Row i of the copying matrix is W_U^T(gain) applied to head h's write for
    token i's embedding, computed with the model's modules (input_layernorm,
    v_proj, o_proj restricted to the head)."""
    m = tiny_llava_float64()
    a = m.adapter
    tokens = list(range(5, 25))
    block, head = 1, 2
    res = copying_score(a, block, head, tokens)
    layer = a.language_model.layers[block]
    E = m.model.get_input_embeddings().weight[tokens]
    v = layer.self_attn.v_proj(layer.input_layernorm(E))  # (T, kv_heads * d_head)
    d = a.d_head
    kv = a.kv_group(head)
    z = torch.zeros(len(tokens), a.n_heads * d, dtype=v.dtype)
    z[:, head * d : (head + 1) * d] = v[:, kv * d : (kv + 1) * d]
    write = torch.nn.functional.linear(z, layer.self_attn.o_proj.weight)  # no bias: the head's own write
    gain = a.language_model.norm.weight
    expected = (write * gain) @ m.model.lm_head.weight[tokens].T
    torch.testing.assert_close(res.matrix, expected.float(), atol=1e-5, rtol=1e-5)
    assert -1.0 <= res.eigen_copying <= 1.0
    assert 0.0 <= res.diagonal_top1 <= 1.0


def test_copying_score_detects_a_planted_copying_head():
    """Set W_V W_O of one head to project onto the embedding directions that
    W_U reads back: the eigenvalue copying score must be near +1, and near -1
    for the negated head."""
    m = tiny_llava_float64()
    a = m.adapter
    attn = a.language_model.layers[0].self_attn
    d, dm = a.d_head, a.d_model
    tokens = list(range(10, 10 + d // 2))
    with torch.no_grad():
        W_U = m.model.lm_head.weight  # (vocab, d_model)
        basis, _ = torch.linalg.qr(torch.randn(dm, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
        E = m.model.get_input_embeddings().weight
        E[tokens] = (basis[:, : len(tokens)].T * 3.0).to(E.dtype)
        W_U[tokens] = basis[:, : len(tokens)].T.to(W_U.dtype)
        m.model.model.language_model.norm.weight.fill_(1.0)
        m.model.model.language_model.layers[0].input_layernorm.weight.fill_(1.0)
        kv = a.kv_group(0)
        attn.v_proj.weight[kv * d : (kv + 1) * d] = basis.T.to(attn.v_proj.weight.dtype)
        attn.o_proj.weight[:, :d] = basis.to(attn.o_proj.weight.dtype)
    assert copying_score(a, 0, 0, tokens).eigen_copying > 0.99
    with torch.no_grad():
        attn.o_proj.weight[:, :d] *= -1
    assert copying_score(a, 0, 0, tokens).eigen_copying < -0.99


def test_keep_qk_leaves_nothing_patched():
    import transformers.models.llama.modeling_llama as llama

    before = llama.eager_attention_forward
    m = tiny_llava_float64()
    s = scenes.make_sample("heldout", 1)
    tr = capture(m, s.image, s.question, keep_qk=[1])
    assert llama.eager_attention_forward is before
    assert set(tr.q) == {1} and tr.q[1].shape[2] == m.adapter.n_heads
    assert tr.k[1].shape[2] == m.adapter.n_kv_heads
    with pytest.raises(IndexError):
        capture(m, s.image, s.question, keep_qk=True, query_positions=[10_000])
    assert llama.eager_attention_forward is before
