"""The attention, DLA, lens and audit panels on real analyze results of both default models."""

import math
from dataclasses import replace

import numpy as np
import pytest
from PySide6.QtCore import Qt

import core
from app.panels.attention_panel import AttentionPanel, token_grid
from app.panels.audit_panel import COLUMNS, AuditPanel
from app.panels.dla_panel import CONVENTIONS, DLAPanel, component_kind, visual_token_values
from app.panels.lens_panel import LOGIT_LENS, PLOTS, LensPanel, metrics_row
from app.samples import bundled_samples
from core.analyze import analyze
from core.methods.tuned_lens.evaluate import ReaderMetrics
from core.results.readout import jsonable, restore_result
from tests.core.exactness import frozen_sum_tol

SPECS = ("shapes-llava", "shapes-coca")


@pytest.fixture(scope="module")
def loaded(model_cache):
    for spec in SPECS:
        if spec not in model_cache:
            model_cache[spec] = core.load_model(spec)
    return model_cache


@pytest.fixture(scope="module")
def results(loaded):
    sample = bundled_samples()[0]
    return {spec: analyze(loaded[spec], sample.image_path, sample.question) for spec in SPECS}


def blocks(result) -> list[tuple[int, str]]:
    return sorted({(a.layer, a.block) for a in result.attention})


# ---- attention ------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_attention_grids_show_visual_and_sink_mass_apart(qtbot, results, spec):
    result = results[spec]
    panel = AttentionPanel()
    qtbot.addWidget(panel)
    panel.set_result(result)
    names = [name for _, name in blocks(result)]
    n_heads = result.model.n_heads
    assert panel.visual_grid.values.shape == panel.sink_grid.values.shape == (len(names), n_heads)
    assert panel.visual_grid.row_labels == names
    assert panel.visual_grid.col_labels == [f"H{h}" for h in range(n_heads)]
    for a in result.attention:
        r, c = names.index(a.block), a.head
        assert panel.visual_grid.values[r, c] == pytest.approx(a.visual_mass)
        assert panel.sink_grid.values[r, c] == pytest.approx(a.bos_mass)
    assert spec in panel.title.text()


@pytest.mark.parametrize("spec, row, col", [("shapes-llava", 2, 3), ("shapes-coca", 8, 1)])
def test_clicking_a_cell_selects_that_head(qtbot, results, spec, row, col):
    result = results[spec]
    panel = AttentionPanel()
    qtbot.addWidget(panel)
    panel.resize(1280, 800)
    panel.set_result(result)
    panel.show()
    qtbot.waitExposed(panel)
    layer, block = blocks(result)[row]
    with qtbot.waitSignal(panel.head_selected, timeout=2000) as blocker:
        qtbot.mouseClick(
            panel.visual_grid.viewport(), Qt.MouseButton.LeftButton, pos=panel.visual_grid.cell_center(row, col)
        )
    assert blocker.args == [layer, col]
    head = panel.head_row(layer, col)
    assert head.block == block and head.head == col
    text = panel.details.text()
    assert f"{block}.H{col}" in text
    assert f"{head.entropy:.3f} nats" in text and "argmax" in text
    assert np.allclose(panel.patch_map.values, np.asarray(head.visual_patch_mass), equal_nan=True)
    # the sink grid selects the same way
    with qtbot.waitSignal(panel.head_selected, timeout=2000) as blocker:
        qtbot.mouseClick(panel.sink_grid.viewport(), Qt.MouseButton.LeftButton, pos=panel.sink_grid.cell_center(0, 0))
    assert blocker.args == [blocks(result)[0][0], 0]


def test_attention_distribution_view(qtbot, loaded, results):
    from core.methods.patterns import pattern_statistics

    samples = [(s.image_path, s.question, None) for s in bundled_samples()[:2]]
    stats = pattern_statistics(loaded["shapes-llava"], samples)
    panel = AttentionPanel()
    qtbot.addWidget(panel)
    assert not panel.tabs.isTabEnabled(1)
    # a statistics run restored from its stored JSON (the session's), as the app records it
    panel.set_statistics(restore_result("statistics", jsonable(stats.to_dict())))
    assert panel.tabs.isTabEnabled(1)
    n = len(stats.heads)
    assert len(panel.box_plot.boxes.opts["x"]) == n
    first = stats.heads[0].visual_mass.quantiles
    assert panel.box_plot.boxes.opts["y0"][0] == pytest.approx(first["0.25"])
    assert panel.box_plot.boxes.opts["height"][0] == pytest.approx(first["0.75"] - first["0.25"])
    panel.metric_combo.setCurrentText("BOS / sink mass")
    assert panel.box_plot.boxes.opts["y0"][0] == pytest.approx(stats.heads[0].sink_mass.quantiles["0.25"])
    assert "2 samples" in panel.stats_note.text()
    panel.set_statistics(stats)  # the dataclass itself
    assert len(panel.statistics) == n


