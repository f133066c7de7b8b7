"""Each answer row's attention mass by key kind (core.methods.answer_patterns),
against the model's own attention weights of one eager forward."""

import pytest
import torch
from PIL import Image

from core.analyze import analyze
from core.answer_text import AnswerText
from core.forward.capture import eager_attention
from core.zoo import scenes
from tests.core.test_capture_llava import tiny_llava_float64
from tests.tolerances import step_dtype, sum_tol

ANSWER = "red circle square"


@pytest.fixture(scope="module")
def tiny():
    loaded = tiny_llava_float64()
    s = scenes.make_sample("heldout", 3)
    return loaded, Image.fromarray(s.image), s.question


def test_answer_rows_split_the_models_own_weights(tiny):
    loaded, image, question = tiny
    adapter = loaded.adapter
    at = AnswerText.of_text(adapter, ANSWER, 2)
    d = analyze(
        loaded, image, question, answer_text=at, attention="eager"
    ).to_dict()  # the weights are the eager forward's
    assert d["input"]["attention"] == "eager"
    ap = d["answer_patterns"]
    inputs = adapter.prepare([image], [question], answer_prefix=at.prefix_ids)
    n_prompt = adapter.prepare([image], [question]).input_ids.shape[1]
    assert ap["positions"] == [n_prompt - 1, n_prompt, n_prompt + 1]
    assert ap["predicts"] == [0, 1, 2]
    assert ap["tokens"][1:] == list(at.tokens[:2])
    with torch.no_grad(), eager_attention(loaded.model):
        own = loaded.model(**inputs.tensors, output_attentions=True, use_cache=False).attentions
    ids = inputs.input_ids[0]
    image_keys = ids == loaded.model.config.image_token_id
    answer_keys = torch.arange(len(ids)) >= n_prompt
    special = torch.tensor([int(t) in set(loaded.tokenizer.all_special_ids) for t in ids.tolist()])
    sink = torch.zeros(len(ids), dtype=torch.bool)
    sink[0] = True
    question_keys = ~image_keys & ~answer_keys & ~special & ~sink
    for i, p in enumerate(ap["positions"]):
        row = torch.stack([own[b][0, :, p] for b in range(adapter.n_layers)])  # (blocks, heads, keys)
        want = {
            "image_mass": row[..., image_keys].sum(-1).mean(-1),
            "answer_mass": row[..., answer_keys].sum(-1).mean(-1),
            "question_mass": row[..., question_keys].sum(-1).mean(-1),
            "sink_mass": row[..., sink].sum(-1).mean(-1),
        }
        for part, values in want.items():
            got = torch.tensor([ap["by_block"][part][b][i] for b in range(adapter.n_layers)], dtype=torch.float64)
            torch.testing.assert_close(got, values, atol=sum_tol(1.0, len(ids), torch.float64), rtol=0)
        parts = [ap["rows"][i][k] for k in ("question_mass", "answer_mass", "image_mass", "sink_mass", "other_mass")]
        # a row of softmax weights sums to 1 within the softmax's own dtype (float32 in a float64 Llama)
        softmax = step_dtype(adapter.family, adapter.W_U.dtype, "softmax")
        assert sum(parts) == pytest.approx(1.0, abs=sum_tol(1.0, len(ids) + 5, softmax))
    assert ap["rows"][0]["answer_mass"] == 0.0  # the first answer token's row has no answer key before it
    assert ap["rows"][2]["answer_mass"] > 0.0


def test_first_token_read_out_has_one_row(tiny):
    loaded, image, question = tiny
    d = analyze(loaded, image, question).to_dict()
    assert len(d["answer_patterns"]["rows"]) == 1
    assert d["answer_patterns"]["positions"] == [d["target"]["position"]]


def test_cross_attention_blocks_are_named_as_left_out():
    from tests.core.test_capture_coca import tiny_coca_float64

    loaded = tiny_coca_float64()
    s = scenes.make_sample("heldout", 3)
    at = AnswerText.of_text(loaded.adapter, ANSWER, 1)
    d = analyze(loaded, Image.fromarray(s.image), s.question, answer_text=at).to_dict()
    ap = d["answer_patterns"]
    assert ap["skipped_blocks"] and set(ap["skipped_blocks"]).isdisjoint(ap["blocks"])
    assert all(r["image_mass"] == 0.0 for r in ap["rows"])  # the image is read only through cross-attention
    audit = next(a for a in d["audit"] if a["parameters"].get("positions") == ap["positions"])
    assert any("cross-attention blocks" in n for n in audit["notes"])
