"""Reading out at token k of an answer (teacher forcing, core.answer_text).

For every k, analyze on prompt + T[:k] must be the model's own computation at
that position: its lens's last row is the logits of one plain forward of the
prompt followed by the answer's first k tokens (built here by hand, not through
the adapter's append_tokens), and its frozen DLA sums to that forward's logit
difference minus the biases. k = 0 without a prefix is today's first-token
read-out, number for number."""

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from core import load_model
from core.analyze import AnalyzeResult, analyze
from core.answer_text import AnswerText, word_tokens
from core.cli import main
from core.errors import InputFileError, QuestionError
from core.files.images import load_image
from core.files.pairs import read_pairs
from core.methods.counterfactual import occlusion_sweep, region_counterfactual
from core.methods.interventions import patch_visual_features
from core.models.loading import resources_dir
from core.results.readout import Target
from core.session import Session
from core.zoo import scenes
from tests.core.exactness import forwards_tol, noise_image
from tests.tolerances import sum_tol

ANSWER = "red circle square"  # three tokens of the shapes vocabulary (and of the tiny tokenizers' words)


def _tiny(name: str):
    if name == "tiny-llava":
        from tests.core.test_capture_llava import tiny_llava_float64

        return tiny_llava_float64()
    if name == "tiny-qwen2-vl":
        from tests.core.test_qwen2_vl import tiny_qwen_float64

        return tiny_qwen_float64()
    if name == "tiny-coca":
        from tests.core.test_capture_coca import tiny_coca_float64

        return tiny_coca_float64()
    return load_model(name)


@pytest.fixture(scope="module", params=["shapes-llava", "tiny-llava", "tiny-qwen2-vl", "tiny-coca"])
def model_and_sample(request):
    loaded = _tiny(request.param)
    s = scenes.make_sample("heldout", 3)
    image = Image.fromarray(s.image) if request.param != "tiny-qwen2-vl" else noise_image((200, 150))
    question = s.question if request.param != "tiny-qwen2-vl" else "is there a red circle?"
    return loaded, image, question


@torch.no_grad()
def plain_logits(loaded, image, question: str, prefix: list[int]) -> torch.Tensor:
    """``(vocab,)`` the last position's logits of one plain forward of the prompt
    followed by ``prefix``: the bare prompt's tensors with the ids concatenated
    here, and the library's own forward (no hooks, no adapter forward)."""
    adapter = loaded.adapter
    t = dict(adapter.prompt_inputs([image], [question]).tensors)
    extra = torch.tensor([prefix], dtype=torch.long)
    if loaded.family == "coca":
        text = torch.cat([t["text"], extra.to(t["text"].device)], dim=1)
        return loaded.model(t["image"], text, output_labels=False)["logits"][0, -1]
    t["input_ids"] = torch.cat([t["input_ids"], extra.to(t["input_ids"].dtype)], dim=1)
    t["attention_mask"] = torch.cat([t["attention_mask"], torch.ones_like(extra)], dim=1)
    if "mm_token_type_ids" in t:  # Qwen2-VL: the appended tokens are text
        t["mm_token_type_ids"] = torch.cat([t["mm_token_type_ids"], torch.zeros_like(extra)], dim=1)
    return loaded.model(**t, use_cache=False).logits[0, -1]


@torch.no_grad()
def _bias_terms(adapter, answer_id: int, foil_id: int) -> float:
    """u^T b_U + u^T bias_f: what the frozen split leaves out of the logit difference."""
    u = adapter.W_U[:, answer_id] - adapter.W_U[:, foil_id]
    bias = float(adapter.b_U[answer_id] - adapter.b_U[foil_id])
    norm_bias = getattr(adapter.final_norm_layer(), "bias", None)
    if norm_bias is not None:
        bias += float(u.to(norm_bias.dtype) @ norm_bias)
    return bias


def test_every_answer_token_reads_the_plain_forward_of_its_prefix(model_and_sample):
    assert_every_answer_token_reads_the_plain_forward(*model_and_sample)


