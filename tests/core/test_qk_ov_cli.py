"""`vlm-readout qk-ov` on the default models and a tiny random model of every
served family: its JSON is the library call's to the last digit, the two
levels stay apart, the activation-level scores are the model's own, the run
lands in a session and its export, bad heads and half inputs are one-line errors."""

import csv
import importlib
import json

import pytest
import torch

import core.cli
from core import load_model
from core.cli import build_parser, main
from core.files.images import load_image
from core.forward.capture import capture
from core.methods.qk_ov import ACTIVATION_FLAG, WEIGHT_FLAG, qk_circuit, qk_ov
from core.models.loading import resources_dir
from tests.core.exactness import noise_image, realized_scores_tol
from tests.core.test_qk_ov import svd_tol

SAMPLES = resources_dir() / "samples"
IMAGE, QUESTION = SAMPLES / "sample_00.png", "what shape is the blue object?"
FAMILIES = [("blip", "blip"), ("idefics3", "idefics3"), ("llava_next", "llava_next"), ("mllama", "mllama")]
FAMILIES += [("gemma3", "gemma3"), ("paligemma", "prefix"), ("qwen2_vl", "qwen2_vl"), ("qwen2_vl", "qwen2_5_vl")]
CASES = ["shapes-llava", "shapes-coca"] + [f"{family}:{kind}" for family, kind in FAMILIES]


def _case(name, tmp_path):
    """(loaded model, image path, question) of a default model or a family file's tiny model."""
    if ":" not in name:
        return load_model(name), IMAGE, QUESTION
    family, kind = name.split(":")
    module = importlib.import_module(f"tests.core.test_{family}")
    path = tmp_path / "noise.png"
    noise_image(module.IMAGE_SIZE).save(path)
    return module.traced_case(kind)[0], path, getattr(module, "QUESTION", None) or module.PREFIX


def _heads(adapter) -> list[str]:
    """A self-attention head, and a cross-attention one where the model has them."""
    names = {kind: f"{block}.H{adapter.n_heads - 1}" for block, kind in reversed(adapter.blocks)}
    return [names[kind] for kind in ("self", "cross") if kind in names]


