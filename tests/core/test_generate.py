"""Greedy generation with the key / value cache (core.generate): every cached
step gives the logits of a full re-run of the prefix (to the float tolerance of
two forwards), so the same tokens and probabilities; the same tokens and
logits as transformers' own ``generate`` and as a plain open_clip loop; the
stopping rules (end tokens of the generation config, stop strings, counts and
lengths); the Readout; ``vlm-readout generate``."""

import functools
import json
import math

import pytest
import torch
from PIL import Image

from core import load_model
from core.answer_text import AnswerText
from core.cli import main
from core.generate import DEFAULT_MAX_NEW_TOKENS, Generation, decoded_text, generate
from core.models.loading import resources_dir
from core.results.audit import METHOD_TABLE
from core.results.readout import Readout
from core.zoo import scenes, vocab
from tests.core.exactness import forwards_tol, logit_terms_bound, noise_image
from tests.core.test_family_conformance import FAMILY_FILES, Case, _cases, _id
from tests.tolerances import prob_tol

SAMPLES = resources_dir() / "samples"
SHAPES_QUESTION = "what shape is the blue object?"
STEPS = 6
NEVER = [10**6]  # an eos id no vocabulary here has: transformers' generate runs its full length


@functools.cache
def own_case(name: str):
    """``(model, image, question)`` of the models this file builds itself: the tiny
    random float64 LLaVA-1.5, Qwen2-VL and CoCa of the family tests, and the shipped ones."""
    if name == "tiny-llava":
        from tests.core.test_capture_llava import tiny_llava_float64

        return tiny_llava_float64(), noise_image((90, 60)), SHAPES_QUESTION
    if name == "tiny-qwen2_vl":
        from tests.core.test_qwen2_vl import IMAGE_SIZE, QUESTION, tiny_qwen_float64

        return tiny_qwen_float64("qwen2_vl"), noise_image(IMAGE_SIZE), QUESTION
    if name == "tiny-coca":
        from tests.core.test_capture_coca import tiny_coca_float64

        return tiny_coca_float64(), noise_image((128, 96)), SHAPES_QUESTION
    s = scenes.make_sample("heldout", 5)
    return load_model(name), Image.fromarray(s.image), s.question


OWN = ["tiny-llava", "tiny-qwen2_vl", "tiny-coca", "shapes-llava", "shapes-coca"]
FAMILY_CASES = _cases(FAMILY_FILES, per_model=True)  # one per tiny model of tests/core/test_family_conformance.py
ALL = [("own", name) for name in OWN] + FAMILY_CASES
ALL_IDS = [name for _, name in ALL[: len(OWN)]] + [_id(c) for c in FAMILY_CASES]


def case_of(key) -> tuple:
    """``(model, image, question, cross_keys)``: cross_keys is the most keys a
    cross-attention softmax reads (0 where the image tokens are in the sequence)."""
    if key[0] == "own":
        m, image, question = own_case(key[1])
        cross = len(m.adapter.visual_tokens(image.size)) if m.adapter.attention_kind == "cross" else 0
        return m, image, question, cross
    c = Case(*key)
    return c.m, noise_image(c.image_size), c.question, c.hook("CROSS_KEYS", 0)


def logit_tol(adapter, n_keys: int) -> float:
    """How far two forwards of the same sequence may be apart in a logit when
    they reduce in other orders (the cached step reads the same keys and values
    in another arrangement than the full re-run)."""
    return forwards_tol(adapter, torch.tensor([logit_terms_bound(adapter)]), n_keys)


@pytest.fixture
def no_end_tokens(monkeypatch):
    """Let a model run its full length: its adapter ends at no token (random
    models emit EOS or padding at chance)."""

    def disable(m):
        monkeypatch.setattr(m.adapter, "end_token_ids", lambda: set())
        return m

    return disable


# ---- the cache against a re-run of the whole prefix


@pytest.mark.parametrize("key", ALL, ids=ALL_IDS)
def test_cached_steps_equal_a_rerun_of_the_prefix(key, no_end_tokens):
    assert_cached_steps_equal_a_rerun(*case_of(key), no_end_tokens)