# ---- DLA ------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_dla_frozen_bars_sum_to_the_expected_logit(qtbot, loaded, results, spec):
    rd = results[spec].to_dict()["residual_decomposition"]
    panel = DLAPanel()
    qtbot.addWidget(panel)
    panel.set_result(results[spec])
    assert panel.convention() == "frozen scale"
    panel.set_top_k(0)  # all
    shown = panel.shown_values()
    assert len(shown) == len(rd["components"])
    # the decomposition's own bound (a capture of the same input gives its terms' sizes)
    t = results[spec].target
    sample = bundled_samples()[0]
    trace = core.capture(loaded[spec], sample.image_path, sample.question)
    tol = frozen_sum_tol(loaded[spec].adapter, trace, t.position, t.answer_id, t.foil_id)
    assert sum(v for _, v in shown) == pytest.approx(rd["frozen_sum_expected"], abs=tol)
    assert f"{rd['frozen_sum_expected']:+.4f}" in panel.sum_label.text()
    assert f"{rd['reconstruction_max_abs_err']:.2e}" in panel.error_label.text()
    # the verdict against the model dtype's bound (float32 here)
    assert f"{rd['reconstruction_rel_err']:.2e} of |x_L|" in panel.error_label.text()
    assert "for float32): ok" in panel.error_label.text()
    assert "Additive" in panel.caveat_label.text()
    mags = [abs(v) for _, v in shown]
    assert mags == sorted(mags, reverse=True)
    panel.set_top_k(5)
    assert len(panel.shown_values()) == 5
    assert "5 of" in panel.sum_label.text()


@pytest.mark.parametrize("spec", SPECS)
def test_dla_convention_switch_reads_the_right_field(qtbot, results, spec):
    comps = {c.name: c.to_dict() for c in results[spec].residual_decomposition.components}
    panel = DLAPanel()
    qtbot.addWidget(panel)
    panel.set_result(results[spec])
    panel.set_top_k(0)
    for conv in ("Jacobian", "projection", "norm", "frozen scale"):
        panel.convention_combo.setCurrentText(conv)
        field = CONVENTIONS[conv][0]
        shown = dict(panel.shown_values())
        assert shown == pytest.approx({n: c[field] for n, c in comps.items()})
        assert panel.caveat_label.text() == CONVENTIONS[conv][2]
    panel.set_convention("Jacobian")
    assert "does NOT sum" in panel.caveat_label.text()
    kinds = {component_kind(n) for n in comps}
    expected = {"embedding", "attention head", "MLP"} | (
        {"cross-attention head", "bias"} if spec == "shapes-coca" else set()
    )
    assert kinds == expected


def test_dla_head_sources_round_trip(qtbot, loaded, results):
    from core.methods.contributions import source_contributions

    result = results["shapes-llava"]
    panel = DLAPanel()
    qtbot.addWidget(panel)
    panel.resize(1280, 800)
    panel.set_result(result)
    panel.show()
    qtbot.waitExposed(panel)
    name = panel.shown_values()[0][0]
    with qtbot.waitSignal(panel.component_selected, timeout=2000) as blocker:
        qtbot.mouseClick(panel.plot_widget.viewport(), Qt.MouseButton.LeftButton, pos=panel.bar_center(name))
    assert blocker.args == [name]
    panel.select_head(3, 1)
    assert panel.selected == "L3.H1" and panel.sources_button.isEnabled()
    with qtbot.waitSignal(panel.sources_requested, timeout=2000) as blocker:
        panel.sources_button.click()
    assert blocker.args == [3, 1]

    sample = bundled_samples()[0]
    lm = loaded["shapes-llava"]
    trace = core.capture(lm, core.load_image(sample.image_path), sample.question)
    sc = source_contributions(lm.adapter, trace, result.target.answer_id)
    values = visual_token_values(result, 3, sc.dla_frozen[3][1].numpy())
    assert values.shape == (len(result.input.visual_tokens),)
    with qtbot.waitSignal(panel.sources_shown, timeout=2000) as blocker:
        panel.set_sources(3, 1, values)
    assert blocker.args[:2] == [3, 1]
    assert panel.source_grid.values.shape == (8, 8)
    assert np.allclose(panel.source_grid.values, token_grid(values, result.input.visual_tokens))
    assert "L3.H1" in panel.source_label.text()


