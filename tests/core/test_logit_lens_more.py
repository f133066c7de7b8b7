"""Logit lens over visual positions and over samples split by correctness."""

import pytest
import torch
from PIL import Image

from core import load_model
from core.answer import answer_batch
from core.forward.capture import capture
from core.methods.logit_lens import logit_lens_over_samples, logit_lens_positions
from core.zoo import scenes
from tests.core.exactness import unembedding_tol
from tests.tolerances import prob_tol


@pytest.fixture(scope="module")
def llava():
    return load_model("shapes-llava")


def test_lens_over_visual_positions_last_row_is_the_models_own_distribution(llava):
    a = llava.adapter
    s = scenes.make_sample("heldout", 30)
    tr = capture(llava, s.image, s.question)
    red = a.token_id("red")
    lens = logit_lens_positions(a, tr, top_k=2, target_ids=[red])
    assert lens.positions == tr.visual_positions[0].tolist()
    assert lens.top_ids.shape == (a.n_layers + 1, 64, 2)
    model = tr.logits[0, tr.visual_positions[0]].float().softmax(-1)  # the model's own next-token distribution
    vocab = model.shape[-1]

    def tol(states, probs):
        """The lens's logits against these: the unembedding in another order, then the softmax."""
        with torch.no_grad():
            error = unembedding_tol(a, a.final_norm_layer()(states))
        return prob_tol(float(probs.detach().max()), error, vocab, torch.float32)

    x_L = tr.final_resid[0, tr.visual_positions[0]]
    torch.testing.assert_close(lens.top_probs[-1], model.topk(2, -1).values, atol=tol(x_L, model), rtol=0)
    torch.testing.assert_close(lens.target_probs[-1, :, 0], model[:, red], atol=tol(x_L, model), rtol=0)
    # an intermediate row is the final norm recomputed on that layer's own residual
    x = tr.resid_pre[2][0, tr.visual_positions[0]]
    mid = (a.final_norm_layer()(x) @ a.W_U + a.b_U).softmax(-1)
    torch.testing.assert_close(lens.top_probs[2], mid.topk(2, -1).values, atol=tol(x, mid), rtol=0)
    assert len(lens.top_tokens(a, 2)) == 64


def test_lens_positions_refuses_cross_attention_models():
    coca = load_model("shapes-coca")
    s = scenes.make_sample("heldout", 30)
    tr = capture(coca, s.image, s.question)
    with pytest.raises(ValueError, match="cross-attention"):
        logit_lens_positions(coca.adapter, tr)


def test_lens_over_samples_splits_by_the_models_own_answers(llava):
    samples = [scenes.make_sample("heldout", i) for i in range(40, 52)]
    items = [(s.image, s.question, s.answer, s.foil) for s in samples]
    result = logit_lens_over_samples(llava, items)
    answers = answer_batch(llava, [Image.fromarray(s.image) for s in samples], [s.question for s in samples])
    n_right = sum(r.answer == s.answer for r, s in zip(answers, samples))
    assert result.correct.n == n_right and result.incorrect.n == len(samples) - n_right
    last = llava.adapter.n_layers
    if result.correct.n:
        assert result.correct.top1_rate[last] == 1.0  # the final row is the model: correct means top-1
        assert result.correct.kl_to_final[last].quantiles["0.95"] == 0.0  # the final distribution is that row
    if result.incorrect.n:
        assert result.incorrect.top1_rate[last] == 0.0
        assert result.incorrect.answer_rank[last].quantiles["0.05"] >= 1
    assert set(result.to_dict()) == {"n_layers", "correct", "incorrect", "audit"}
