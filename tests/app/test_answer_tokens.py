"""The generated answer as clickable tokens (issue 14, parts 3 and 4): Generate shows the
model's answer token by token with each token's probability; clicking token k makes it the
target of every panel (the read-out re-runs on the prompt and the answer's first k tokens),
the run records it and History brings it back; a typed word of several tokens says which
sub-token is read. Driven through the window's widgets, offscreen, on shapes-llava.

The numbers are checked against an independent forward: ``adapter.prepare(...,
answer_prefix=ids[:k])`` and ``adapter.next_token_logits``, the next-token distribution
the read-out must be at.

(Its own file: these tests wait on worker signals, which stop arriving in a process after
test_window.py's screenshot test.)"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from PySide6.QtCore import Qt

import core
from app.jobs import GENERATE_TOKENS, typed_token
from app.run_frame import STALE_STYLE
from app.samples import bundled_samples
from core.generate import generate
from tests.app.shown import shown_result
from tests.core.exactness import frozen_sum_tol
from tests.tolerances import sum_tol

TIMEOUT_MS = 60_000
# every view that shows the analyze read-out (the Counterfactual tab shows its own runs)
READOUT_VIEWS = ("canvas", "answer", "attention", "dla", "lens")
CHOSEN = 2  # "clicks its third token"
SHOWN = 0.5e-3  # a number shown with three decimals is within half a unit of the value


def run_until_idle(qtbot, window, start) -> None:
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        assert start()
    assert not window.is_busy() and window.inputs.error_label.text() == "", window.inputs.error_label.text()


def generate_in_window(qtbot, window):
    """Press Generate; the answer the model gives independently (the same greedy decoding)."""
    run_until_idle(qtbot, window, lambda: qtbot.mouseClick(window.answer_panel.generate_button, Qt.LeftButton) or 1)
    loaded = window.loaded_model()
    return generate(loaded, window.image, window.inputs.question_edit.text(), max_new_tokens=GENERATE_TOKENS)


def click_token(qtbot, window, k: int) -> None:
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        qtbot.mouseClick(window.answer_panel.token_buttons[k], Qt.LeftButton)
    assert not window.is_busy() and window.inputs.error_label.text() == "", window.inputs.error_label.text()


def next_token(window, prefix) -> tuple[torch.Tensor, object]:
    """``(probabilities (vocab,) in float64, inputs)`` of the token after the prompt and ``prefix``."""
    adapter = window.loaded_model().adapter
    inputs = adapter.prepare([window.image], [window.inputs.question_edit.text()], answer_prefix=list(prefix))
    with torch.no_grad():
        logits = adapter.next_token_logits(inputs)[0].double()
    return logits, inputs


def shown_number(text: str, after: str) -> float:
    match = re.search(re.escape(after) + r"\s*([-+]?\d+\.\d+)", text)
    assert match, (after, text)
    return float(match.group(1))


@pytest.fixture
def at_third_token(qtbot, window):
    """The window after Generate and a click on the answer's third token: ``(window, generation)``."""
    generation = generate_in_window(qtbot, window)
    assert len(generation.token_ids) > CHOSEN
    click_token(qtbot, window, CHOSEN)
    return window, generation


