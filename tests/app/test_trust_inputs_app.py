"""Inputs the engine refuses, given to the window: the refusal is one line in
the window, nothing is shown as an answer, and the window keeps working."""

import shutil
from pathlib import Path

import pytest

import core
from tests.app.shown import shown_result
from tests.app.test_window import run_until_idle

BUILTIN = Path(__file__).resolve().parents[2] / "resources" / "models" / "shapes-llava"


@pytest.mark.parametrize(
    "question, named",
    [("what shape </s> is the blue object?", "'</s>'"), ("what <image> is it?", "'<image>'")],
)  # (a lone surrogate cannot reach the engine from the window: Qt's text fields hold only valid UTF-16)
@pytest.mark.parametrize("action", ["answer_question", "run_readout"])
def test_question_that_breaks_the_prompt_is_one_line_in_the_window(qtbot, window, question, named, action):
    good = window.inputs.question_edit.text()
    window.set_question(question)
    run_until_idle(qtbot, window, getattr(window.actions, action))
    message = window.inputs.error_label.text()
    assert named in message and "\n" not in message and "Traceback" not in message
    assert window.inputs.status_label.text() == "failed"
    window.set_question(good)  # the window still answers
    run_until_idle(qtbot, window, window.actions.answer_question)
    assert window.inputs.error_label.text() == "" and shown_result(window, "answer") is not None


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
    window.inputs.model_picker.setCurrentText(str(folder))
    run_until_idle(qtbot, window, window.actions.answer_question)
    message = window.inputs.error_label.text()
    assert "lm_head" in message and "\n" not in message and window.inputs.status_label.text() == "failed"
    window.inputs.model_picker.setCurrentText("shapes-llava")
    run_until_idle(qtbot, window, window.actions.answer_question)
    assert window.inputs.error_label.text() == "" and shown_result(window, "answer") is not None
    assert isinstance(window.model_cache.get(window.model_choice()), core.LoadedModel)  # keyed by ModelChoice


def test_load_warning_stays_beside_the_status(qtbot, window, tmp_path):
    """Unexpected extra tensors load (with a warning): the window says so beside the answer's status."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "extra-llava"
    shutil.copytree(BUILTIN, folder)
    (folder / "MANIFEST.sha256").unlink(missing_ok=True)
    weights = load_file(str(folder / "model.safetensors"))
    weights["extra.probe.weight"] = weights[next(iter(weights))].clone()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    window.inputs.model_picker.setCurrentText(str(folder))
    run_until_idle(qtbot, window, window.actions.answer_question)
    status = window.inputs.status_label.text()
    assert shown_result(window, "answer") is not None and "warning: " in status and "extra.probe.weight" in status
    window.inputs.model_picker.setCurrentText("shapes-llava")
    run_until_idle(qtbot, window, window.actions.answer_question)
    assert "warning" not in window.inputs.status_label.text()


def test_a_damaged_bundled_pairs_file_opens_the_window_and_says_so(qtbot, model_cache, tmp_path, monkeypatch):
    """A stripped or edited install: the window opens (was: a traceback
    before it showed), says why in its error line, and its sample actions
    refuse in one line."""
    import app.samples
    from app.main_window import MainWindow

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"image": "sample_00.png", "question": 7}\n')
    monkeypatch.setattr(app.samples, "bundled_pairs_file", lambda: pairs)
    win = MainWindow(model_cache=model_cache, session_path=tmp_path / "session.vlmr")
    qtbot.addWidget(win)
    message = win.inputs.error_label.text()
    assert message.startswith("the bundled samples are not available: ") and str(pairs) in message, message
    assert (
        win.samples == [] and not win.actions.answer_all_samples() and not win.actions.attention_statistics_of_samples()
    )
    assert win.inputs.error_label.text() == "no bundled samples to read out"
    win.close()


def test_a_damaged_tuned_lens_beside_the_model_is_a_warning_not_silence(qtbot, window, tmp_path):
    """The Lens tab shows the logit lens only, and the status line says why the
    tuned lens is missing (was: dropped without a word)."""
    folder = tmp_path / "lens-llava"
    shutil.copytree(BUILTIN, folder)
    (folder / "MANIFEST.sha256").unlink(missing_ok=True)
    (folder / "tuned-lens" / "lens.json").write_text("[" * 5000)
    window.inputs.model_picker.setCurrentText(str(folder))
    run_until_idle(qtbot, window, window.actions.run_readout)
    status = window.inputs.status_label.text()
    assert "warning: the tuned lens is not shown: " in status and "lens.json" in status, status
    assert window.inputs.error_label.text() == "" and window.analysis is not None
    assert window.analysis.tuned_lens is None