def assert_every_answer_token_reads_the_plain_forward(loaded, image, question: str) -> None:
    """analyze at every token k of ANSWER (teacher forcing) reads one plain forward
    of the prompt and the answer's first k tokens: the lens's last row and the frozen DLA sum."""
    adapter = loaded.adapter
    full = AnswerText.of_text(adapter, ANSWER)
    assert len(full.token_ids) == 3, full.tokens
    n_prompt = adapter.prepare([image], [question]).input_ids.shape[1]
    foil = "yes"  # a word of every vocabulary here: the logit difference and the frozen split are checked
    for k in range(len(full.token_ids)):
        at = full.at(k)
        d = analyze(loaded, image, question, answer_text=at, foil=foil).to_dict()
        assert d["target"]["position"] == n_prompt - 1 + k  # the sequence position read out
        assert d["input"]["answer_tokens"] == list(full.tokens)
        assert d["input"]["answer_token_index"] == k
        assert d["input"]["input_ids"][n_prompt:] == list(full.token_ids[:k])
        assert d["target"]["answer_id"] == full.token_ids[k]  # the target is token k unless named
        z = plain_logits(loaded, image, question, list(full.token_ids[:k])).double()
        answer_id, foil_id = full.token_ids[k], d["target"]["foil_id"]
        n_keys = max(n_prompt + k, 64)  # the most keys one softmax reads (CoCa's cross-attention: its image tokens)
        # two forwards reducing in other orders, then the lens's float32 logits (one rounding each, a difference two)
        tol = forwards_tol(adapter, z, n_keys) + 2 * float(z.abs().max()) * 2.0**-24
        last = d["logit_lens"][-1]
        assert last["answer_logit"] == pytest.approx(float(z[answer_id]), abs=tol)
        assert last["kl_to_final"] == 0.0
        diff = float(z[answer_id] - z[foil_id])
        assert last["logit_diff"] == pytest.approx(diff, abs=2 * tol)
        rd = d["residual_decomposition"]
        frozen = sum(c["dla_frozen"] for c in rd["components"])
        expected = diff - _bias_terms(adapter, answer_id, foil_id)
        # the components' frozen read-outs sum in another order than the model's one norm and unembedding
        terms = sum(abs(c["dla_frozen"]) for c in rd["components"]) + abs(expected)
        n_terms = len(rd["components"]) + 2
        assert frozen == pytest.approx(expected, abs=2 * tol + sum_tol(terms, n_terms, adapter.W_U.dtype))


def test_the_first_token_keeps_todays_numbers(model_and_sample):
    loaded, image, question = model_and_sample
    at = AnswerText.of_text(loaded.adapter, ANSWER).at(0)
    bare = analyze(loaded, image, question, answer=at.token).to_dict()
    forced = analyze(loaded, image, question, answer_text=at).to_dict()
    forced_input = {k: v for k, v in forced["input"].items() if not k.startswith("answer_")}
    assert forced_input == bare["input"]
    assert json.dumps({k: v for k, v in forced.items() if k != "input"}) == json.dumps(
        {k: v for k, v in bare.items() if k != "input"}
    )


def test_answer_text_errors_are_one_line():
    loaded = load_model("shapes-llava")
    a = loaded.adapter
    with pytest.raises(QuestionError, match=r"index 3 is outside the answer's 2 tokens \(0\.\.1: red \| circle\)"):
        AnswerText.of_text(a, "red circle", 3)
    with pytest.raises(QuestionError, match="empty"):
        AnswerText.of_text(a, "  ")
    with pytest.raises(QuestionError, match="integer"):
        AnswerText.of_text(a, "red", True)
    assert [t for _, t in word_tokens(a, "red circle")] == ["red", "circle"]
    assert a.as_token_id("red") == a.as_token_id(a.token_id("red")) == a.token_id("red")
    with pytest.raises(QuestionError, match="outside the model's"):
        a.as_token_id(10**6)
    with pytest.raises(QuestionError, match="a string or an id"):
        a.as_token_id(True)
    at = AnswerText.of_text(a, "red circle", 1)
    assert AnswerText.from_dict(at.to_dict()) == at
    assert at.prefix_ids == (a.token_id("red"),) and at.token_id == a.token_id("circle")