def test_dla_rerun_rows(qtbot, loaded, results):
    from core.methods.residual import compare_with_rerun

    result = results["shapes-llava"]
    sample = bundled_samples()[0]
    lm = loaded["shapes-llava"]
    image = core.load_image(sample.image_path)
    inputs = lm.adapter.prepare([image], [sample.question])
    trace = core.capture(lm, image, sample.question, inputs=inputs)
    rows = compare_with_rerun(lm, trace, result.target.answer_id, top=3, inputs=inputs).rows
    panel = DLAPanel()
    qtbot.addWidget(panel)
    panel.set_result(result)
    combo_items = panel.convention_combo.model()
    rerun_index = panel.convention_combo.findText("re-run (total removal)")
    assert not combo_items.item(rerun_index).isEnabled()
    panel.set_rerun(rows)
    assert combo_items.item(rerun_index).isEnabled()
    panel.set_convention("re-run (total removal)")
    assert dict(panel.shown_values()) == pytest.approx({r.name: r.total_removal for r in rows})
    assert len(panel.ghost_bars.opts["x0"]) == len(rows)  # frozen-scale outlines next to the re-run bars
    panel.set_convention("re-run (direct removal)")
    assert dict(panel.shown_values()) == pytest.approx({r.name: r.direct_removal for r in rows})
    panel.set_rerun(None)
    assert panel.convention() == "frozen scale"


# ---- lens -----------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_lens_curves_have_a_point_per_layer_plus_final(qtbot, results, spec):
    result = results[spec]
    n_points = len(blocks(result)) + 1  # residual entering each block, then the final residual
    assert len(result.logit_lens) == n_points
    panel = LensPanel()
    qtbot.addWidget(panel)
    panel.set_result(result)
    for key in PLOTS:
        xs, ys = panel.curves[key][LOGIT_LENS].getData()
        assert len(xs) == n_points
    _, ys = panel.curves["logit"][LOGIT_LENS].getData()
    assert list(ys) == pytest.approx([r.answer_logit for r in result.logit_lens])  # no foil: the answer logit
    assert "no foil" in panel.plots["logit"].titleLabel.text
    ranks = panel.curves["rank"][LOGIT_LENS].yData  # the data, not its log-mapped view
    assert list(ranks) == [r.answer_rank + 1 for r in result.logit_lens]  # drawn on a log axis
    assert panel.layer_labels(n_points)[-1] == "final"
    # axis ticks: one per point, cross-attention blocks shortened so they do not overlap
    ticks = [text for _, text in panel.plots["kl"].getAxis("bottom")._tickLevels[0]]
    assert len(ticks) == n_points and max(len(t) for t in ticks) <= 5 and not any(".xattn" in t for t in ticks)
    cross = any(".xattn" in name for name in panel.layer_labels(n_points))
    assert ("cross-attention block of layer n" in panel.note.text()) == cross
    assert panel.table.rowCount() == n_points
    top = result.logit_lens[-1].top[0][0]
    assert panel.table.item(n_points - 1, 4).text().startswith(top)