def test_generate_shows_the_answer_as_tokens_with_their_probabilities(qtbot, window):
    generation = generate_in_window(qtbot, window)
    panel = window.answer_panel
    assert [b.text() for b in panel.token_buttons] == [
        f"{t}\n{p:.3f}" for t, p in zip(generation.tokens, generation.probs, strict=True)
    ]
    assert panel.stop_label.text() == f"{len(generation.tokens)} tokens; stopped: {generation.stop_reason}"
    assert window.answer_panel.label.text() == f"answer: {generation.text}"
    assert all(b.isEnabled() for b in panel.token_buttons) and panel.chosen() is None
    # each token shown with its probability in the next-token distribution after the tokens before it
    # (a re-run of the prefix, not the generation's key / value cache: the two differ by float32 rounding,
    # bounded in tests/core/test_generate.py, far below the shown digits)
    for k in (0, CHOSEN):
        probs = next_token(window, generation.token_ids[:k])[0].softmax(-1)
        assert int(probs.argmax()) == generation.token_ids[k]
        shown = float(panel.token_buttons[k].text().split("\n")[1])
        assert abs(shown - float(probs[generation.token_ids[k]])) <= SHOWN + 1e-5
    run = window.session.runs("generate")[-1]
    assert window.run_frames["answer"].header_text().startswith(f"run #{run.id} · generate · ")
    assert window.session.run(run.id).result["token_ids"] == generation.token_ids


