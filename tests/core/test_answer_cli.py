"""`vlm-readout answer` for one pair and for a JSONL of pairs; questions that do not fit."""

import json
import shutil

import pytest
import torch

from core import QuestionError, answer, answer_batch, load_model
from core.cli import main
from core.models.loading import resources_dir
from tests.core.exactness import forwards_tol, logit_terms_bound
from tests.tolerances import prob_tol, rounding_tol

SAMPLES = resources_dir() / "samples"


def test_single_answer_prints_answer_and_probability(capsys):
    assert (
        main(
            [
                "answer",
                "--model",
                "shapes-llava",
                "--image",
                str(SAMPLES / "sample_00.png"),
                "--question",
                "what shape is the blue object?",
            ]
        )
        == 0
    )
    word, prob = capsys.readouterr().out.strip().split("\t")
    a = answer(load_model("shapes-llava"), SAMPLES / "sample_00.png", "what shape is the blue object?")
    printed = 0.5e-4 + rounding_tol(1.0, torch.float64)  # the same run, printed with 4 decimals and parsed back
    assert word == a.answer and float(prob) == pytest.approx(a.prob, abs=printed)


@pytest.mark.parametrize("model", ["shapes-llava", "shapes-coca"])
def test_pairs_file_gives_one_line_per_pair_in_order(tmp_path, model):
    sub = tmp_path / "imgs"
    sub.mkdir()
    rows = [json.loads(x) for x in (SAMPLES / "pairs.jsonl").read_text().splitlines()][:5]
    lines = []
    for r in rows:
        shutil.copy(SAMPLES / r["image"], sub / r["image"])
        lines.append(json.dumps({"image": f"imgs/{r['image']}", "question": r["question"]}))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert (
        main(["answer", "--model", model, "--pairs", str(pairs), "--out", str(out), "--batch-size", "2", "--quiet"])
        == 0
    )
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["question"] for g in got] == [r["question"] for r in rows]
    assert [g["image"] for g in got] == [f"imgs/{r['image']}" for r in rows]
    loaded = load_model(model)
    direct = answer_batch(loaded, [SAMPLES / r["image"] for r in rows], [r["question"] for r in rows])
    # batches of 2 against one batch of 5 (other padding): each logit as far as two
    # forwards may be apart, through the float32 softmax
    a = loaded.adapter
    n_keys = 2 * len(a.visual_tokens((128, 128)))  # the visual tokens and a question no longer than them
    logit = forwards_tol(a, torch.tensor([logit_terms_bound(a)]), n_keys)
    for g, d in zip(got, direct):
        assert set(g) == {"image", "question", "answer", "prob", "top"}
        assert len(g["top"]) == 5 and g["top"][0][0] == g["answer"] == d.answer
        assert g["prob"] == pytest.approx(d.prob, abs=prob_tol(d.prob, logit, a.W_U.shape[1], torch.float32))
        assert [p for _, p in g["top"]] == sorted((p for _, p in g["top"]), reverse=True)


def test_bad_pairs_file_is_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"image": "x.png"}\n')
    assert main(["answer", "--pairs", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


@pytest.mark.parametrize("model", ["shapes-llava", "shapes-coca"])
def test_questions_that_do_not_fit(model):
    loaded = load_model(model)
    image = SAMPLES / "sample_00.png"
    with pytest.raises(QuestionError, match="zebra"):
        answer(loaded, image, "is there a zebra?")
    with pytest.raises(QuestionError, match="empty"):
        answer(loaded, image, "   ")
    with pytest.raises(QuestionError, match="too long"):
        answer(loaded, image, " ".join(["is the red circle left of the blue square?"] * 40))


def test_out_of_memory_is_a_one_line_error(monkeypatch):
    from core.errors import OutOfMemoryError

    loaded = load_model("shapes-llava")

    def explode(inputs):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 99999999999 bytes"
        )

    monkeypatch.setattr(loaded.adapter, "next_token_logits", explode)
    with pytest.raises(OutOfMemoryError, match="out of memory while answering") as e:
        answer(loaded, SAMPLES / "sample_00.png", "what shape is the blue object?")
    assert "\n" not in str(e.value)


def test_core_answer_and_capture_stay_callable_whatever_imports_first():
    """core/__init__ loads names lazily and importing a submodule binds the package
    attribute to the module: core.answer / core.forward.capture must still be the functions
    when called, in a fresh process where the submodules are imported first."""
    import subprocess
    import sys

    code = (
        "import core.answer, core.forward.capture, core.analyze\n"
        "import core\n"
        "m = core.load_model('shapes-llava')\n"
        "a = core.answer(m, 'resources/samples/sample_00.png', 'what shape is the blue object?')\n"
        "t = core.capture(m, 'resources/samples/sample_00.png', 'what shape is the blue object?')\n"
        "from core.forward.capture import Trace\n"
        "assert isinstance(t, Trace) and a.answer == 'square', (a, t)\n"
    )
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