def test_lens_overlays_more_readers_and_foil(qtbot, loaded, results):
    sample = bundled_samples()[0]
    result = analyze(loaded["shapes-llava"], sample.image_path, sample.question, foil="circle")
    panel = LensPanel()
    qtbot.addWidget(panel)
    panel.set_result(result)
    _, ys = panel.curves["logit"][LOGIT_LENS].getData()
    assert list(ys) == pytest.approx([r.logit_diff for r in result.logit_lens])
    tuned = [replace(r, kl_to_final=r.kl_to_final / 2) for r in result.logit_lens]
    # an eval-lens reader: a mean rank and a KL in bits, no logits
    metrics = ReaderMetrics(kl_bits=1.0, cross_entropy=None, top1_agreement=None, answer_rank_mean=3.0, n_tokens=4)
    baseline = [metrics_row(r.layer, metrics) for r in result.logit_lens]
    panel.set_readers({"tuned": tuned, "mean baseline": baseline})
    assert set(panel.curves["kl"]) == {LOGIT_LENS, "tuned", "mean baseline"}
    legend = panel.legend.text()  # above the plots, in drawing order and colour
    assert legend.index(LOGIT_LENS) < legend.index("tuned") < legend.index("mean baseline")
    _, kl = panel.curves["kl"]["mean baseline"].getData()
    assert kl == pytest.approx([math.log(2)] * len(baseline))  # bits -> nats
    assert "mean baseline" not in panel.curves["logit"]  # no logit in those rows: no curve
    assert [panel.reader_combo.itemText(i) for i in range(panel.reader_combo.count())] == [
        LOGIT_LENS,
        "tuned",
        "mean baseline",
    ]
    panel.reader_combo.setCurrentText("tuned")
    assert panel.table.item(0, 3).text() == f"{tuned[0].kl_to_final:.3f}"
    panel.set_readers(None)
    assert set(panel.curves["kl"]) == {LOGIT_LENS}
    assert "tuned" not in panel.legend.text()
    # the window's path: the result and its readers in one call (one redraw)
    panel.set_result(result, readers={"tuned": tuned})
    assert set(panel.curves["kl"]) == {LOGIT_LENS, "tuned"}
    panel.set_result(result)  # without readers the overlay stays
    assert set(panel.curves["kl"]) == {LOGIT_LENS, "tuned"}


# ---- audit ----------------------------------------------------------------


def audit_rows(results) -> list[dict]:
    rows = []
    for run, spec in enumerate(SPECS, start=1):
        doc = results[spec].to_dict()
        t = doc["target"]
        for a in doc["audit"]:
            rows.append(dict(a, run=run, kind=f"analyze {spec}", summary=f"answer {t['answer']!r} p={t['prob']:.3f}"))
    return rows


def test_audit_table_filter_narrows_rows(qtbot, results):
    rows = audit_rows(results)
    panel = AuditPanel()
    qtbot.addWidget(panel)
    panel.set_rows(rows)
    assert panel.model.columnCount() == len(COLUMNS) == 10
    assert panel.proxy.rowCount() == len(rows)
    qtbot.keyClicks(panel.filter_edit, "LOGIT lens")  # any column, case-insensitive
    assert 0 < panel.proxy.rowCount() < len(rows)
    assert {r["method"] for r in panel.visible_rows()} == {"logit lens"}
    assert panel.count_label.text() == f"{panel.proxy.rowCount()} of {len(rows)} rows"
    panel.set_filter("shapes-coca")  # the kind column
    assert {r["run"] for r in panel.visible_rows()} == {2}
    panel.set_filter("n_components=")  # the parameters column
    assert {r["method"] for r in panel.visible_rows()} == {"residual DLA"}
    panel.set_filter("")
    assert panel.proxy.rowCount() == len(rows)
    panel.add_rows(rows[:1])
    assert panel.proxy.rowCount() == len(rows) + 1 and len(panel.rows()) == len(rows) + 1


@pytest.mark.parametrize(
    "name, chosen, fmt",
    [
        ("audit.csv", "CSV (*.csv)", "csv"),
        ("audit.md", "Markdown (*.md)", "md"),
        ("audit.HTML", "HTML (*.html)", "html"),
        ("audit.json", "CSV (*.csv)", "json"),  # the extension wins over the filter
        ("audit", "HTML (*.html)", "html"),  # no extension: the chosen filter's
    ],
)
def test_export_carries_the_format(qtbot, monkeypatch, tmp_path, results, name, chosen, fmt):
    from PySide6.QtWidgets import QFileDialog

    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(tmp_path / name), chosen))
    panel = AuditPanel()
    qtbot.addWidget(panel)
    panel.set_rows(audit_rows(results))
    with qtbot.waitSignal(panel.export_requested, timeout=2000) as blocker:
        qtbot.mouseClick(panel.export_button, Qt.MouseButton.LeftButton)
    assert blocker.args[0] == fmt
    assert blocker.args[1].startswith(str(tmp_path / name))


def test_export_refuses_unknown_extension_and_cancel(qtbot, monkeypatch, tmp_path):
    from PySide6.QtWidgets import QFileDialog

    panel = AuditPanel()
    qtbot.addWidget(panel)
    with qtbot.assertNotEmitted(panel.export_requested):
        assert not panel.request_export(tmp_path / "audit.xlsx")
        monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: ("", ""))
        assert not panel.choose_export()
    assert "xlsx" in panel.message.text()


