"""Options of the command line that name a device, a number the run allocates
by, a token or a word: each bad value is one line naming the option (argparse's
``error: argument --X: ...`` at parse time, or ``error: --X ...`` once the model
is there to say what it lacks), exit status 2, no traceback, nothing written.

* ``--device``: a name that is no device, a kind the read-outs do not run on, a
  GPU or index this machine lacks: refused at parse time, listing the devices
  it has (the loader makes the same check for the library and the app).
* ``train-lens`` / ``eval-lens``: every count and rate bounded at parse time
  (steps, batch, widths, threads, learning rate, weight decay); what a lens
  would allocate with the model's own sizes checked against the memory
  available before anything is allocated; a run that diverges stops with one
  line and saves nothing.
* ``--answer`` / ``--foil`` / ``--answer-text`` / ``--copy-tokens`` / ``--stop``:
  empty or blank text, text that is not UTF-8, markup (an image placeholder, a
  special token, for every family), several tokens, words the vocabulary lacks.
* CoCa's raw prompts: an image placeholder of its tokenizer stays refused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import core.cli
from core import load_model
from core.cli import build_parser, main
from core.cli.args import device_name
from core.cli.qk_ov import MAX_COPY_TOKENS
from core.errors import ModelLoadError, QuestionError
from core.methods.tuned_lens import LensConfig, LensError, train_lens
from core.models.loading import resources_dir
from core.shell.arguments import MAX_BATCH, Number, thread_count
from core.shell.precision import check_device, device_problem
from tests.core.test_trust_prompt import MODELS, built

ROOT = Path(__file__).resolve().parents[2]
IMAGE = resources_dir() / "samples" / "sample_00.png"
QUESTION = "what shape is the blue object?"
_models: dict = {}


def _model(spec: str):
    if spec not in _models:
        _models[spec] = load_model(spec)
    return _models[spec]


@pytest.fixture
def cached_load(monkeypatch):
    """Every command's model from a cache (the loader's own checks are tested apart)."""
    monkeypatch.setattr(core.cli, "_load", lambda args: _model(args.model))


def _refused(capsys, argv: list[str], starts: str) -> str:
    """``main(argv)`` exits 2 with exactly one ``error:`` line starting ``error: {starts}``."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(f"error: {starts}"), lines[0]
    return lines[0]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


# ---------------------------------------------------------------- devices

BAD_DEVICES = {
    "bogus": "not a device",
    "": "not a device",
    " cuda": "not a device",
    "cuda:0 ": "not a device",
    "cuda:-1": "not a device",
    "Cuda": "not a device",
    "cuda:99999999999": "not a device",
    "gpu" * 1000: "not a device",
    "meta": "not supported",
    "xpu:0": "not supported",
    "cpu:1": "no such device",
    "mps:1": "MPS is not available",
}


