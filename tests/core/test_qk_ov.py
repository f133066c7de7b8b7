"""QK / OV read-outs checked against independent computations: the model's
own pre-softmax scores (q and k recorded inside its eager attention), its
eager patterns, dense SVDs, and the model's own modules for the OV write."""

import pytest
import torch
from PIL import Image

from core import load_model
from core.forward.capture import capture
from core.methods.qk_ov import copying_score, model_scores, ov_circuit, qk_circuit, realized_scores
from core.zoo import scenes
from tests.core.exactness import noise_image, pattern_rtol, realized_scores_tol
from tests.core.test_capture_coca import tiny_coca_float64
from tests.core.test_capture_llava import tiny_llava_float64
from tests.core.test_qwen2_vl import IMAGE_SIZE, QUESTION, tiny_qwen_float64
from tests.tolerances import abs_terms, rounding_tol, sum_tol

CASES = ["tiny-llava", "shapes-llava", "tiny-qwen2_vl", "tiny-qwen2_5_vl", "tiny-coca", "shapes-coca"]


def _build(name):
    if name == "tiny-llava":
        return tiny_llava_float64()
    if name.startswith("tiny-qwen"):
        kind = name.removeprefix("tiny-")
        return tiny_qwen_float64(kind, kind == "qwen2_5_vl")
    if name == "tiny-coca":
        return tiny_coca_float64()
    return load_model(name)


@pytest.fixture(scope="module", params=CASES)
def traced(request):
    m = _build(request.param)
    if request.param.startswith("tiny-qwen"):
        image, question = noise_image(IMAGE_SIZE), QUESTION
    else:
        s = scenes.make_sample("heldout", 6)
        image, question = Image.fromarray(s.image), s.question
    n = m.adapter.prepare([image], [question]).input_ids.shape[1]
    tr = capture(m, image, question, query_positions=range(n), keep_qk=True)
    return m, tr


def test_realized_scores_equal_the_models_pre_softmax_scores(traced):
    m, tr = traced
    for block in range(tr.n_blocks):
        ours = realized_scores(m.adapter, tr, block)
        theirs = model_scores(tr, block)
        torch.testing.assert_close(ours.scores, theirs, atol=realized_scores_tol(m.adapter, tr, block), rtol=0)
        assert ours.level == "activation" and ours.audit.method == "qk/ov circuit"


def test_realized_patterns_equal_eager_patterns(traced):
    m, tr = traced
    a = m.adapter
    for block in range(tr.n_blocks):
        ours = realized_scores(a, tr, block)
        scores = ours.scores.masked_fill(~a.allowed_keys(tr, block), float("-inf"))
        rtol = pattern_rtol(a, tr, scores, realized_scores_tol(a, tr, block))
        torch.testing.assert_close(ours.pattern, tr.patterns[block][0].to(ours.pattern.dtype), atol=0, rtol=rtol)


def svd_tol(circuit) -> float:
    """How far two SVDs of ``left @ right`` (factored: QR of both factors, SVD of the
    core; dense: of the formed product) may disagree, on the singular values and on
    the rebuilt matrix: QR and SVD are backward stable, off by a multiple of ``u``
    of the matrix's norm (Higham 2002, Thm 19.4; Golub and Van Loan, sec. 8.6),
    taken as the rows they reduce (d_model) plus the product's d_head terms,
    relative to ``||left||_F ||right||_F >= ||left @ right||_2``."""
    d_model, d_head = circuit.left.shape
    norm = float(circuit.left.detach().norm() * circuit.right.detach().norm())
    return sum_tol(norm, d_model + d_head, circuit.left.dtype)


def test_qk_and_ov_factored_svd_match_dense(traced):
    m, _ = traced
    a = m.adapter
    for block in range(len(a.blocks)):
        for head in (0, a.n_heads - 1):
            for circuit in (qk_circuit(a, block, head), ov_circuit(a, block, head)):
                dense = circuit.full()
                tol = svd_tol(circuit)
                torch.testing.assert_close(
                    circuit.singular_values, torch.linalg.svdvals(dense)[: a.d_head], atol=tol, rtol=0
                )
                torch.testing.assert_close(
                    circuit.U @ torch.diag(circuit.singular_values) @ circuit.Vh, dense, atol=tol, rtol=0
                )
                assert circuit.level == "weight"


def test_rope_scores_depend_on_relative_position_only():
    """(R_p q) . (R_j k) == (R_{p+t} q) . (R_{j+t} k): the RoPE-aware form
    r_p^T W_Q^T R_p^T R_j W_K r_j only sees p - j (plain RoPE)."""
    a = tiny_llava_float64().adapter
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, a.n_heads, a.d_head, generator=g, dtype=torch.float64)
    k = torch.randn(1, a.n_heads, a.d_head, generator=g, dtype=torch.float64)
    # transformers builds the cos/sin tables in float32 even for a float64 model: the
    # angle position * inv_freq (inv_freq <= 1) is off by u32 * position, so cos and
    # sin by that plus their own rounding; each rotated coordinate mixes its
    # rotate_half partner, and both sides' dot products carry it
    half = a.d_head // 2
    pair_terms = float(((q.abs() + q.abs().roll(half, -1)) * (k.abs() + k.abs().roll(half, -1))).sum(-1).max())
    for p, j, t in [(5, 2, 3), (7, 7, 11), (3, 0, 40)]:
        s1 = (a.rotate(q, torch.tensor([p])) * a.rotate(k, torch.tensor([j]))).sum(-1)
        s2 = (a.rotate(q, torch.tensor([p + t])) * a.rotate(k, torch.tensor([j + t]))).sum(-1)
        positions = p + j + 2 * t  # the four angles' positions, summed
        tol = rounding_tol(pair_terms, torch.float32, positions + 4) + sum_tol(pair_terms, a.d_head + 3, q.dtype)
        torch.testing.assert_close(s1, s2, atol=tol, rtol=0)
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
    # copying_score runs the chain in float32 (the normed embeddings through W_V, W_O,
    # the gain and W_U): relative to the chain's terms, and the float32 rounding of expected
    with torch.no_grad():
        x = layer.input_layernorm(E)
        chain = abs_terms(abs_terms(x, a.W_V(block)[head]), a.W_O(block)[head]) * gain.abs()
        terms = float(abs_terms(chain, m.model.lm_head.weight[tokens].T).max())
    tol = sum_tol(terms, 2 * a.d_model + a.d_head + 4, torch.float32) + rounding_tol(terms, torch.float32)
    torch.testing.assert_close(res.matrix, expected.float(), atol=tol, rtol=0)
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