def test_panels_start_empty_and_clear(qtbot, results):
    panels = [AttentionPanel(), DLAPanel(), LensPanel(), AuditPanel()]
    for panel in panels:
        qtbot.addWidget(panel)
    attention, dla, lens, audit = panels
    for panel in (attention, dla, lens):
        panel.set_result(results["shapes-llava"])
        panel.set_result(None)
        assert "no analysis yet" in (panel.title if hasattr(panel, "title") else panel.target_label).text()
    assert attention.visual_grid.values.shape == (0, 0) and not attention.select_head(0, 0)
    assert dla.shown_values() == [] and not dla.request_sources()
    assert all(not curves for curves in lens.curves.values()) and lens.table.rowCount() == 0
    audit.set_rows([])
    assert audit.count_label.text() == "0 rows"


def test_heat_grid_cell_values_follow_each_new_grid(qtbot):
    """Cell-value labels are reused from one grid to the next: each shown grid
    has exactly one label per finite cell, with that cell's value, at its centre."""
    from app.panels.attention_panel import HeatGrid

    grid = HeatGrid(annotate=True)
    qtbot.addWidget(grid)
    grid.resize(400, 300)
    for values in (
        np.arange(12.0).reshape(3, 4) / 10,
        np.array([[0.5, np.nan], [0.25, 1.0]]),
        np.arange(30.0).reshape(5, 6) / 100,
    ):
        grid.set_grid(values)
        cells = [(r, c) for r in range(values.shape[0]) for c in range(values.shape[1]) if np.isfinite(values[r, c])]
        assert len(grid._texts) == len(cells)
        for text, (r, c) in zip(grid._texts, cells, strict=True):
            assert text.toPlainText() == f"{values[r, c]:.2f}"
            assert (text.pos().x(), text.pos().y()) == (c + 0.5, r + 0.5)
        assert all(t.scene() is grid.scene() for t in grid._texts)


def test_shared_widgets_keep_text_plain_and_boxes_bare(qtbot):
    """app.widgets: a label shows markup-looking tokens as text (selectable only on
    request), a box has no margins and keeps the stretches asked for, a splitter
    holds its widgets in order."""
    from PySide6.QtWidgets import QHBoxLayout, QLabel

    from app.widgets import box, boxed, plain_label, split, stacked

    label = plain_label("<b>image</b> <image>", wrap=True)
    qtbot.addWidget(label)
    assert label.textFormat() == Qt.TextFormat.PlainText and label.text() == "<b>image</b> <image>"
    assert label.wordWrap()
    assert not label.textInteractionFlags() & Qt.TextInteractionFlag.TextSelectableByMouse
    chosen = plain_label("x", selectable=True)
    qtbot.addWidget(chosen)
    assert chosen.textInteractionFlags() & Qt.TextInteractionFlag.TextSelectableByMouse
    assert not chosen.wordWrap()

    first, second = QLabel("a"), QLabel("b")
    row = box(QHBoxLayout(), first, (second, 3), end_stretch=True)
    assert [row.stretch(i) for i in range(row.count())] == [0, 3, 1]
    holder = stacked(row, QLabel("c"))
    qtbot.addWidget(holder)
    margins = holder.layout().contentsMargins()
    assert (margins.left(), margins.top(), margins.right(), margins.bottom()) == (0, 0, 0, 0)
    assert first.parent() is holder and second.parent() is holder
    wide = boxed(QHBoxLayout(), QLabel("d"))
    qtbot.addWidget(wide)
    assert wide.layout().contentsMargins().left() == 0

    left, right = QLabel("left"), QLabel("right")
    splitter = split(Qt.Orientation.Vertical, left, right, sizes=[30, 70])
    qtbot.addWidget(splitter)
    assert splitter.orientation() == Qt.Orientation.Vertical
    assert [splitter.widget(i) for i in range(splitter.count())] == [left, right]


# ---- layout: titles and axis labels (issue 13, item 8) ---------------------


def shown(qtbot, widget, width: int, height: int):
    """``widget`` at ``width x height``, shown and exposed (its axes and titles laid out)."""
    qtbot.addWidget(widget)
    widget.resize(width, height)
    widget.show()
    qtbot.waitExposed(widget)
    return widget