def test_append_tokens_refuses_a_padded_batch():
    loaded = load_model("shapes-llava")
    s = [scenes.make_sample("heldout", i) for i in range(2)]
    images = [Image.fromarray(x.image) for x in s]
    with pytest.raises(ValueError, match="padded"):
        loaded.adapter.prepare(images, [s[0].question, "is the red circle above the blue square?"], answer_prefix=[5])


# ---------------------------------------------------------------- the other read-outs at an answer token

SAMPLES = resources_dir() / "samples"


@pytest.fixture(scope="module")
def llava_sample():
    loaded = load_model("shapes-llava")
    s = scenes.make_sample("heldout", 3)
    return loaded, Image.fromarray(s.image), s.question, AnswerText.of_text(loaded.adapter, ANSWER, 2)


def test_counterfactual_and_sweep_read_the_same_answer_token(llava_sample):
    loaded, image, question, at = llava_sample
    z = plain_logits(loaded, image, question, list(at.prefix_ids))
    want = Target.from_logits(loaded.adapter, z, at.token_id, loaded.adapter.token_id("yes"))
    tol = forwards_tol(loaded.adapter, z.double(), 128)
    mask = np.zeros((image.height, image.width), dtype=bool)
    mask[10:40, 10:40] = True
    cf = region_counterfactual(
        loaded, image, question, mask, "mean", answer=at.token_id, foil="yes", answer_prefix=at.prefix_ids
    )
    sweep = occlusion_sweep(loaded, image, question, k=4, answer=at.token_id, foil="yes", answer_prefix=at.prefix_ids)
    for original in (cf.original, sweep.original):
        assert original.answer_id == at.token_id
        assert original.logit == pytest.approx(want.logit, abs=tol)
        assert original.logit_diff == pytest.approx(want.logit_diff, abs=2 * tol)
    assert cf.to_dict()["answer_prefix_ids"] == list(at.prefix_ids) == cf.parameters()["answer_prefix_ids"]
    assert sweep.to_dict()["answer_prefix_ids"] == list(at.prefix_ids)
    # the routing capture reads the same position: its rollout row is the prefixed prompt's
    assert cf.routing is not None


