"""The default models load with plain transformers / open_clip code, offline,
and VLM Readout's path gives the same numbers."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from core import answer, load_model
from core.models.loading import resources_dir
from core.zoo import build, scenes, vocab
from tests.core.exactness import forwards_tol, logit_terms_bound
from tests.tolerances import prob_tol, rounding_tol, sum_tol


def top_prob_tol(adapter, logits: torch.Tensor, n_keys: int) -> float:
    """How far the top probability from two forwards of one model may be apart:
    each logit as far as two forwards may be (:func:`forwards_tol`, relative to the
    logits' terms), through the float32 softmax (:func:`tests.tolerances.prob_tol`)."""
    p = float(logits.softmax(-1).max())
    error = forwards_tol(adapter, logit_terms_bound(adapter), n_keys)
    return prob_tol(p, error, logits.shape[-1], logits.dtype)


MODELS = resources_dir() / "models"


def test_chat_template_renders_the_training_prompt():
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(MODELS / "shapes-llava", local_files_only=True)
    q = "is the red circle left of the blue square?"
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}]
    assert processor.apply_chat_template(conv, add_generation_prompt=True) == vocab.LLAVA_PROMPT.format(question=q)


def test_plain_transformers_matches_readout_and_training_path():
    from transformers import AutoModelForImageTextToText, AutoProcessor

    d = MODELS / "shapes-llava"
    model = AutoModelForImageTextToText.from_pretrained(d, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(d, local_files_only=True)
    s = scenes.make_sample("heldout", 11)
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": s.question}]}]
    prompt = processor.apply_chat_template(conv, add_generation_prompt=True)
    from PIL import Image

    inputs = processor(images=Image.fromarray(s.image), text=prompt, return_tensors="pt")
    n_image = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert n_image == scenes.GRID**2
    from core.zoo.train import normalize_pixels

    # the processor's rescale and normalisation against ours: a few roundings of each pixel value
    pixels = normalize_pixels(s.image[None])
    tol = rounding_tol(float(pixels.abs().max()) + 1, torch.float32, 4)
    torch.testing.assert_close(inputs["pixel_values"], pixels, atol=tol, rtol=0)
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
    probs = logits.softmax(-1)
    loaded = load_model("shapes-llava")
    a = answer(loaded, s.image, s.question)
    tol = top_prob_tol(loaded.adapter, logits, inputs["input_ids"].shape[1])
    assert a.answer_id == int(probs.argmax()) and a.prob == pytest.approx(float(probs.max()), abs=tol)


def test_plain_open_clip_matches_readout():
    import open_clip
    from PIL import Image

    d = MODELS / "shapes-coca"
    model, preprocess = open_clip.create_model_from_pretrained(f"local-dir:{d}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{d}")
    s = scenes.make_sample("heldout", 12)
    text = tokenizer([vocab.COCA_PROMPT.format(question=s.question)])
    n = int((text[0] != 0).sum())
    with torch.no_grad():
        logits = model.eval()(preprocess(Image.fromarray(s.image))[None], text[:, :n], output_labels=False)["logits"]
    probs = logits[0, -1].softmax(-1)
    loaded = load_model("shapes-coca")
    a = answer(loaded, s.image, s.question)
    tol = top_prob_tol(loaded.adapter, logits[0, -1], max(n, len(loaded.adapter.visual_tokens((128, 128)))))
    assert a.answer_id == int(probs.argmax()) and a.prob == pytest.approx(float(probs.max()), abs=tol)


@pytest.mark.parametrize("name", ["shapes-llava", "shapes-coca"])
def test_shipped_vocabulary_and_card(name):
    d = MODELS / name
    assert json.loads((d / "scene_vocabulary.json").read_text()) == json.loads(json.dumps(scenes.scene_vocabulary()))
    card = (d / "CARD.md").read_text()
    result = json.loads((d / "eval_heldout.json").read_text())
    for kind, row in result["by_kind"].items():
        assert f"| {kind} | {row['accuracy']:.4f} |" in card
    assert result["n"] == 2000


def test_every_answer_and_template_word_is_one_token():
    tok = vocab.build_hf_tokenizer()
    for w in scenes.ANSWER_WORDS:
        assert len(tok.encode(w, add_special_tokens=False)) == 1
    assert build.vocab_size() == len(tok.get_vocab())
    for i in range(200):
        q = scenes.make_sample("heldout", i).question
        assert tok.unk_token_id not in tok.encode(q)


def test_prefix_shared_training_forward_is_exact():
    """Training runs the image prefix once and shares its cache over several
    questions; that must equal the plain full-sequence forward."""
    from core.zoo.train import LlavaTrainer, normalize_pixels

    trainer = LlavaTrainer(seed=0)
    trainer.model.load_state_dict(load_model("shapes-llava").model.state_dict())
    trainer.model.eval()
    samples = [scenes.make_sample("heldout", i) for i in range(3)]
    pixels = normalize_pixels(np.stack([s.image for s in samples]))
    qs = [s.question for s in samples]
    with torch.no_grad():
        shared = trainer.answer_logits(pixels.repeat_interleave(2, 0)[::2], [q for q in qs for _ in range(2)], 2)
        m = load_model("shapes-llava")
        inputs = m.adapter.prepare([s.image for s in samples], qs)
        plain = m.adapter.next_token_logits(inputs)
    # the shared prefix cache against one full forward: as far as two forwards may be apart
    torch.testing.assert_close(
        shared[::2], plain, atol=forwards_tol(m.adapter, plain, inputs.input_ids.shape[1]), rtol=0
    )


def test_relation_probe_targets_follow_the_question():
    """The relation fine-tune's probe targets: the two objects' centres in the
    order the question names them, and an offset whose sign is the answer."""
    from core.zoo.train import _pair_centres, _signed_offset

    relations = [s for s in (scenes.make_sample("val", i) for i in range(300)) if s.kind == "relation"]
    assert len(relations) > 30
    for s in relations:
        (xa, ya), (xb, yb) = _pair_centres(s)
        a, b = s.objects[s.target], s.objects[s.reference]
        assert f"{a.color} {a.shape}" in s.question.split(" the ")[1] and s.question.endswith(f"{b.color} {b.shape}?")
        assert (xa, ya) == pytest.approx((a.center[0] / 64 - 1, a.center[1] / 64 - 1))
        assert (xb, yb) == pytest.approx((b.center[0] / 64 - 1, b.center[1] / 64 - 1))
        assert (_signed_offset(s) > 0) == (s.answer == "yes")
        assert abs(_signed_offset(s)) >= 2 * scenes.RELATION_MARGIN
    other = next(s for s in (scenes.make_sample("val", i) for i in range(50)) if s.kind != "relation")
    assert np.isnan(_signed_offset(other)) and np.isnan(_pair_centres(other)).all()


@pytest.mark.parametrize("family", ["llava", "coca"])
def test_relation_probe_reads_the_named_shapes_and_the_answer_position(family):
    from core.zoo.train import TRAINERS, normalize_pixels, relation_positions

    trainer = TRAINERS[family](seed=0)
    trainer.model.eval()
    q = ["is the red circle left of the blue square?", "is the green triangle above the red square?"]
    pixels = normalize_pixels(np.stack([scenes.make_sample("val", i).image for i in range(2)]))
    with torch.no_grad():
        logits, hidden, ids = trainer.answer_logits(pixels, q, 1, hidden=True)
    first, second, answer = relation_positions(ids)
    tok = trainer.tok
    assert [tok.id_to_token(int(ids[i, first[i]])) for i in range(2)] == ["circle", "triangle"]
    assert [tok.id_to_token(int(ids[i, second[i]])) for i in range(2)] == ["square", "square"]
    assert [tok.id_to_token(int(ids[i, answer[i]])) for i in range(2)] == [":", ":"]
    n_layers = (
        trainer.model.config.text_config.num_hidden_layers
        if family == "llava"
        else len(trainer.model.text_decoder.resblocks)
    )
    assert len(hidden) == n_layers and all(h.shape[:2] == ids.shape for h in hidden)
    if family == "coca":  # the last residual gives the logits through the decoder's own head
        decoder = trainer.model.text_decoder
        last = hidden[-1][torch.arange(2), answer]
        with torch.no_grad():
            normed = decoder.ln_final(last)
            W = decoder.text_projection
            tol = sum_tol(float((normed.abs() @ W.abs()).max()), W.shape[0], W.dtype)  # the product in another order
        torch.testing.assert_close(normed @ W, logits, atol=tol, rtol=0)


def test_absent_object_relation_questions_and_their_loss():
    """Relation questions about an absent object name a pair the scene lacks
    (sharing colour or shape with the object replaced) and train yes = no."""
    from core.zoo.train import _absent_relation_question, answer_loss

    rng = np.random.default_rng(0)
    tok = vocab.build_tokenizer()
    relations = [s for s in (scenes.make_sample("val", i) for i in range(200)) if s.kind == "relation"]
    for s in relations:
        q = _absent_relation_question(s, rng)
        words = q.rstrip("?").split(" ")
        first = (words[2], words[3])
        second = (words[-2], words[-1])
        present = {(o.color, o.shape) for o in s.objects}
        a, b = s.objects[s.target], s.objects[s.reference]
        assert (first in present) != (second in present)
        absent, replaced = (first, a) if second in present else (second, b)
        assert absent[0] == replaced.color or absent[1] == replaced.shape
        assert tok.token_to_id(vocab.UNK) is not None and tok.token_to_id(vocab.UNK) not in tok.encode(q).ids
    logits = torch.randn(3, tok.get_vocab_size())
    ids = torch.tensor([tok.token_to_id("yes"), tok.token_to_id("no"), tok.token_to_id("red")])
    logp = logits.log_softmax(-1)
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
    want = (-logp[0, yes] - 0.5 * (logp[1, yes] + logp[1, no]) - logp[2, ids[2]]) / 3
    got = answer_loss(logits, ids, ["relation", "relation_absent", "attribute"], tok)
    assert torch.allclose(got, want)


@pytest.mark.parametrize("name", ["shapes-llava", "shapes-coca"])
def test_the_cards_stage_2_section_is_rebuilt_from_the_models_own_files(name, monkeypatch):
    """The committed card's stage-2 text is what core.zoo.card writes from the
    model's training record, and a number measured on one model is not in the other's."""
    from core.zoo import card

    d = MODELS / name
    training = json.loads((d / "training.json").read_text())
    # the card names the folder as `python -m core.zoo.card` is run from the repository root
    monkeypatch.chdir(MODELS.parents[1])
    section = card._finetune_section(
        training, card._read_curve(d / "learning_curve.jsonl"), Path("resources/models", name)
    )
    assert section and section in (d / "CARD.md").read_text()
    assert ("answered all 180 relation questions" in section) == (name == "shapes-llava")
    assert ("--projected-dense" in section) == (name == "shapes-llava")