def tick_gaps(axis, pixels_per_unit: float) -> float:
    """The smallest distance in pixels between neighbouring tick labels of ``axis``."""
    positions = sorted(p for p, _ in axis._tickLevels[0])
    return min((b - a) * pixels_per_unit for a, b in zip(positions, positions[1:])) if len(positions) > 1 else math.inf


def label_width(axis) -> float:
    from PySide6.QtGui import QFontMetricsF

    from app.widgets import axis_font

    metrics = QFontMetricsF(axis_font(axis))
    return max(metrics.horizontalAdvance(text) for _, text in axis._tickLevels[0])


def test_a_24_by_24_patch_map_labels_every_kth_patch(qtbot):
    """The 24 x 24 patch axis labels ran into each other in a narrow plot: now
    every k-th is shown, at least a label's width (and a gap) apart; refitted on resize."""
    from PySide6.QtGui import QFontMetricsF

    from app.panels.attention_panel import HeatGrid
    from app.widgets import axis_font

    grid = shown(qtbot, HeatGrid("patch map", annotate=False), 220, 220)
    grid.set_grid(np.random.default_rng(0).random((24, 24)))
    for width in (220, 900):
        grid.resize(width, 220 if width < 900 else 900)
        qtbot.waitUntil(lambda w=width: grid.plot_item.getViewBox().sceneBoundingRect().width() > 0.1 * w)
        rect = grid.plot_item.getViewBox().sceneBoundingRect()
        bottom, left = grid.plot_item.getAxis("bottom"), grid.plot_item.getAxis("left")
        assert tick_gaps(bottom, rect.width() / 24) >= label_width(bottom) + 6
        assert tick_gaps(left, rect.height() / 24) >= QFontMetricsF(axis_font(left)).height()
        assert [t for _, t in bottom._tickLevels[0]][0] == "0"
    assert len(bottom._tickLevels[0]) == 24  # room for all at 900 px


def test_dataset_distribution_labels_do_not_overlap(qtbot):
    from app.panels.attention_panel import BoxPlot

    plot = shown(qtbot, BoxPlot(), 420, 300)
    labels = [f"L{b}.xattn.H{h}" for b in range(6) for h in range(8)]
    quantile = {"0.05": 0.1, "0.25": 0.2, "0.5": 0.3, "0.75": 0.4, "0.95": 0.5}
    plot.set_boxes(labels, [quantile] * len(labels), y_label="mass")
    qtbot.wait(50)
    view = plot.plot_item.getViewBox()
    (x0, x1), _ = view.viewRange()
    axis = plot.plot_item.getAxis("bottom")
    assert 1 < len(axis._tickLevels[0]) < len(labels)
    assert tick_gaps(axis, view.sceneBoundingRect().width() / (x1 - x0)) >= label_width(axis) + 6


def test_lens_layer_labels_do_not_overlap(qtbot, results):
    result = copy_with_layers(results["shapes-llava"], 33)
    panel = shown(qtbot, LensPanel(), 700, 600)
    panel.set_result(result)
    qtbot.wait(50)
    plot = panel.plots["kl"]
    view = plot.getViewBox()
    (x0, x1), _ = view.viewRange()
    axis = plot.getAxis("bottom")
    assert tick_gaps(axis, view.sceneBoundingRect().width() / (x1 - x0)) >= label_width(axis) + 6
    assert panel.table.horizontalHeader().textElideMode() == Qt.TextElideMode.ElideRight
    assert panel.table.horizontalHeaderItem(4).toolTip()  # the short "top tokens (p)" explained


def copy_with_layers(result, n_points: int):
    """``result`` with its logit-lens rows repeated to ``n_points`` layers (a deep model's axis)."""
    rows = result.logit_lens
    lens = [replace(rows[i % len(rows)], layer=i) for i in range(n_points)]
    return replace(result, logit_lens=lens, attention=[])