def _audit_dataset(tmp_path, rows):
    for name in {r["image"] for r in rows}:
        shutil.copy(SAMPLES / name, tmp_path / name)
    (tmp_path / "dataset.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_audit_reads_the_answer_token_analyze_reads(tmp_path, llava_sample):
    loaded, *_ = llava_sample
    pairs = [json.loads(line) for line in (SAMPLES / "pairs.jsonl").read_text().splitlines()[:3]]
    rows = [{k: p[k] for k in ("image", "question", "foil")} for p in pairs]
    rows[1]["answer_text"], rows[1]["answer_token_index"] = "red circle", 1  # its own answer text
    (tmp_path / "ds").mkdir()
    ds = _audit_dataset(tmp_path / "ds", rows)
    out = tmp_path / "out"
    assert main(["audit", "--dataset", str(ds), "--out", str(out), "--methods", "answer,lens,dla", "--quiet"]) == 0
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for row, rec in zip(rows, records):
        at = None
        if "answer_text" in row:
            at = AnswerText.of_text(loaded.adapter, row["answer_text"], row["answer_token_index"])
        ref = analyze(loaded, ds / row["image"], row["question"], foil=row["foil"], answer_text=at).to_dict()
        assert rec["answer_text"] == row.get("answer_text")
        assert rec["readouts"]["answer"]["answer_logit"] == ref["target"]["logit"]  # one sample alone: the same run
        assert rec["readouts"]["answer"]["logit_diff"] == ref["target"]["logit_diff"]
    # the command line's answer text over every item
    out2 = tmp_path / "out2"
    args = ["audit", "--dataset", str(ds), "--out", str(out2), "--methods", "answer", "--quiet"]
    assert main([*args, "--answer-text", ANSWER, "--token-index", "2"]) == 0
    records = [json.loads(line) for line in (out2 / "samples.jsonl").read_text().splitlines()]
    at = AnswerText.of_text(loaded.adapter, ANSWER, 2)
    for row, rec in zip(rows, records):
        ref = analyze(loaded, ds / row["image"], row["question"], foil=row["foil"], answer_text=at).to_dict()
        assert rec["answer_token_index"] == 2
        # the answer method alone runs the plain forward, analyze the capture's eager one: other reduction orders
        logit = ref["target"]["logit"]
        tol = forwards_tol(loaded.adapter, torch.tensor([logit]), len(ref["input"]["input_ids"]))
        assert rec["readouts"]["answer"]["answer_logit"] == pytest.approx(logit, abs=tol)


def test_pairs_file_answer_token_index_is_checked(tmp_path):
    rows = [{"image": "sample_00.png", "question": "what shape is the blue object?", "answer_token_index": 1}]
    (tmp_path / "d.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(InputFileError, match='d.jsonl:1: "answer_token_index" needs an "answer_text"'):
        read_pairs(tmp_path / "d.jsonl")
    rows[0].update(answer_text="red", answer_token_index=-1)
    (tmp_path / "d.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(InputFileError, match="must be a non-negative integer"):
        read_pairs(tmp_path / "d.jsonl")


def test_analyze_and_counterfactual_command_lines(tmp_path, capsys, llava_sample):
    loaded, *_ = llava_sample
    base = ["--image", str(SAMPLES / "sample_00.png"), "--question", "what shape is the blue object?"]
    out = tmp_path / "a.json"
    assert main(["analyze", *base, "--answer-text", ANSWER, "--token-index", "1", "--json", str(out), "--quiet"]) == 0
    d = json.loads(out.read_text())
    assert d["input"]["answer_token_index"] == 1 and d["target"]["answer"] == "circle"
    assert "at answer token 1 'circle' of 'red circle square'" in capsys.readouterr().out
    assert main(["analyze", *base, "--answer-text", ANSWER, "--token-index", "5", "--json", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "error: --token-index 5 is outside the 3 tokens of --answer-text 'red circle square' (0..2: red | circle | square)"
    )
    assert err.count("\n") == 1
    assert main(["analyze", *base, "--token-index", "1", "--json", str(out), "--quiet"]) == 2
    assert "error: --token-index needs --answer-text" in capsys.readouterr().err
    mask = tmp_path / "m.png"
    Image.fromarray((np.arange(128 * 128).reshape(128, 128) % 128 < 40).astype(np.uint8) * 255).save(mask)
    cf = tmp_path / "cf.json"
    args = ["counterfactual", *base, "--mask", str(mask), "--answer-text", ANSWER, "--token-index", "2"]
    assert main([*args, "--json", str(cf), "--no-routing"]) == 0
    doc = json.loads(cf.read_text())
    at = AnswerText.of_text(loaded.adapter, ANSWER, 2)
    assert doc["answer_prefix_ids"] == list(at.prefix_ids) and doc["original"]["answer_id"] == at.token_id
    assert doc["input"]["answer_token_index"] == 2


def test_visual_patching_reads_the_same_answer_token(llava_sample):
    loaded, image, question, at = llava_sample
    other = Image.fromarray(scenes.make_sample("heldout", 4).image)
    result = patch_visual_features(
        loaded,
        image,
        question,
        other,
        site="projector_out",
        token_sets={"first": [0, 1]},
        answer=at.token_id,
        foil="yes",
        answer_prefix=at.prefix_ids,
        reverse=False,
    )
    for img, target in ((image, result.original), (other, result.source)):
        z = plain_logits(loaded, img, question, list(at.prefix_ids))
        tol = forwards_tol(loaded.adapter, z.double(), 128)
        assert target.logit == pytest.approx(float(z[at.token_id]), abs=tol)
    assert result.original.position == loaded.adapter.prepare([image], [question]).input_ids.shape[1] - 1 + 2
    assert result.parameters()["answer_prefix_ids"] == list(at.prefix_ids) == result.to_dict()["answer_prefix_ids"]


def test_a_session_records_the_answer_token(tmp_path, llava_sample):
    loaded, image, question, at = llava_sample
    result = analyze(loaded, image, question, answer_text=at, foil="yes")
    path = tmp_path / "s.vlmr"
    session = Session.create(path)
    run_id = session.record(result, image=image, model=loaded)
    session.close()
    run = Session.open(path, read_only=True).run(run_id)
    assert run.target["answer_token_index"] == 2 and run.target["position"] == result.target.position
    assert run.parameters["answer_text"] == ANSWER
    restored = AnalyzeResult.from_dict(run.result)
    assert restored.answer_text == at and restored.summary() == result.summary()


def test_analyze_reads_a_generated_answer_by_its_ids(tmp_path, capsys, llava_sample):
    loaded, *_ = llava_sample
    question = "what shape is the blue object?"
    base = ["--image", str(SAMPLES / "sample_00.png"), "--question", question]
    gen = tmp_path / "g.json"
    assert main(["generate", *base, "--max-new-tokens", "3", "--json", str(gen), "--quiet"]) == 0
    ids = json.loads(gen.read_text())["token_ids"]
    out = tmp_path / "a.json"
    k = len(ids) - 1
    assert (
        main(["analyze", *base, "--answer-from", str(gen), "--token-index", str(k), "--json", str(out), "--quiet"]) == 0
    )
    d = json.loads(out.read_text())
    assert d["input"]["answer_token_ids"] == ids and d["target"]["answer_id"] == ids[k]
    n_prompt = loaded.adapter.prepare([load_image(SAMPLES / "sample_00.png")], [question]).input_ids.shape[1]
    assert d["input"]["input_ids"][n_prompt:] == ids[:k]
    capsys.readouterr()
    other = ["--image", str(SAMPLES / "sample_00.png"), "--question", "is the red circle above the blue square?"]
    assert main(["analyze", *other, "--answer-from", str(gen), "--json", str(out), "--quiet"]) == 2
    assert "generated for the question 'what shape is the blue object?'" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"kind": "analyze"}')
    assert main(["analyze", *base, "--answer-from", str(tmp_path / "bad.json"), "--json", str(out), "--quiet"]) == 2
    assert "not a generate JSON" in capsys.readouterr().err
    assert main(["analyze", *base, "--answer-text", "red", "--answer-from", str(gen), "--json", str(out)]) == 2


def test_the_command_line_reads_every_answer_token_as_the_plain_forward(tmp_path, llava_sample):
    """``vlm-readout analyze --answer-text T --token-index K`` for every K: the lens's
    last row is the plain forward of prompt + T[:K], the frozen split sums to its
    logit difference minus the biases."""
    loaded, *_ = llava_sample
    adapter = loaded.adapter
    image, question = SAMPLES / "sample_00.png", "what shape is the blue object?"
    full = AnswerText.of_text(adapter, ANSWER)
    out = tmp_path / "a.json"
    for k in range(len(full.token_ids)):
        args = ["analyze", "--image", str(image), "--question", question, "--foil", "yes", "--json", str(out)]
        assert main([*args, "--answer-text", ANSWER, "--token-index", str(k), "--quiet"]) == 0
        d = json.loads(out.read_text())
        z = plain_logits(loaded, load_image(image), question, list(full.token_ids[:k])).double()
        a, f = full.token_ids[k], adapter.token_id("yes")
        tol = forwards_tol(adapter, z, len(d["input"]["input_ids"])) + 2 * float(z.abs().max()) * 2.0**-24
        diff = float(z[a] - z[f])
        assert d["logit_lens"][-1]["logit_diff"] == pytest.approx(diff, abs=2 * tol)
        comps = d["residual_decomposition"]["components"]
        terms = sum(abs(c["dla_frozen"]) for c in comps) + abs(diff)
        frozen_tol = 2 * tol + sum_tol(terms, len(comps) + 2, adapter.W_U.dtype)
        assert sum(c["dla_frozen"] for c in comps) == pytest.approx(diff - _bias_terms(adapter, a, f), abs=frozen_tol)
