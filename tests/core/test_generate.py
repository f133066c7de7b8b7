"""Greedy decoding: our loop equals the libraries' own computation."""

import torch
from PIL import Image

from core import load_model
from core.generate import greedy_generate
from core.zoo import scenes, vocab


def test_llava_greedy_matches_transformers_generate():
    m = load_model("shapes-llava")
    s = scenes.make_sample("heldout", 5)
    ours = greedy_generate(m, s.image, s.question, max_new_tokens=4)
    inputs = m.adapter.prepare([s.image], [s.question])
    out = m.model.generate(**inputs.tensors, max_new_tokens=4, do_sample=False, eos_token_id=[1_000_000])
    theirs = out[0, inputs.tensors["input_ids"].shape[1] :].tolist()
    stop = {m.tokenizer.eos_token_id, m.tokenizer.pad_token_id}
    cut = next((i for i, t in enumerate(theirs) if t in stop), len(theirs))
    assert ours.token_ids == theirs[:cut]


def test_coca_greedy_matches_plain_open_clip_loop():
    m = load_model("shapes-coca")
    s = scenes.make_sample("heldout", 6)
    ours = greedy_generate(m, s.image, s.question, max_new_tokens=3)
    text = torch.tensor([m.tokenizer.encode(vocab.COCA_PROMPT.format(question=s.question))])
    image = m.processor(Image.fromarray(s.image))[None]
    theirs = []
    with torch.no_grad():
        for _ in range(3):
            tok = int(m.model(image, text, output_labels=False)["logits"][0, -1].argmax())
            if tok in (m.tokenizer.eos_token_id, m.tokenizer.pad_token_id):
                break
            theirs.append(tok)
            text = torch.cat([text, torch.tensor([[tok]])], 1)
    assert ours.token_ids == theirs
    assert all(0 < p <= 1 for p in ours.probs)