def test_emptied_maps_lose_their_head_titles(qtbot, results):
    """Issue 13, bug 5: "L1.H1: per patch" stayed over an empty map."""
    from app.widgets import full_title

    result = results["shapes-llava"]
    attention = AttentionPanel()
    qtbot.addWidget(attention)
    attention.set_result(result)
    assert attention.select_head(1, 1)
    assert "per patch" in full_title(attention.patch_map.plot_item)
    attention.set_result(None)
    assert attention.patch_map.values.shape == (0, 0)
    assert full_title(attention.patch_map.plot_item) == "selected head: patch map"

    dla = DLAPanel()
    qtbot.addWidget(dla)
    dla.set_result(result)
    dla.set_sources(1, 1, np.ones(len(result.input.visual_tokens)))
    assert "L1.H1" in full_title(dla.source_grid.plot_item)
    dla.set_result(result)  # a new result: its sources are not computed yet
    assert dla.source_grid.values.shape == (0, 0)
    assert full_title(dla.source_grid.plot_item) == "per-source contribution"


def test_plot_titles_are_elided_to_their_plot(qtbot):
    from app.panels.attention_panel import HeatGrid
    from app.widgets import full_title, set_title

    grid = shown(qtbot, HeatGrid("per-source contribution", annotate=False), 170, 240)
    long = "L0.xattn.H3: per source (dla_frozen), per patch, signed, first-order"
    set_title(grid.plot_item, long, "9pt")
    qtbot.wait(20)
    label = grid.plot_item.titleLabel
    centre = label.pos().x() + label.width() / 2
    assert label.text.endswith("…") and long.startswith(label.text[:-1])
    assert label.item.boundingRect().width() <= 2 * min(centre, grid.plot_item.width() - centre) + 1
    assert full_title(grid.plot_item) == long == label.toolTip()
    grid.resize(900, 240)
    qtbot.waitUntil(lambda: label.text == long)  # wide enough again: whole


def test_dla_legend_sits_outside_the_bars(qtbot, results):
    """The legend inside the plot covered bar values; it is a line above the plot."""
    panel = shown(qtbot, DLAPanel(), 1000, 700)
    panel.set_result(results["shapes-llava"])
    legend, plot = panel.legend, panel.plot_widget
    assert legend.isVisible() and all(kind in legend.text() for kind in ("attention head", "MLP", "embedding"))
    from PySide6.QtCore import QPoint, QRect

    def in_panel(widget) -> QRect:
        return QRect(widget.mapTo(panel, QPoint(0, 0)), widget.size())

    assert not in_panel(legend).intersects(in_panel(plot))


def test_panel_info_lines_never_set_the_panel_width(qtbot, results):
    """Titles that carry numbers wrap; a long model spec no longer sets a panel's minimum width."""
    shapes = results["shapes-llava"]
    long = replace(shapes, model=replace(shapes.model, spec="/models/" + "a-long-folder-name/" * 12))
    for panel, label in (
        (AttentionPanel(), "title"),
        (DLAPanel(), "target_label"),
        (LensPanel(), "title"),
    ):
        qtbot.addWidget(panel)
        narrow = panel.minimumSizeHint().width()
        panel.set_result(long)
        assert getattr(panel, label).wordWrap() and long.model.spec in getattr(panel, label).text()
        assert panel.minimumSizeHint().width() == narrow


# ---- claims ---------------------------------------------------------------


def test_validation_panel_reads_its_fields_and_fills_the_subject_from_a_selected_head(qtbot, tmp_path):
    from app.components import RunInput, Workspace
    from app.components.selection import Selection
    from app.panels.validation_panel import ValidationPanel

    selection = Selection(Workspace(RunInput(model_spec="m")))
    panel = ValidationPanel(selection)
    qtbot.addWidget(panel)
    panel.subject_edit.setText("L1.H1, L1.H0 + L1.H2,")
    assert panel.subjects() == ["L1.H1", "L1.H0+L1.H2"]  # a route is one subject, spaces dropped
    assert panel.dataset() == "scenes"
    panel.set_dataset("folder")
    assert panel.dataset() is None  # no folder chosen yet
    panel.set_folder(tmp_path)
    assert panel.dataset() == str(tmp_path) and panel.dataset_combo.currentText() == f"folder: {tmp_path.name}"
    panel.bundled = tmp_path / "samples"
    panel.set_dataset("bundled")
    assert panel.dataset() == str(tmp_path / "samples")
    selection.select("L0.H3", "dla", None)
    assert panel.subject_edit.text() == "L0.H3"
    selection.select("L0.mlp", "dla", None)  # not a head: the subject stays
    selection.select("L1.H1", "lens", None)  # a lens row is a block's writes, never a head's
    assert panel.subject_edit.text() == "L0.H3"
    assert panel.status_texts() == [] and not panel.select_step(1)