def assert_cached_steps_equal_a_rerun(m, image, question, cross: int, no_end_tokens) -> None:
    """Step by step (the same tokens fed to both): the cached logits are the
    full re-run's; generate with and without the cache gives the same tokens and
    probabilities (``cross``: :func:`case_of`'s; tolerances in the model's dtype)."""
    a = m.adapter
    with torch.no_grad():
        inputs = a.prepare([image], [question])
        cached, rerun = a.start_decoding(inputs), a.start_decoding(inputs, use_cache=False)
        assert cached.cache is not None and rerun.cache is None
        for _ in range(STEPS):
            n_keys = max(int(rerun.inputs.input_ids.shape[1]), cross)
            torch.testing.assert_close(cached.logits, rerun.logits, atol=logit_tol(a, n_keys), rtol=0)
            assert torch.equal(cached.inputs.input_ids, rerun.inputs.input_ids)
            token = int(rerun.logits[0].argmax())
            cached, rerun = a.decode_step(cached, token), a.decode_step(rerun, token)
    no_end_tokens(m)
    fast = generate(m, image, question, max_new_tokens=STEPS)
    slow = generate(m, image, question, max_new_tokens=STEPS, use_cache=False)
    assert (fast.cache, slow.cache) == (True, False)
    assert len(fast.token_ids) == len(slow.token_ids) == STEPS
    assert fast.stop_reason == slow.stop_reason == "max_new_tokens"
    tol = logit_tol(a, max(fast.prompt_length + STEPS, cross))
    vocab_size = a.W_U.shape[1]
    same = next((i for i, (f, s) in enumerate(zip(fast.token_ids, slow.token_ids)) if f != s), STEPS)
    if same < STEPS:
        # A near-tie the two runs' roundings may break either way (half precision; never seen in
        # float64): the other run's token is within the logits' tolerance of this run's choice,
        # p_other >= p_chosen exp(-2 tol); the runs are compared up to there.
        top = dict(map(tuple, fast.top[same]))
        other = slow.tokens[same]
        assert other in top and top[other] >= fast.probs[same] * math.exp(-2 * tol) - prob_tol(
            fast.probs[same], tol, vocab_size, torch.float64
        ), (same, fast.top[same], other, tol)
    for p, q in zip(fast.probs[:same], slow.probs[:same]):
        assert p == pytest.approx(q, abs=prob_tol(q, tol, vocab_size, torch.float64))
    assert fast.tokens == [a.token_str(i) for i in fast.token_ids]
    assert all(t[0][0] == tok and t[0][1] == p for t, tok, p in zip(fast.top, fast.tokens, fast.probs))
    assert all(len(t) == 5 for t in fast.top)


def test_a_qwen_step_does_not_read_another_images_rope_deltas():
    """Qwen2-VL stores M-RoPE deltas of its last forward; a cached step passes
    its own positions, so a forward on an image of another size in between
    changes nothing."""
    m, image, question, _ = case_of(("own", "tiny-qwen2_vl"))
    a = m.adapter
    with torch.no_grad():
        inputs = a.prepare([image], [question])
        state = a.start_decoding(inputs)
        token = int(state.logits[0].argmax())
        other = a.prepare([noise_image((90, 260))], [question])
        a.next_token_logits(other)  # sets the model's rope deltas to the other image's
        assert not torch.equal(a.positions_for_inputs(other)[0, 0, -1:], a.positions_for_inputs(inputs)[0, 0, -1:])
        stepped = a.decode_step(state, token)
        reference = a.next_token_logits(a.append_token(inputs, token))
    n_keys = int(stepped.inputs.input_ids.shape[1])
    torch.testing.assert_close(stepped.logits, reference, atol=logit_tol(a, n_keys), rtol=0)


# ---- the libraries' own decoding

HF_CASES = [("own", n) for n in ("tiny-llava", "tiny-qwen2_vl", "shapes-llava")] + [
    c for c in FAMILY_CASES if c[0] != "blip"
]
HF_IDS = ["tiny-llava", "tiny-qwen2_vl", "shapes-llava"] + [_id(c) for c in FAMILY_CASES if c[0] != "blip"]