@pytest.fixture
def no_gpu(monkeypatch):
    """This machine as one without CUDA or MPS, whatever it has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


@pytest.mark.parametrize("device", [*BAD_DEVICES, "cuda", "cuda:1", "cuda:99", "mps"], ids=repr)
def test_a_device_this_machine_lacks_is_refused_at_parse_time_naming_the_ones_it_has(capsys, no_gpu, device):
    expected = BAD_DEVICES.get(device) or ("MPS" if device == "mps" else "CUDA is not available on this machine")
    shown = repr(device if len(device) <= 40 else device[:40] + "...")
    line = _refused(capsys, ["answer", "--image", str(IMAGE), "--question", QUESTION, "--device", device], "")
    assert line.startswith(f"error: argument --device: {shown}: "), line
    assert expected in line and line.endswith("available: cpu"), line
    assert len(line) < 300  # a long name is shown by its start


def test_every_command_checks_device_when_it_parses(capsys, no_gpu):
    with_device = [name for name, sp in _subcommands().items() if "--device" in sp._option_string_actions]
    assert {"answer", "analyze", "generate", "train-lens", "eval-lens", "qk-ov", "validate"} <= set(with_device)
    for name, sp in _subcommands().items():
        if name in with_device:
            assert sp._option_string_actions["--device"].type is device_name, name
    for name in with_device:
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([name, "--device", "cuda:7"])
        assert e.value.code == 2
        assert capsys.readouterr().err.startswith("error: argument --device: 'cuda:7': CUDA is not available")


def test_the_gpus_listed_are_this_machines(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"Test GPU {i}")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    here = "available: cpu, cuda:0 (Test GPU 0), cuda:1 (Test GPU 1)"
    for good in ("cuda", "cuda:0", "cuda:1", "cpu", "cpu:0", "auto", torch.device("cuda:1")):
        assert device_problem(good) is None
    assert device_problem("cuda:2") == f"no such device (this machine has 2 CUDA device(s), cuda:0 to cuda:1); {here}"
    assert device_problem("mps") == f"MPS is not available on this machine; {here}"
    assert device_problem("tpu") == f"not a device (expected cpu, cuda, cuda:N, mps or auto); {here}"
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'cuda:5': no such device .*cuda:1 \(Test GPU 1\)$"):
        device_name("cuda:5")


def test_the_loader_refuses_a_device_in_one_line_before_reading_anything(no_gpu, tmp_path):
    for device, expected in [("cuda:3", "CUDA is not available"), ("meta", "not supported"), (0, "not a device name")]:
        with pytest.raises(ModelLoadError) as e:
            load_model(str(tmp_path / "no-such-model"), device=device)  # the device is checked first
        message = str(e.value)
        assert message.startswith(f"device {str(device)!r}: ") and expected in message and "\n" not in message
    assert check_device(torch.device("cpu")) == "cpu" and check_device(None) is None


def test_a_bad_device_in_a_fresh_process_is_one_line():
    argv = [sys.executable, "-m", "core.cli", "answer", "--image", str(IMAGE), "--question", QUESTION]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, whatever the machine has
    r = subprocess.run([*argv, "--device", "cuda:9"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.startswith(
        "error: argument --device: 'cuda:9': CUDA is not available on this machine; available: cpu"
    )
    assert r.stderr.count("\n") == 1


# ---------------------------------------------------------------- numbers: train-lens, eval-lens and the others

LENS_BAD = [
    ("train-lens", "--steps", "0", "must be a positive integer (got 0)"),
    ("train-lens", "--steps", "-5", "must be a positive integer"),
    ("train-lens", "--steps", "10000000000", "must be at most 1000000"),
    ("train-lens", "--lr", "1e30", "must be at most 10"),
    ("train-lens", "--lr", "1e999", "must be a number in (0, 10]"),
    ("train-lens", "--lr", "nan", "must be a number in (0, 10]"),
    ("train-lens", "--lr", "0", "must be a positive number"),
    ("train-lens", "--weight-decay", "1e300", "must be at most 10"),
    ("train-lens", "--hidden", "2000000000", "must be at most 65536"),
    ("train-lens", "--rank", "99999999", "must be at most 65536"),
    ("train-lens", "--batch-size", "1000000", f"must be at most {MAX_BATCH}"),
    ("train-lens", "--threads", "1000000000", f"must be at most {thread_count.hi}"),
    ("train-lens", "--threads", str(thread_count.hi + 1), f"must be at most {thread_count.hi}"),
    ("train-lens", "--eval-n", "1e12", "must be an integer"),
    ("train-lens", "--shifted-n", "10000000000", "must be at most 1000000"),
    ("eval-lens", "--threads", "1000000000", f"must be at most {thread_count.hi}"),
    ("eval-lens", "--n", "10000000000", "must be at most 1000000"),
    ("eval-lens", "--batch-size", "99999", f"must be at most {MAX_BATCH}"),
    ("evaluate-zoo", "--n", "2147483647", "must be at most 1000000"),
    ("evaluate-zoo", "--batch-size", "2147483647", f"must be at most {MAX_BATCH}"),
    ("answer", "--batch-size", "100000", f"must be at most {MAX_BATCH}"),
    ("counterfactual", "--batch-size", "100000", f"must be at most {MAX_BATCH}"),
    ("audit", "--batch-size", "2147483647", f"must be at most {MAX_BATCH}"),
    ("validate", "--n", "2147483647", "must be at most 10000"),
    ("validate", "--n-side", "2147483647", "must be at most 10000"),
    ("validate", "--batch-size", "100000", f"must be at most {MAX_BATCH}"),
    ("nonunique", "--steps", "2147483647", "must be at most 100000"),
]


@pytest.mark.parametrize(
    ("command", "option", "value", "message"), LENS_BAD, ids=[f"{c} {o} {v}" for c, o, v, _ in LENS_BAD]
)
def test_counts_and_rates_are_bounded_at_parse_time(capsys, command, option, value, message):
    line = _refused(capsys, [command, f"{option}={value}"], f"argument {option}: ")
    assert line == f"error: argument {option}: {message} (got {value})" or message in line, line


def test_every_batch_and_thread_option_is_bounded():
    """The class, not the examples: every --batch-size and --threads of every command has an upper bound."""
    seen = set()
    for name, sp in _subcommands().items():
        for option in ("--batch-size", "--threads"):
            action = sp._option_string_actions.get(option)
            if action is None:
                continue
            seen.add((name, option))
            assert isinstance(action.type, Number) and action.type.hi is not None, (name, option)
            assert action.type.hi <= (MAX_BATCH if option == "--batch-size" else os.cpu_count()), (name, option)
    assert {("train-lens", "--threads"), ("eval-lens", "--batch-size"), ("audit", "--batch-size")} <= seen


@pytest.fixture
def small_memory(monkeypatch):
    monkeypatch.setenv("VLM_READOUT_MEMORY_AVAILABLE", "200MB")


def test_a_lens_larger_than_memory_is_refused_before_it_is_allocated(capsys, cached_load, small_memory, tmp_path):
    out = tmp_path / "lens"
    base = ["train-lens", "--out", str(out), "--steps", "1", "--no-eval", "--quiet"]
    line = _refused(capsys, [*base, "--form", "mlp", "--hidden", "65536"], "--form mlp --hidden 65536: ")
    assert "the lens needs ~0.8 GB for 4 blocks of width 128" in line and "0.2 GB is available" in line
    line = _refused(capsys, [*base, "--batch-size", "2048"], "--batch-size 2048: a training step needs ~")
    assert line.endswith("try a smaller --batch-size or --positions answer")
    _refused(
        capsys, [*base, "--form", "lowrank", "--rank", "129"], "--rank 129 is more than the model's residual width 128"
    )
    assert not out.exists()


def test_a_diverging_lens_is_one_line_and_saves_nothing(capsys, cached_load, monkeypatch, tmp_path):
    """A non-finite loss (a rate too large for the model) stops training at once: one line, no lens written,
    and a checkpoint from an earlier run keeps its bytes."""
    import core.methods.tuned_lens.training as training

    out, checkpoint = tmp_path / "lens", tmp_path / "run.ckpt"
    checkpoint.write_bytes(b"an earlier run's checkpoint")
    monkeypatch.setattr(training, "_kl_nats", lambda target, logp: torch.full(logp.shape[:-1], float("inf")))
    argv = ["train-lens", "--out", str(out), "--steps", "2", "--batch-size", "2", "--no-eval", "--quiet"]
    line = _refused(
        capsys, [*argv, "--checkpoint", str(checkpoint)], "--lr 0.3: the training loss became inf at step 0"
    )
    assert line.endswith("try a smaller --lr; nothing was saved")
    assert not out.exists() and checkpoint.read_bytes() == b"an earlier run's checkpoint"


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_an_overflowing_step_is_caught_before_it_is_checkpointed(tmp_path, optimizer):
    """The library path: a rate that overflows the translators raises LensError at that step (not the
    SVD's traceback at the end), and no checkpoint holds the overflowed state: the last one written
    (a checkpoint every step) is finite."""
    from core.zoo.lens_corpus import SyntheticCorpus

    checkpoint = tmp_path / "run.ckpt"
    cfg = LensConfig(steps=4, batch_size=2, lr=1e30, warmup=0.0, checkpoint_every=1, optimizer=optimizer)
    with pytest.raises(
        LensError, match=r"^--lr 1e\+30: the (training loss became nan|translators' weights overflowed) "
    ):
        train_lens(_model("shapes-llava"), SyntheticCorpus("train"), cfg, checkpoint=checkpoint)
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        assert all(torch.isfinite(t).all() for t in state["lens"].values())


def test_a_rate_no_optimizer_can_take_is_refused_before_training(tmp_path):
    from core.zoo.lens_corpus import SyntheticCorpus

    for field, value in [("lr", float("inf")), ("lr", float("nan")), ("lr", 1e300), ("weight_decay", -1.0)]:
        option = "--" + field.replace("_", "-")
        with pytest.raises(LensError, match=rf"^{option} .*: expected a number from 0 to 1e30"):
            train_lens(_model("shapes-llava"), SyntheticCorpus("train"), LensConfig(steps=1, **{field: value}))


# ---------------------------------------------------------------- tokens and words


def _analyze(tmp_path, *extra: str, model: str = "shapes-llava") -> list[str]:
    return ["analyze", "--model", model, "--image", str(IMAGE), "--question", QUESTION, *extra,
            "--json", str(tmp_path / "out.json"), "--quiet"]  # fmt: skip


TOKEN_CASES = [
    ("--answer", "<image>", "--answer '<image>' holds the image placeholder '<image>'"),
    ("--answer", "what <image>", "--answer 'what <image>' holds the image placeholder '<image>'"),
    ("--foil", "</s>", "--foil '</s>' holds the special token '</s>'"),
    ("--foil", "<unk>", "--foil '<unk>' holds the special token '<unk>'"),
    ("--foil", "", "--foil is empty (leave --foil out for its default)"),
    ("--foil", " \t", "--foil is empty (whitespace only) (leave --foil out for its default)"),
    ("--answer", "\udcff", "--answer is not valid text (character 0 is '\\udcff', which UTF-8 cannot encode)"),
    ("--answer", "zzqqxx", "--answer 'zzqqxx' is not in this model's vocabulary"),
    (
        "--answer",
        "x" * 5000,
        "--answer 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... (5,000 characters) "
        "is not a single token for this model (over 1000 characters)",
    ),  # fmt: skip
    ("--answer-text", "<image> blue", "--answer-text '<image> blue' holds the image placeholder '<image>'"),
    ("--answer-text", "", "--answer-text is empty"),
    ("--answer-text", "zzqqxx blue", "--answer-text 'zzqqxx blue' uses words this model's vocabulary does not have"),
]


@pytest.mark.parametrize(
    ("option", "value", "message"), TOKEN_CASES, ids=[f"{o} {v[:20]!r}" for o, v, _ in TOKEN_CASES]
)
@pytest.mark.parametrize("command", ["analyze", "counterfactual"])
def test_an_answer_or_foil_that_is_no_token_is_one_line(capsys, cached_load, tmp_path, command, option, value, message):
    out = tmp_path / "out.json"
    out.write_text("an earlier result\n")
    argv = _analyze(tmp_path, option, value)
    if command == "counterfactual":
        argv = ["counterfactual", *argv[1:], "--sweep", "4"]
    line = _refused(capsys, argv, message)
    assert "\n" not in line and out.read_text() == "an earlier result\n"


@pytest.mark.parametrize("command", ["analyze", "counterfactual"])
def test_an_answer_of_several_tokens_reads_its_first_as_the_app_does(capsys, cached_load, tmp_path, command):
    """One rule for a typed answer (core.answer_text.typed_token), the command
    line's and the app's Target field's: several tokens read the first, said in
    one warning line (was: refused here, read there)."""
    from core.requests import AskedRequest  # the app's fields go through the same request

    argv = _analyze(tmp_path, "--answer", "blue square")
    if command == "counterfactual":
        argv = ["counterfactual", *argv[1:], "--sweep", "4"]
    assert main(argv) == 0
    assert capsys.readouterr().err == (
        "warning: --answer 'blue square' is 2 tokens for this model: blue | square; reading its first sub-token 'blue'\n"
    )
    doc = json.loads((tmp_path / "out.json").read_text())
    adapter = load_model("shapes-llava").adapter
    read = doc["target"]["answer_id"] if command == "analyze" else doc["original"]["answer_id"]
    typed = AskedRequest(image=None, question="", answer="blue square").tokens(adapter)["answer"]
    assert read == typed == adapter.token_id("blue")


def test_a_token_index_outside_the_answer_names_both_options(capsys, cached_load, tmp_path):
    _refused(
        capsys,
        _analyze(tmp_path, "--answer-text", "blue square", "--token-index", "9"),
        "--token-index 9 is outside the 2 tokens of --answer-text 'blue square' (0..1: blue | square)",
    )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_no_family_takes_markup_as_an_answer_or_foil(name):
    """Every family: each of its placeholders and special tokens (and each with a word beside it) is
    refused as an answer or foil in one line starting with the option, whatever the tokenizer makes of it."""
    adapter = built(name).adapter
    markup = adapter.markup
    strings = [*markup.placeholders, *markup.special]
    assert strings, name
    for s in strings:
        for text in (s, f"{s}blue"):
            with pytest.raises(QuestionError) as e:
                adapter.token_id(text, what="--foil")
            message = str(e.value)
            assert message.startswith(f"--foil {text!r} ") and "\n" not in message, message
    for blank in ("", " ", "\n\t"):
        with pytest.raises(QuestionError, match=r"^--answer is empty"):
            adapter.token_id(blank, what="--answer")


COPY_CASES = [
    ("zzqqxx,blue", "--copy-tokens word 'zzqqxx' uses words this model's vocabulary does not have: zzqqxx"),
    ("blue,,red", "--copy-tokens 'blue,,red': word 2 is empty"),
    ("blue, ", "--copy-tokens 'blue, ': word 2 is empty"),
    ("", "--copy-tokens is empty"),
    ("blue,<image>", "--copy-tokens word '<image>' holds the image placeholder '<image>'"),
    ("</s>", "--copy-tokens word '</s>' holds the special token '</s>'"),
    (",".join(["blue"] * (MAX_COPY_TOKENS + 1)), f"--copy-tokens: {MAX_COPY_TOKENS + 1:,} words; the copying score"),
]


@pytest.mark.parametrize(("words", "message"), COPY_CASES, ids=[w[:20] for w, _ in COPY_CASES])
def test_copy_tokens_the_model_lacks_are_refused(capsys, cached_load, tmp_path, words, message):
    out = tmp_path / "qk.json"
    argv = ["qk-ov", "--head", "L1.H0", "--copy-tokens", words, "--json", str(out)]
    _refused(capsys, argv, message)
    assert not out.exists()


def test_copy_tokens_on_a_cross_attention_head_are_refused_not_skipped(capsys, cached_load, tmp_path):
    argv = ["qk-ov", "--model", "shapes-coca", "--head", "L1.xattn.H0", "--json", str(tmp_path / "qk.json")]
    _refused(capsys, [*argv, "--copy-tokens", "blue"], "--copy-tokens: L1.xattn.H0 is a cross-attention head")
    assert main(argv) == 0  # without --copy-tokens the weight level is read out, the copying score skipped
    capsys.readouterr()


def test_the_copy_token_bound_is_the_methods():
    from core.methods.qk_ov import COPYING_VOCAB_LIMIT

    assert MAX_COPY_TOKENS == COPYING_VOCAB_LIMIT


def test_an_empty_stop_string_is_refused_and_whitespace_is_one(capsys, cached_load, tmp_path):
    base = ["generate", "--image", str(IMAGE), "--question", QUESTION, "--max-new-tokens", "2", "--quiet"]
    _refused(
        capsys, [*base, "--stop", "x", "--stop", ""], "--stop is empty (a stop string is text the answer stops after)"
    )
    _refused(capsys, [*base, "--stop", "\udcfe"], "--stop is not valid text")
    assert main([*base, "--stop", "\n"]) == 0
    capsys.readouterr()


# ---------------------------------------------------------------- CoCa's raw prompts


@pytest.mark.parametrize("name", ["coca", "shapes-coca"])
def test_coca_refuses_an_image_placeholder_in_raw_prompts(name):
    adapter = built(name).adapter
    assert adapter.markup.placeholders == {"<image>": "image"}
    for question in ("<image> what shape is it?", "what shape is <image>?"):
        for raw in (False, True):
            with pytest.raises(QuestionError, match=r"^the question may not contain the image placeholder '<image>'"):
                adapter.check_question(question, raw_prompt=raw)
    adapter.check_question(QUESTION, raw_prompt=True)


def test_coca_raw_prompt_with_a_placeholder_is_one_line_from_the_cli(capsys, cached_load, tmp_path):
    argv = ["answer", "--model", "shapes-coca", "--image", str(IMAGE), "--question", "what <image> is blue?"]
    _refused(capsys, [*argv, "--raw-prompt"], "the question may not contain the image placeholder '<image>'")
