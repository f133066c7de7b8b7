"""The Flow tab (issue 29, part 5), offscreen on shapes-llava: Knock out runs the
knockout request on the shown input and draws each edge kind's profile from the
result (the plotted points are the windows' numbers), rollout's reach beside it
and called a correlation; Patch grid without a source image is refused in one
line until one is chosen, then draws the grid and a cell clicked shows that
cell's numbers; History brings both back; a bad edge is a message, not a run.

Own file: these tests wait on worker signals (see tests/app/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest

from app.panels.flow_panel import FlowPanel, knockout_score
from app.samples import bundled_samples
from tests.app.shown import shown_result
from tests.app.test_window import run_until_idle

EDGES = "image->answer,question->answer"


@pytest.fixture
def flow(qtbot, window):
    window.tabs.setCurrentIndex(window.tabs.indexOf(window.run_frames["flow"]))
    window.flow_panel.edges_edit.setText(EDGES)
    return window, window.flow_panel


def test_knock_out_draws_each_profile_from_the_run(qtbot, flow):
    window, panel = flow
    run_until_idle(qtbot, window, window.actions.run_knockout)
    assert window.inputs.error_label.text() == ""
    result = shown_result(window, "knockout")
    assert [p.edge for p in result.profiles] == EDGES.split(",") and panel.knockout is result
    curves = panel.knockout_plot.getPlotItem().listDataItems()
    assert len(curves) == len(result.profiles)
    for curve, profile in zip(curves, result.profiles):
        xs, ys = curve.getData()
        want = [knockout_score(profile.window(layer).edited)[1] for layer in result.layers]
        np.testing.assert_array_equal(ys, want)
        assert list(xs) == list(range(len(result.layers)))
        assert profile.edge in curve.name() and "all layers" in curve.name()
    for curve, profile in zip(panel.prob_plot.getPlotItem().listDataItems(), result.profiles):
        np.testing.assert_array_equal(curve.getData()[1], [profile.window(x).edited.prob for x in result.layers])
    assert len(panel.rollout_plot.getPlotItem().listDataItems()) == len(result.profiles)
    assert "not a decomposition" in panel.rollout_label.text() and "r = " in panel.rollout_label.text()
    assert f"window of {result.width} layer(s)" in panel.knockout_title.text()
    (info,) = window.session.runs("knockout")
    assert window.session.run(info.id).parameters["edges"] == EDGES.split(",")

    # History brings it back, drawn from the stored run, after another image was shown
    assert window.load_sample(bundled_samples()[1])
    assert window.sessions.restore_run(info.id)
    restored = panel.knockout
    assert restored is not None and restored is not result and restored.to_dict() == result.to_dict()
    assert window.workspace.shown.run_id == info.id


def test_patch_grid_needs_a_source_then_a_cell_shows_its_numbers(qtbot, flow):
    window, panel = flow
    assert not window.actions.run_patch_grid()  # refused, said, nothing runs
    assert not window.is_busy() and "choose a source image" in window.inputs.error_label.text()
    source = bundled_samples()[2].image_path
    panel.source_edit.setText(str(source))
    panel.site_box.setCurrentText("attn")
    run_until_idle(qtbot, window, window.actions.run_patch_grid)
    grid = shown_result(window, "patch-grid")
    assert panel.grid is grid and grid.site == "attn"
    image = panel.grid_image.image
    assert image.shape == (len(grid.columns), len(grid.blocks))
    np.testing.assert_allclose(image.T, np.array(grid.metric, dtype=float), equal_nan=True)
    panel.click_cell(1, len(grid.columns) - 1)
    text = panel.cell_label.text()
    assert text.startswith(f"{grid.blocks[1]} x {grid.columns[-1].name}")
    assert f"metric {grid.metric[1][-1]:+.3f}" in text and f"logit diff {grid.logit_diff[1][-1]:+.3f}" in text
    assert "LD_source - LD_clean" in panel.grid_title.text()


def test_a_bad_edge_is_a_message_and_runs_nothing(qtbot, flow):
    window, panel = flow
    panel.edges_edit.setText("image->nowhere")
    assert not window.actions.run_knockout() and not window.is_busy()
    assert "target set 'nowhere'" in window.inputs.error_label.text()
    assert window.session.runs("knockout") == []
    panel.edges_edit.setText("region->answer")
    window.actions.run_knockout()
    assert "needs a painted region" in window.inputs.error_label.text() and not window.is_busy()


def test_an_empty_panel_says_what_each_part_does(qtbot):
    panel = FlowPanel()
    qtbot.addWidget(panel)
    panel.draw(None, None)
    assert panel.knockout_title.text().startswith("Knock out:") and panel.grid_title.text().startswith("Patch grid:")
    assert [b.text() for b in panel.run_buttons()] == ["Knock out", "Patch grid", "Source…"]