@pytest.mark.parametrize("key", HF_CASES, ids=HF_IDS)
def test_generation_equals_transformers_generate(key, no_end_tokens):
    """transformers' greedy ``generate`` (its own cache and input preparation)
    gives the same tokens, and logits as far as two forwards may be apart."""
    m, image, question, cross = case_of(key)
    no_end_tokens(m)
    ours = generate(m, image, question, max_new_tokens=STEPS)
    inputs = m.adapter.prepare([image], [question])
    out = m.model.generate(
        **inputs.tensors,
        max_new_tokens=STEPS,
        do_sample=False,
        eos_token_id=NEVER,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    assert out.sequences[0, ours.prompt_length :].tolist() == ours.token_ids
    tol = logit_tol(m.adapter, max(ours.prompt_length + STEPS, cross))
    for p, logits, token in zip(ours.probs, out.logits, ours.token_ids):
        theirs = float(logits[0].double().softmax(-1)[token])
        assert p == pytest.approx(theirs, abs=prob_tol(theirs, tol, m.adapter.W_U.shape[1], torch.float64))


def test_blip_generation_equals_its_generate():
    """BlipForConditionalGeneration.generate (the processor's [CLS] prefix [SEP],
    which it turns into BOS prefix and ends at [SEP]) gives our tokens, our
    generation ending where it ends."""
    m, image, question, _ = case_of(("blip", "blip"))
    ours = generate(m, image, question, max_new_tokens=STEPS)
    batch = m.processor(images=[image], text=[question], return_tensors="pt")
    out = m.model.generate(
        pixel_values=batch["pixel_values"].to(m.adapter.parameters_dtype),
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        max_new_tokens=STEPS,
        do_sample=False,
    )
    theirs = out[0, ours.prompt_length :].tolist()
    ends = m.adapter.end_token_ids()
    cut = next((i for i, t in enumerate(theirs) if t in ends), len(theirs))
    assert ours.token_ids == theirs[:cut]
    assert ours.stop_reason == ("eos" if cut < len(theirs) else "max_new_tokens")


@pytest.mark.parametrize("name", ["tiny-coca", "shapes-coca"])
def test_coca_generation_equals_a_plain_open_clip_loop(name, no_end_tokens):
    """open_clip's own forward on the growing text, argmax appended each step
    (no adapter involved), gives our cached tokens and logits."""
    m, image, question, cross = case_of(("own", name))
    no_end_tokens(m)
    ours = generate(m, image, question, max_new_tokens=STEPS)
    text = torch.tensor([m.tokenizer.encode(vocab.COCA_PROMPT.format(question=question))])
    pixels = m.processor(image)[None].to(m.adapter.parameters_dtype)
    theirs, probs = [], []
    with torch.no_grad():
        for _ in range(STEPS):
            logits = m.model(pixels, text, output_labels=False)["logits"][0, -1]
            token = int(logits.argmax())
            theirs.append(token)
            probs.append(float(logits.double().softmax(-1)[token]))
            text = torch.cat([text, torch.tensor([[token]])], 1)
    assert ours.token_ids == theirs
    tol = logit_tol(m.adapter, max(ours.prompt_length + STEPS, cross))
    for p, q in zip(ours.probs, probs):
        assert p == pytest.approx(q, abs=prob_tol(q, tol, m.adapter.W_U.shape[1], torch.float64))


# ---- stopping


def _free_run(m, image, question, n: int, monkeypatch) -> Generation:
    """The model's first ``n`` tokens with no end token (the baseline the stopping tests cut)."""
    with monkeypatch.context() as patch:
        patch.setattr(m.adapter, "end_token_ids", lambda: set())
        return generate(m, image, question, max_new_tokens=n)


def _first_new_token(ids: list[int]) -> int:
    """The first step from 1 on whose token the steps before did not produce."""
    return next(k for k in range(1, len(ids)) if ids[k] not in ids[:k])


@pytest.mark.parametrize("name", ["shapes-llava", "tiny-llava"])
def test_generation_config_eos_list_ends_the_answer(name, monkeypatch):
    """An ``eos_token_id`` list in the generation config: the answer ends before
    the first step that predicts one of them, that token not kept."""
    m, image, question, _ = case_of(("own", name))
    base = _free_run(m, image, question, 8, monkeypatch)
    k = _first_new_token(base.token_ids)
    monkeypatch.setattr(m.model.generation_config, "eos_token_id", [*NEVER, base.token_ids[k]])
    got = generate(m, image, question, max_new_tokens=8)
    assert got.token_ids == base.token_ids[:k] and got.stop_reason == "eos"
    assert got.stop_token["token_id"] == base.token_ids[k] and got.stop_token["prob"] == base.probs[k]
    assert got.probs == base.probs[:k]
    assert got.text == decoded_text(m.adapter, base.token_ids[:k])


def test_end_tokens_are_the_generation_configs_the_tokenizers_eos_and_padding(monkeypatch):
    m, _, _, _ = case_of(("own", "shapes-llava"))
    tok = m.tokenizer
    assert m.adapter.end_token_ids() == {m.model.generation_config.eos_token_id, tok.eos_token_id, tok.pad_token_id}
    monkeypatch.setattr(m.model.generation_config, "eos_token_id", [7, 9])
    assert m.adapter.end_token_ids() == {7, 9, tok.eos_token_id, tok.pad_token_id}
    blip = case_of(("blip", "blip"))[0]
    assert blip.tokenizer.sep_token_id in blip.adapter.end_token_ids()  # BLIP's generate ends captions at [SEP]


def test_stop_strings_keep_the_completing_token_and_cut_the_text(monkeypatch):
    """A stop string ends the answer at the step whose token completes it (kept),
    the text cut just after it; one that spans two tokens ends at the second;
    one ending inside a token leaves the token in the ids, its rest out of the text."""
    m, image, question, _ = case_of(("own", "shapes-llava"))
    base = _free_run(m, image, question, 8, monkeypatch)
    a = m.adapter
    monkeypatch.setattr(a, "end_token_ids", lambda: set())
    k = _first_new_token(base.token_ids)

    def expected(stop: str) -> tuple[list[int], str]:
        j = next(j for j in range(len(base.token_ids)) if stop in decoded_text(a, base.token_ids[: j + 1]))
        full = decoded_text(a, base.token_ids[: j + 1])
        return base.token_ids[: j + 1], full[: full.find(stop) + len(stop)]

    spanning = decoded_text(a, base.token_ids[k - 1 : k + 1])
    partial = base.tokens[k][:2]
    for stops in ([base.tokens[k]], [spanning], [partial], ["no such words", base.tokens[k]]):
        got = generate(m, image, question, max_new_tokens=8, stop_strings=stops)
        ids, text = expected(stops[-1])
        assert (got.token_ids, got.text, got.stop_reason) == (ids, text, "stop_string"), stops
    assert expected(partial)[1].endswith(partial)


def test_max_new_tokens_and_the_generation_configs_limits(monkeypatch):
    """``max_new_tokens`` counts the tokens; without one the generation config's
    ``max_new_tokens`` (else 32) does; its ``max_length`` caps prompt + answer."""
    m, image, question, _ = case_of(("own", "shapes-llava"))
    monkeypatch.setattr(m.adapter, "end_token_ids", lambda: set())
    base = generate(m, image, question, max_new_tokens=5)
    three = generate(m, image, question, max_new_tokens=3)
    assert three.token_ids == base.token_ids[:3] and three.stop_reason == "max_new_tokens"
    assert three.probs == base.probs[:3]
    default = generate(m, image, question)
    assert len(default.token_ids) == DEFAULT_MAX_NEW_TOKENS == default.max_new_tokens
    monkeypatch.setattr(m.model.generation_config, "max_new_tokens", 2)
    assert generate(m, image, question).token_ids == base.token_ids[:2]
    monkeypatch.setattr(m.model.generation_config, "max_length", base.prompt_length + 4)
    capped = generate(m, image, question, max_new_tokens=10)
    assert capped.token_ids == base.token_ids[:4] and capped.stop_reason == "max_length"


@pytest.mark.parametrize("key", [("own", "shapes-coca"), ("blip", "blip")], ids=["shapes-coca", "blip"])
def test_the_models_position_limit_ends_the_answer(key, no_end_tokens):
    """CoCa's text context (less the CLS it appends) and BLIP's position table
    bound prompt + answer: the answer stops there, cached or not."""
    m, image, question, _ = case_of(key)
    no_end_tokens(m)
    a = m.adapter
    limit = a.context_length - 1 if a.family == "coca" else int(a.text_config.max_position_embeddings)
    fast = generate(m, image, question, max_new_tokens=500)
    slow = generate(m, image, question, max_new_tokens=500, use_cache=False)
    assert fast.prompt_length + len(fast.token_ids) == limit and fast.stop_reason == "max_length"
    assert slow.token_ids == fast.token_ids and slow.stop_reason == "max_length"


def test_progress_and_cancel(monkeypatch):
    """``progress(done, total, message)`` after each token; ``cancel`` polled
    before each step stops with the tokens so far."""
    m, image, question, _ = case_of(("own", "shapes-llava"))
    monkeypatch.setattr(m.adapter, "end_token_ids", lambda: set())
    seen = []
    got = generate(
        m,
        image,
        question,
        max_new_tokens=8,
        progress=lambda done, total, message: seen.append((done, total, message)),
        cancel=lambda: len(seen) >= 3,
    )
    assert got.stop_reason == "cancelled" and len(got.token_ids) == 3
    assert [(d, t) for d, t, _ in seen] == [(1, 8), (2, 8), (3, 8)]
    assert all(isinstance(msg, str) and msg for _, _, msg in seen)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
        ({"top_k": 0}, "top_k must be a positive integer"),
        ({"stop_strings": [""]}, "stop string must be non-empty"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs, message):
    from core.errors import QuestionError

    m, image, question, _ = case_of(("own", "shapes-llava"))
    with pytest.raises(QuestionError, match=message):
        generate(m, image, question, **kwargs)
    with pytest.raises(QuestionError, match="the question is empty"):
        generate(m, image, "  ")


# ---- the result


def test_generation_is_a_readout_that_round_trips(tmp_path):
    """kind "generate", JSON round trip, a one-line summary, the call's
    parameters, one "model output" audit row, an AnswerText of its ids; a
    session records it."""
    from core.session import Session

    m, image, question, _ = case_of(("own", "shapes-llava"))
    g = generate(m, image, question, max_new_tokens=4, stop_strings=["no such words"], top_k=3)
    assert isinstance(g, Readout) and g.kind == "generate"
    doc = json.loads(json.dumps(g.to_dict(), allow_nan=False))
    assert Generation.from_dict(doc) == g
    assert doc["input"] == {
        "question": question,
        "raw_prompt": False,
        "prompt_length": g.prompt_length,
        "dtype": "float32",  # what it ran in (Adapter.dtype_and_device), as the model block says
        "device": "cpu",
    }
    assert {k: doc["model"][k] for k in ("dtype", "device")} == {"dtype": "float32", "device": "cpu"}
    assert doc["model"]["spec"] == "shapes-llava" and doc["model"]["fingerprint"] == m.fingerprint
    line = g.summary()
    assert "\n" not in line and f"{len(g.token_ids)} tokens" in line and "KV cache" in line
    assert g.parameters() == {
        "question": question,
        "max_new_tokens": 4,
        "stop_strings": ["no such words"],
        "top_k": 3,
        "raw_prompt": False,
        "cache": True,
    }
    (row,) = g.audit_records()
    assert row.method == "model output" and row.supports == METHOD_TABLE["model output"]["supports"]
    assert row.parameters["stop_reason"] == g.stop_reason and row.parameters["n_tokens"] == len(g.token_ids)
    for k in range(len(g.token_ids)):
        assert g.answer_text(k) == AnswerText.of_ids(m.adapter, g.token_ids, k, text=g.text)
    assert g.answer_text(2).prefix_ids == tuple(g.token_ids[:2])
    with Session.create(tmp_path / "s.vlmr") as s:
        run_id = s.record(g, image=image, model=m)
        run = s.run(run_id)
    assert run.kind == "generate" and run.summary == line
    assert run.parameters == {**g.parameters(), "dtype": "float32", "device": "cpu"}  # what it ran in
    assert Generation.from_dict(run.result) == g and run.audits[0]["method"] == "model output"


# ---- the command


def test_cli_prints_each_token_and_writes_the_json(tmp_path, capsys):
    image = SAMPLES / "sample_00.png"
    out = tmp_path / "g.json"
    argv = ["generate", "--image", str(image), "--question", SHAPES_QUESTION, "--max-new-tokens", "4"]
    assert main([*argv, "--top-k", "3", "--json", str(out), "--quiet"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    g = generate(load_model("shapes-llava"), image, SHAPES_QUESTION, max_new_tokens=4, top_k=3)
    doc = json.loads(out.read_text())
    assert doc["token_ids"] == g.token_ids and doc["stop_reason"] == g.stop_reason
    assert doc["input"]["image"] == str(image) and len(doc["input"]["image_sha256"]) == 64
    assert Generation.from_dict(doc).token_ids == g.token_ids
    token_lines = [ln for ln in lines if ln.split()[0].isdigit()]
    assert len(token_lines) == len(g.token_ids)
    for i, (ln, token, prob) in enumerate(zip(token_lines, g.tokens, g.probs)):
        assert ln.split()[:3] == [str(i), repr(token), f"p={prob:.4f}"]
        assert ln.count(" | ") == 2  # three alternatives
    assert f"answer: {g.text}" in lines
    assert lines[-1].startswith(f"stop: {g.stop_reason} ({len(g.token_ids)} tokens, KV cache)")


def test_cli_records_the_generation_into_a_session(tmp_path, capsys):
    from core.session import Session

    path = tmp_path / "s.vlmr"
    argv = ["generate", "--image", str(SAMPLES / "sample_00.png"), "--question", SHAPES_QUESTION]
    assert main([*argv, "--max-new-tokens", "3", "--session", str(path), "--quiet"]) == 0
    session = Session.open(path, read_only=True)
    (info,) = session.runs("generate")
    run = session.run(info.id)
    g = Generation.from_dict(run.result)
    assert len(g.token_ids) == 3 and run.parameters["question"] == SHAPES_QUESTION
    assert run.image is not None and [a["method"] for a in run.audits] == ["model output"]
    capsys.readouterr()
    (tmp_path / "not.vlmr").write_text("no session")
    assert main([*argv, "--session", str(tmp_path / "not.vlmr"), "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_cli_stop_strings_and_no_cache(capsys):
    image = SAMPLES / "sample_00.png"
    m = load_model("shapes-llava")
    base = generate(m, image, SHAPES_QUESTION, max_new_tokens=4)
    stop = base.tokens[1]
    argv = ["generate", "--image", str(image), "--question", SHAPES_QUESTION, "--max-new-tokens", "4", "--quiet"]
    assert main([*argv, "--stop", "no such words", "--stop", stop, "--no-cache"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    want = generate(m, image, SHAPES_QUESTION, max_new_tokens=4, stop_strings=[stop])
    assert f"answer: {want.text}" in lines
    assert lines[-1] == f"stop: stop_string ({len(want.token_ids)} tokens, no cache)"


@pytest.mark.parametrize(
    "extra",
    [
        ["--model", "/no/such/model/folder"],
        ["--question", ""],
        ["--max-new-tokens", "0"],
        ["--top-k", "0"],
        ["--stop", ""],
        ["--image", "/no/such/image.png"],
    ],
    ids=["unknown-model", "empty-question", "zero-tokens", "zero-top-k", "empty-stop", "missing-image"],
)
def test_cli_bad_input_is_one_line_error(extra, capsys):
    argv = ["generate", "--image", str(SAMPLES / "sample_00.png"), "--question", SHAPES_QUESTION, "--quiet"]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
