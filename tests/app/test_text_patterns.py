"""The Attention panel's text-side pattern: after a read-out, clicking a head
shows its question-token x question-token heatmap, equal to the core function's."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from PySide6.QtCore import Qt

import core
from app.components import ModelChoice
from app.panels.attention_panel import AttentionPanel
from app.samples import bundled_samples
from core.analyze import analyze
from core.methods.patterns import text_patterns
from tests.tolerances import sum_tol, unit_roundoff

TIMEOUT_MS = 60_000


def core_text_patterns(loaded, image, question):
    """The core function on its own capture (every row kept), not the read-out's."""
    inputs = loaded.adapter.prepare([image], [question])
    n = inputs.input_ids.shape[1]
    trace = core.capture(loaded, None, "", query_positions=range(n), inputs=inputs)
    return text_patterns(loaded.adapter, trace)


def test_clicking_a_head_after_a_readout_shows_its_text_pattern(qtbot, window):
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        assert window.actions.run_readout()
    shown = window.workspace.shown  # the run the panels drew
    analysis = shown.results.get("analyze")
    assert analysis is not None and window.attention_panel.result is analysis
    panel = window.attention_panel
    tabs = window.tabs  # the panel sits inside its run frame: bring up the tab that holds it
    tabs.setCurrentIndex(next(i for i in range(tabs.count()) if tabs.widget(i).isAncestorOf(panel)))
    qtbot.waitUntil(lambda: panel.visual_grid.isVisible())
    row, col = 2, 3
    layer = panel.layers[row]
    with qtbot.waitSignal(panel.head_selected, timeout=2000):
        qtbot.mouseClick(
            panel.visual_grid.viewport(), Qt.MouseButton.LeftButton, pos=panel.visual_grid.cell_center(row, col)
        )
    model, question = shown.input.model_choice(), shown.input.question
    expected = core_text_patterns(window.model_cache[model], core.load_image(shown.input.image_path), question)
    labels = panel.text_grid.row_labels
    assert labels == panel.text_grid.col_labels == expected.tokens
    words = question.replace("?", " ?").split()
    assert any(labels[i : i + len(words)] == words for i in range(len(labels)))  # the question, token by token
    weights = expected.head(layer, col).numpy()
    allowed = expected.allowed[layer].numpy()
    shown = panel.text_grid.values
    assert shown.shape == weights.shape == (len(labels), len(labels))
    # the same forward's weights, drawn in float32: one rounding, relative to each weight
    np.testing.assert_allclose(shown[allowed], weights[allowed], rtol=unit_roundoff(torch.float32), atol=0)
    assert np.isnan(shown[~allowed]).all()  # keys a query may not attend are left blank
    assert f"{panel.head_row(layer, col).block}.H{col}" in panel.text_grid.plot_item.titleLabel.text
    hidden = sum(expected.other_mass[layer].values())[col].numpy()  # (queries,)
    note = panel.text_note.text()
    assert "not shown" in note and "BOS" in note and "image" in note
    assert f"{labels[-1]}\u00a0{hidden[-1]:.2f}" in note  # the answer row's hidden mass
    # float32 weights: the softmax's row sum over every key, the drawn cells' and the hidden mass's sums
    n_keys = len(analysis.input.input_ids)
    np.testing.assert_allclose(
        np.nansum(shown, 1) + hidden, 1.0, rtol=0, atol=sum_tol(1.0, 2 * n_keys + 8, torch.float32)
    )

    # another head replaces the heatmap
    panel.select_head(panel.layers[0], 0)
    np.testing.assert_allclose(
        panel.text_grid.values[allowed],
        expected.head(panel.layers[0], 0).numpy()[allowed],
        rtol=unit_roundoff(torch.float32),
        atol=0,
    )


@pytest.fixture(scope="module")
def coca_result(model_cache):
    coca = ModelChoice("shapes-coca")  # the window's cache key: the default dtype and device
    if coca not in model_cache:
        model_cache[coca] = core.load_model("shapes-coca", **coca.load_options())
    sample = bundled_samples()[0]
    return analyze(model_cache[coca], sample.image_path, sample.question)


def test_cross_attention_heads_have_no_text_pattern(qtbot, coca_result):
    panel = AttentionPanel()
    qtbot.addWidget(panel)
    panel.set_result(coca_result)
    cross = next(a for a in coca_result.attention if a.block.endswith(".xattn"))
    panel.select_head(cross.layer, 1)
    assert panel.text_grid.values.size == 0
    assert "cross-attention" in panel.text_note.text()
    text_block = coca_result.text_patterns.blocks[-1]
    panel.select_head(text_block, 1)
    assert panel.text_grid.values.shape == (len(coca_result.text_patterns.tokens),) * 2


def test_a_result_recorded_before_text_patterns_says_so(qtbot, coca_result):
    old = replace(coca_result, text_patterns=None)
    panel = AttentionPanel()
    qtbot.addWidget(panel)
    panel.set_result(old)
    panel.select_head(0, 0)
    assert panel.text_grid.values.size == 0 and "run it again" in panel.text_note.text()
    panel.set_result(None)
    assert "click a head" in panel.text_note.text()