def test_clicking_the_third_token_makes_every_panel_read_that_token(at_third_token):
    """Done when: every panel's header and numbers belong to the token clicked."""
    window, generation = at_third_token
    token, token_id = generation.tokens[CHOSEN], generation.token_ids[CHOSEN]
    run_id = window.session.runs("analyze")[-1].id
    for view in READOUT_VIEWS:
        frame = window.run_frames[view]
        text = frame.header_text()
        assert not frame.stale and text.startswith(f"run #{run_id} · analyze · "), (view, text)
        assert text.endswith(f" · answer token {CHOSEN} {token!r}"), (view, text)
    assert window.answer_panel.chosen() == CHOSEN

    logits, inputs = next_token(window, generation.token_ids[:CHOSEN])
    probs = logits.softmax(-1)
    position = inputs.input_ids.shape[1] - 1  # the last answer token given: the answer position
    analysis = window.analysis
    assert analysis.target.position == position and analysis.target.answer_id == token_id
    assert list(analysis.answer_text.token_ids[:CHOSEN]) == generation.token_ids[:CHOSEN]

    # Answer: the token's probability and the alternatives at that position
    label = window.answer_panel.label.text()
    assert label.startswith(f"answer token {CHOSEN} {token!r}")
    assert abs(shown_number(label, "p =") - float(probs[token_id])) <= SHOWN
    top = probs.topk(window.answer_panel.table.rowCount())
    adapter = window.loaded_model().adapter
    assert [window.answer_panel.table.item(r, 0).text() for r in range(window.answer_panel.table.rowCount())] == [
        adapter.token_str(i) for i in top.indices.tolist()
    ]
    for r, p in enumerate(top.values.tolist()):
        assert abs(float(window.answer_panel.table.item(r, 1).text()) - p) <= SHOWN

    # DLA: the decomposed logit is this token's at this position; the frozen-scale parts add up to it
    dla = window.dla_panel
    assert f"at position {position}," in dla.target_label.text() and f"answer {token!r}" in dla.target_label.text()
    assert abs(shown_number(dla.target_label.text(), "model logit") - float(logits[token_id])) <= SHOWN
    rd = analysis.residual_decomposition
    trace = core.capture(window.loaded_model(), None, "", inputs=inputs)
    tol = frozen_sum_tol(adapter, trace, position, token_id, None)  # the decomposition's own bound
    assert abs(sum(dla.values().values()) - rd.frozen_sum_expected) <= tol

    # Lens: the final row is the model's output at that position (rank 0: greedy chose it)
    lens = window.lens_panel
    final = lens.table.rowCount() - 1
    assert lens.table.item(final, 0).text() == "final"
    assert lens.table.item(final, 1).text() == "0"
    assert abs(float(lens.table.item(final, 2).text()) - float(logits[token_id])) <= SHOWN
    assert f"answer position {position} for answer {token!r}" in lens.title.text()

    # Attention: the answer row of the prompt plus two answer tokens, from that capture of that input
    # (the same pattern; the read-out may add its visual keys in another order or dtype: float32's bound)
    visual = trace.visual_positions[0]
    cells = window.attention_panel.cells
    n_keys = inputs.input_ids.shape[1]
    for (layer, head), cell in list(cells.items())[:: max(1, len(cells) // 4)]:
        row = trace.patterns[layer][0][head, 0].double()  # (keys,) of the one query kept: the answer row
        assert abs(cell.visual_mass - float(row[visual].sum())) <= sum_tol(1.0, n_keys, torch.float32)
    assert f"answer position {position} " in window.attention_panel.title.text()

    # Part 4: one row per answer token 0..2, the chosen one (the last) highlighted; its image mass is
    # the Attention tab's visual mass averaged over heads and self-attention blocks
    patterns = window.answer_panel.patterns
    assert [patterns.row_name(r) for r in patterns.rows()] == [f"{k}: {generation.tokens[k]}" for k in range(3)]
    assert patterns.chosen_row() == CHOSEN
    assert patterns.table.item(CHOSEN, 0).font().bold() and not patterns.table.item(0, 0).font().bold()
    image_mass = float(patterns.table.item(CHOSEN, 3).text())
    mean_visual = np.mean([c.visual_mass for c in cells.values()])
    assert abs(image_mass - mean_visual) <= SHOWN
    # a row's parts are all its weight: a float32 softmax row sums to 1 within its rounding
    assert abs(sum(patterns.values()[CHOSEN]) - 1.0) <= sum_tol(1.0, n_keys, torch.float32)

    # the run records the answer and the token read
    stored = window.session.run(run_id)
    assert stored.result["input"]["answer_token_index"] == CHOSEN
    assert stored.result["input"]["answer_token_ids"] == generation.token_ids


def test_the_counterfactual_reads_the_chosen_token_too(qtbot, at_third_token):
    window, generation = at_third_token
    probs = next_token(window, generation.token_ids[:CHOSEN])[0].softmax(-1)
    mask = np.zeros((window.image.height, window.image.width), bool)
    mask[: mask.shape[0] // 2] = True
    window.counterfactual_panel.canvas.set_mask(mask)
    run_until_idle(qtbot, window, lambda: window.actions.run_counterfactual(mask, "mean", {}))
    result = shown_result(window, "counterfactual")
    assert result.original.answer_id == generation.token_ids[CHOSEN]
    assert abs(result.original.prob - float(probs[generation.token_ids[CHOSEN]])) <= 1e-9
    header = window.run_frames["counterfactual"].header_text()
    assert header.endswith(f"answer token {CHOSEN} {generation.tokens[CHOSEN]!r}") and "counterfactual" in header
    counterfactual_id = window.session.runs("counterfactual")[-1].id
    parameters = window.session.run(counterfactual_id).parameters
    assert parameters["answer_token_index"] == CHOSEN and parameters["answer_prefix_ids"] == generation.token_ids[:2]

    # restored from History: the token, its read-out (the analyze run at that token) and the result
    seen = (header, window.dla_panel.values())
    assert window.load_sample(bundled_samples()[1])
    assert window.sessions.restore_run(counterfactual_id) and window.inputs.error_label.text() == ""
    assert window.workspace.input.answer_text.index == CHOSEN and window.answer_panel.chosen() == CHOSEN
    assert window.run_frames["counterfactual"].header_text() == seen[0]
    assert window.dla_panel.values() == seen[1]
    assert window.run_frames["dla"].header_text().endswith(f"answer token {CHOSEN} {generation.tokens[CHOSEN]!r}")


def test_changing_the_token_marks_every_view_stale_until_read(qtbot, at_third_token):
    window, generation = at_third_token
    drawn_for = window.workspace.input.describe()
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        qtbot.mouseClick(window.answer_panel.token_buttons[CHOSEN + 1], Qt.LeftButton)
        for view in READOUT_VIEWS:  # while the new read-out runs
            frame = window.run_frames[view]
            assert frame.stale and frame.header.styleSheet() == STALE_STYLE, view
            assert frame.header_text().startswith(f"stale (answer token changed): drawn for {drawn_for};"), view
        assert not any(b.isEnabled() for b in window.answer_panel.token_buttons)  # no second choice mid-run
    label = f"answer token {CHOSEN + 1} {generation.tokens[CHOSEN + 1]!r}"
    for view in READOUT_VIEWS:
        assert not window.run_frames[view].stale and window.run_frames[view].header_text().endswith(label)
    assert window.answer_panel.label.text().startswith(label)

    window.set_question("how many circles are there?")  # another question: the tokens answer the old one
    assert window.workspace.input.answer_text is None
    assert not any(b.isEnabled() for b in window.answer_panel.token_buttons)
    assert window.answer_panel.tokens_note.text().startswith("generated for another")
    assert "(question, answer token changed)" in window.run_frames["dla"].header_text()


def test_history_brings_the_answer_tokens_and_the_chosen_one_back(qtbot, at_third_token):
    window, generation = at_third_token
    run_id = window.session.runs("analyze")[-1].id
    seen = (window.answer_panel.label.text(), window.run_frames["dla"].header_text(), window.dla_panel.values())
    assert window.load_sample(bundled_samples()[1])
    assert window.answer_panel.token_buttons == [] and window.workspace.input.answer_text is None
    assert window.sessions.restore_run(run_id)
    assert window.inputs.error_label.text() == ""
    panel = window.answer_panel
    assert [b.text() for b in panel.token_buttons] == [
        f"{t}\n{p:.3f}" for t, p in zip(generation.tokens, generation.probs, strict=True)
    ]  # with the probabilities: the session holds the generation
    assert panel.chosen() == CHOSEN and all(b.isEnabled() for b in panel.token_buttons)
    assert window.workspace.input.answer_text.index == CHOSEN
    assert (window.answer_panel.label.text(), window.run_frames["dla"].header_text(), window.dla_panel.values()) == seen
    assert window.inputs.target_edit.text() == ""  # the target is the chosen token: nothing typed
    # a click on another token reads there, as in the live window
    click_token(qtbot, window, 0)
    assert window.run_frames["lens"].header_text().endswith(f"answer token 0 {generation.tokens[0]!r}")


def test_a_typed_word_of_several_tokens_says_which_sub_token_is_read(qtbot, window):
    generation = generate_in_window(qtbot, window)
    adapter = window.loaded_model().adapter
    # two tokens of the answer, in a row, typed as one target
    start = next(k for k in range(1, len(generation.tokens) - 1) if generation.tokens[k] != generation.tokens[0])
    word = f"{generation.tokens[start]} {generation.tokens[start + 1]}"
    assert [t for _, t in core.answer_text.word_tokens(adapter, word)] == generation.tokens[start : start + 2]
    window.inputs.target_edit.setText(word)
    note = window.inputs.target_note
    first = generation.tokens[start]
    assert note.isVisibleTo(window) and note.text() == (
        f"target: {word!r} is 2 tokens for this model: {first} | {generation.tokens[start + 1]}; "
        f"reading its first sub-token {first!r}"
    )
    assert note.button.isVisibleTo(window) and note.button.text() == f"read at answer token {start} {first!r} instead"

    # Read out as typed: the first sub-token is the target, at the first answer token
    run_until_idle(qtbot, window, window.actions.run_readout)
    target = window.analysis.target
    assert target.answer == first and target.answer_id == typed_token(adapter, word).token_ids[0]
    assert window.inputs.target_edit.text() == word  # nothing lost

    # the offer: read where the word starts in the answer
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        qtbot.mouseClick(note.button, Qt.LeftButton)
    assert window.inputs.error_label.text() == ""
    assert window.analysis.answer_text.index == start
    assert window.analysis.target.answer_id == generation.token_ids[start]
    assert window.answer_panel.chosen() == start and not note.button.isVisibleTo(window)
    assert window.run_frames["attention"].header_text().endswith(f"answer token {start} {first!r}")

    # a foil of several tokens, and a word the model does not have: one line each, no traceback
    window.inputs.foil_edit.setText(word)
    assert note.text().startswith("foil: ") and "reading its first sub-token" in note.text()
    window.inputs.foil_edit.setText("")
    window.inputs.target_edit.setText("xyzzy")
    assert note.text().startswith("target: 'xyzzy' is not in this model's vocabulary")
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        assert window.actions.run_readout()
    assert window.inputs.error_label.text().startswith("'xyzzy' is not in this model's vocabulary")
    # several words, none the model has: the message names the target's text, not the question
    window.inputs.target_edit.setText("xyzzy plugh")
    assert note.text() == "target: 'xyzzy plugh' uses words this model's vocabulary does not have: xyzzy, plugh"
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        assert window.actions.run_readout()
    assert window.inputs.error_label.text().startswith("'xyzzy plugh' uses words")


def test_a_heads_sources_are_read_at_the_chosen_token(qtbot, at_third_token):
    """The DLA tab's per-source contributions of a head come from the prompt plus the answer's
    tokens before the one read out: the contributions of that input, not of the bare prompt."""
    from core.methods.contributions import source_contributions

    window, generation = at_third_token
    layer, head = 1, 0
    run_until_idle(qtbot, window, lambda: window.actions.request_head_sources(layer, head))
    loaded = window.loaded_model()
    token_id = generation.token_ids[CHOSEN]
    traces = {}
    for k in (CHOSEN, 0):
        inputs = loaded.adapter.prepare(
            [window.image], [window.inputs.question_edit.text()], answer_prefix=list(generation.token_ids[:k])
        )
        traces[k] = core.capture(loaded, None, "", inputs=inputs)
    visual = [int(p) for p in traces[CHOSEN].visual_positions[0]]
    at_token = source_contributions(loaded.adapter, traces[CHOSEN], token_id, None).dla_frozen[layer][head]
    bare = source_contributions(loaded.adapter, traces[0], token_id, None).dla_frozen[layer][head]
    shown = window.dla_panel.source_values
    assert np.array_equal(shown, at_token[visual].numpy().astype(float))  # the same computation on the same input
    assert not np.allclose(shown, bare[visual].numpy())  # and it is not the bare prompt's


def test_answer_and_generate_again_keep_the_headers_true(qtbot, at_third_token):
    """Generate again gives the same answer: the token stays chosen. Answer (the first token of the
    bare prompt) drops the chosen token, so no header claims a token the Answer tab does not show."""
    window, generation = at_third_token
    run_until_idle(qtbot, window, window.answer_panel.request_generate)
    assert window.answer_panel.chosen() == CHOSEN and window.workspace.input.answer_text.index == CHOSEN
    assert not window.run_frames["dla"].stale

    run_until_idle(qtbot, window, window.actions.answer_question)
    assert window.workspace.input.answer_text is None and window.answer_panel.chosen() is None
    answer_header = window.run_frames["answer"].header_text()
    assert answer_header.startswith("not recorded · answer · ") and "answer token" not in answer_header
    assert window.answer_panel.label.text().startswith(f"answer: {generation.tokens[0]}  (p = ")
    assert "(answer token changed)" in window.run_frames["dla"].header_text()


def test_generate_can_be_cancelled(qtbot, window):
    window.answer_panel.max_tokens.setValue(window.answer_panel.max_tokens.maximum())
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        assert window.answer_panel.request_generate()
        assert not window.answer_panel.generate_button.isEnabled()  # one job at a time
        window.cancel()
    assert window.inputs.status_label.text().startswith("cancelled") and window.inputs.error_label.text() == ""
    assert window.answer_panel.token_buttons == [] and window.answer_panel.generate_button.isEnabled()
    assert window.session.runs("generate") == []
