"""Inputs the engine refuses, given to the window: the refusal is one line in
the window, nothing is shown as an answer, and the window keeps working."""

import shutil
from pathlib import Path

import pytest

import core
from tests.app.test_window import run_until_idle

BUILTIN = Path(__file__).resolve().parents[2] / "resources" / "models" / "shapes-llava"


@pytest.mark.parametrize(
    "question, named",
    [("what shape </s> is the blue object?", "'</s>'"), ("what <image> is it?", "'<image>'")],
)  # (a lone surrogate cannot reach the engine from the window: Qt's text fields hold only valid UTF-16)
@pytest.mark.parametrize("action", ["answer_question", "run_readout"])
def test_question_that_breaks_the_prompt_is_one_line_in_the_window(qtbot, window, question, named, action):
    good = window.question_edit.text()
    window.set_question(question)
    run_until_idle(qtbot, window, getattr(window, action))
    message = window.error_label.text()
    assert named in message and "\n" not in message and "Traceback" not in message
    assert window.status_label.text() == "failed"
    window.set_question(good)  # the window still answers
    run_until_idle(qtbot, window, window.answer_question)
    assert window.error_label.text() == "" and window.last_answer is not None


def test_model_folder_with_missing_weights_is_refused_in_the_window(qtbot, window, tmp_path):
    """A folder whose weights file lacks the language model head: named in the window, no answer shown."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken-llava"
    shutil.copytree(BUILTIN, folder)
    (folder / "MANIFEST.sha256").unlink(missing_ok=True)  # not a built-in any more: a user's folder
    weights = load_file(str(folder / "model.safetensors"))
    head = next(k for k in weights if "lm_head" in k)
    del weights[head]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    window.model_picker.setCurrentText(str(folder))
    run_until_idle(qtbot, window, window.answer_question)
    message = window.error_label.text()
    assert "lm_head" in message and "\n" not in message and window.status_label.text() == "failed"
    window.model_picker.setCurrentText("shapes-llava")
    run_until_idle(qtbot, window, window.answer_question)
    assert window.error_label.text() == "" and window.last_answer is not None
    assert isinstance(window.model_cache.get("shapes-llava"), core.LoadedModel)


def test_load_warning_stays_beside_the_status(qtbot, window, tmp_path):
    """Unexpected extra tensors load (with a warning): the window says so beside the answer's status."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "extra-llava"
    shutil.copytree(BUILTIN, folder)
    (folder / "MANIFEST.sha256").unlink(missing_ok=True)
    weights = load_file(str(folder / "model.safetensors"))
    weights["extra.probe.weight"] = weights[next(iter(weights))].clone()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    window.model_picker.setCurrentText(str(folder))
    run_until_idle(qtbot, window, window.answer_question)
    status = window.status_label.text()
    assert window.last_answer is not None and "warning: " in status and "extra.probe.weight" in status
    window.model_picker.setCurrentText("shapes-llava")
    run_until_idle(qtbot, window, window.answer_question)
    assert "warning" not in window.status_label.text()
