"""The Target and foil fields take what ``--answer`` / ``--foil`` take: markup
(an image placeholder, a special token), alone or beside a word, is refused in
one line in the window, nothing is shown as an answer, and the window keeps
working."""

import pytest

from tests.app.test_window import run_until_idle


@pytest.mark.parametrize(
    "field, text, named",
    [
        ("target_edit", "<image>", "'<image>' holds the image placeholder '<image>'"),
        ("target_edit", "<image> blue", "'<image> blue' holds the image placeholder '<image>'"),
        ("foil_edit", "</s>", "'</s>' holds the special token '</s>'"),
        ("foil_edit", "blue </s>", "'blue </s>' holds the special token '</s>'"),
    ],
)
def test_markup_in_the_target_or_foil_is_one_line_in_the_window(qtbot, window, field, text, named):
    run_until_idle(qtbot, window, window.actions.answer_question)  # the model loaded, an answer to read out at
    getattr(window.inputs, field).setText(text)
    run_until_idle(qtbot, window, window.actions.run_readout)
    message = window.inputs.error_label.text()
    assert message.startswith(named) and "\n" not in message and "Traceback" not in message, message
    assert window.inputs.status_label.text() == "failed"
    getattr(window.inputs, field).setText("")  # the window still reads out
    run_until_idle(qtbot, window, window.actions.run_readout)
    assert window.inputs.error_label.text() == "" and window.analysis is not None