@pytest.mark.parametrize("name", CASES)
def test_json_is_the_library_call_and_lands_in_the_session(name, tmp_path, monkeypatch, capsys):
    m, image, question = _case(name, tmp_path)
    a = m.adapter
    monkeypatch.setattr(core.cli, "_load", lambda args: m)
    session = tmp_path / "s.vlmr"
    n_audit = 0
    for head in _heads(a):
        out = tmp_path / f"{head}.json"
        args = ["qk-ov", "--head", head, "--image", str(image), "--question", question, "--json", str(out)]
        assert main([*args, "--session", str(session)]) == 0
        got = json.loads(out.read_text())
        library = qk_ov(m, head, image, question)
        assert got == json.loads(json.dumps(library.to_dict()))  # to the last digit
        assert capsys.readouterr().out.strip() == library.summary()
        assert got["schema_version"] == 1 and got["kind"] == "qk-ov" and got["head"]["name"] == head
        weight, act = got["weight_level"], got["activation_level"]
        assert weight["flag"] == WEIGHT_FLAG and act["flag"] == ACTIVATION_FLAG
        block, h = got["head"]["block"], got["head"]["head"]

        # weight level: the factored SVD's values are the dense form's
        circuit = qk_circuit(a, block, h)
        dense = torch.linalg.svdvals(circuit.full())[: a.d_head]
        torch.testing.assert_close(
            torch.tensor(weight["qk"]["singular_values"], dtype=dense.dtype), dense, atol=svd_tol(circuit), rtol=0
        )
        assert (weight["copying"] is None) == (got["head"]["block_kind"] == "cross")

        # activation level: the answer row's realised scores are the model's own (its recorded q . k)
        tr = capture(m, image, question, pattern_layers=[block], keep_qk=[block])
        pos = int(tr.answer_positions[0])
        assert act["position"] == pos
        q, k = tr.q[block][0, pos, h], tr.k[block][0]
        k = k[:, h // (a.n_heads // k.shape[1])]  # the head's key group
        theirs = (k @ q) * tr.score_scale[block]
        allowed = torch.tensor(act["allowed"])
        ours = torch.tensor(act["scores"], dtype=theirs.dtype)
        torch.testing.assert_close(ours[allowed], theirs[allowed], atol=realized_scores_tol(a, tr, block), rtol=0)
        recorded = tr.patterns[block][0, h, 0]
        assert act["top_keys"][0]["key"] == int(recorded.argmax())
        assert sum(act["pattern"]) == pytest.approx(1.0, abs=len(act["pattern"]) * 2**-23)
        n_audit += len(got["audit"])

    csv_out = tmp_path / "t.csv"
    assert main(["export", "--session", str(session), "--format", "csv", "--out", str(csv_out)]) == 0
    rows = [r for r in csv.DictReader(csv_out.open()) if r["kind"] == "qk-ov"]
    assert len(rows) == n_audit and {r["method"] for r in rows} == {"qk/ov circuit"}


def test_weight_level_only_without_an_input(tmp_path, monkeypatch, capsys):
    m = load_model("shapes-llava")
    monkeypatch.setattr(core.cli, "_load", lambda args: m)
    out, session = tmp_path / "w.json", tmp_path / "w.vlmr"
    assert (
        main(
            [
                "qk-ov",
                "--head",
                "L2.H0",
                "--copy-tokens",
                "circle,square",
                "--json",
                str(out),
                "--session",
                str(session),
            ]
        )
        == 0
    )
    got = json.loads(out.read_text())
    tokens = [i for w in ("circle", "square") for i in m.adapter.text_ids(w)]
    assert got == json.loads(json.dumps(qk_ov(m, "L2.H0", copy_tokens=tokens).to_dict()))
    assert (
        got["activation_level"] is None and got["input"] is None and got["weight_level"]["copying"]["tokens"] == tokens
    )
    from core.session import Session

    with Session.open(session) as s:
        (run,) = s.runs()
        assert run.kind == "qk-ov" and s.run(run.id).result == got


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--head", "L9.H0"], "names no component"),
        (["--head", "L1.mlp"], "is not a head"),
        (["--head", "L1.H9"], "have heads H0..H3"),
        (["--head", "L1.H0", "--question", "what shape?"], "--image and --question go together"),
        (["--head", "L1.H0", "--image", str(IMAGE)], "--image and --question go together"),
        (["--head", "L1.H0", "--answer-text", "circle"], "--answer-text needs --image"),
    ],
)
def test_bad_input_is_one_line_error(extra, message, tmp_path, capsys):
    assert main(["qk-ov", "--model", "shapes-llava", *extra, "--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err
    assert not (tmp_path / "x.json").exists()


def test_help_explains_every_argument():
    sub = build_parser()._subparsers._group_actions[0].choices["qk-ov"]
    for action in sub._actions:
        assert action.help, action.option_strings


def test_answer_text_reads_the_row_after_its_earlier_tokens(tmp_path, monkeypatch, capsys):
    from core.answer_text import AnswerText

    m = load_model("shapes-llava")
    monkeypatch.setattr(core.cli, "_load", lambda args: m)
    out = tmp_path / "t.json"
    args = ["qk-ov", "--head", "L1.H0", "--image", str(IMAGE), "--question", QUESTION, "--json", str(out)]
    assert main([*args, "--answer-text", "blue circle", "--token-index", "1"]) == 0
    got = json.loads(out.read_text())
    text = AnswerText.of_text(m.adapter, "blue circle", 1)
    assert got == json.loads(json.dumps(qk_ov(m, "L1.H0", IMAGE, QUESTION, answer_text=text).to_dict()))
    prompt_length = m.adapter.prepare([load_image(IMAGE)], [QUESTION]).input_ids.shape[1]
    assert got["activation_level"]["position"] == prompt_length - 1 + len(text.prefix_ids)
    assert got["input"]["answer_token_index"] == 1 and got["input"]["answer_text"] == "blue circle"
