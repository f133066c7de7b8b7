"""The analyze-side panels draw themselves from the run they are shown for
(``draw(run, kind)``, the protocol of app.run_frame.RunFrame): a live analyze result and
the same result restored from its stored JSON (core.results.readout.restore_result) draw the same
table cells, plot data and heatmap arrays; ``draw(None, None)`` empties each panel as it
started (the canvas keeps its image: the image is the input)."""

import json
from pathlib import Path

import numpy as np
import pytest

import core
from app.canvas import ImageCanvas
from app.components import ModelChoice, RunInput, ShownRun
from app.panels import NO_ANALYSIS
from app.panels.answer_panel import HOW_TO_ANSWER, NO_ANSWER, AnswerPanel, run_caption
from app.panels.answer_patterns_panel import NO_PATTERNS
from app.panels.attention_panel import AttentionPanel
from app.panels.dla_panel import CONVENTIONS, RERUN_CONVENTIONS, DLAPanel
from app.panels.lens_panel import LOGIT_LENS, PLOTS, LensPanel
from app.samples import bundled_samples
from core.analyze import analyze
from core.answer_text import AnswerText
from core.generate import generate
from core.methods.tuned_lens import load_lens
from core.results.readout import jsonable, restore_result

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = bundled_samples()[0]
HEAD = (1, 1)  # a self-attention head of shapes-llava (block 1, head 1)


def as_json(doc):
    return json.loads(json.dumps(jsonable(doc)))


def restored(result):
    """``result`` as a session gives it back: its JSON through the one conversion."""
    return restore_result(result.kind, as_json(result.to_dict()))


def run_of(result, kind: str | None = None, run_id: int | None = 4, **results) -> ShownRun:
    """A shown run of the bundled sample holding ``result`` as its ``kind`` (default its own) and
    ``results`` of other kinds."""
    kind = kind or result.kind
    asked = RunInput(
        image_path=str(SAMPLE.image_path),
        image_sha256="0" * 64,
        question=SAMPLE.question,
        model_spec="shapes-llava",
        answer_text=getattr(result, "answer_text", None),
    )
    return ShownRun(run_id, kind, asked, {kind: result, **results})


@pytest.fixture(scope="module")
def llava(model_cache):
    choice = ModelChoice("shapes-llava")  # the window's cache key: the window tests reuse it
    if choice not in model_cache:
        model_cache[choice] = core.load_model("shapes-llava", **choice.load_options())
    return model_cache[choice]


@pytest.fixture(scope="module")
def generation(llava):
    return generate(llava, SAMPLE.image_path, SAMPLE.question, max_new_tokens=3)


@pytest.fixture(scope="module")
def live(llava, generation):
    """Read-outs computed once: at the model's answer with a foil and the tuned lens beside the
    weights, and at the last token of the model's generated answer."""
    lens = load_lens(ROOT / "resources" / "models" / "shapes-llava" / "tuned-lens", llava)
    at = AnswerText(
        generation.text, tuple(generation.token_ids), tuple(generation.tokens), len(generation.token_ids) - 1
    )
    return {
        "answer": analyze(llava, SAMPLE.image_path, SAMPLE.question, foil="triangle", tuned=lens),
        "token": analyze(llava, SAMPLE.image_path, SAMPLE.question, answer_text=at),
    }


# ---- what each panel shows, as plain values ---------------------------------------------------


def table_cells(table) -> list[list[str]]:
    return [
        [table.item(r, c).text() if table.item(r, c) is not None else None for c in range(table.columnCount())]
        for r in range(table.rowCount())
    ]


def grid_shown(grid) -> dict:
    return {"values": grid.values.copy(), "rows": list(grid.row_labels), "cols": list(grid.col_labels)}


def attention_shown(panel: AttentionPanel) -> dict:
    shown = {
        "title": panel.title.text(),
        "visual": grid_shown(panel.visual_grid),
        "sink": grid_shown(panel.sink_grid),
        "details": panel.details.text(),
    }
    if panel.select_head(*HEAD, emit=False):
        shown["head"] = {
            "details": panel.details.text(),
            "patch map": grid_shown(panel.patch_map),
            "text": grid_shown(panel.text_grid),
            "text note": panel.text_note.text(),
        }
    return shown


def dla_shown(panel: DLAPanel) -> dict:
    shown = {"target": panel.target_label.text(), "error": panel.error_label.text()}
    for convention in CONVENTIONS:
        if convention in RERUN_CONVENTIONS:
            continue
        panel.set_convention(convention)
        shown[convention] = {
            "bars": panel.shown_values(),
            "x0": np.asarray(panel.bars.opts["x0"], dtype=float),
            "width": np.asarray(panel.bars.opts["width"], dtype=float),
            "sums": panel.sum_label.text(),
            "caveat": panel.caveat_label.text(),
        }
    panel.set_convention("frozen scale")
    return shown


def lens_shown(panel: LensPanel) -> dict:
    curves = {
        key: {name: [np.asarray(d) for d in c.getData()] for name, c in panel.curves[key].items()} for key in PLOTS
    }
    tables = {}
    for i in range(panel.reader_combo.count()):
        panel.reader_combo.setCurrentIndex(i)
        tables[panel.reader_combo.itemText(i)] = table_cells(panel.table)
    return {"title": panel.title.text(), "legend": panel.legend.text(), "curves": curves, "tables": tables}


def answer_shown(panel: AnswerPanel) -> dict:
    patterns = panel.patterns
    return {
        "label": panel.label.text(),
        "caption": panel.caption.text(),
        "table title": panel.table_title.text(),
        "table": table_cells(panel.table),
        "patterns title": patterns.title.text(),
        "patterns": table_cells(patterns.table),
        "blocks": [patterns.block_combo.itemText(i) for i in range(patterns.block_combo.count())],
        "cross note": (patterns.cross_note.isHidden(), patterns.cross_note.text()),
    }


def canvas_shown(canvas: ImageCanvas) -> dict:
    return {
        "tokens": [t.to_dict() for t in canvas.tokens],
        "views": [v.to_dict() for v in canvas.views],
        "note": canvas.token_note(),
        "token read": canvas.token_read,
        "values": None if canvas.values is None else canvas.values.copy(),
        "label": canvas.heatmap_label,
        "title": canvas.heatmap_title.text(),
        "levels": canvas.levels,
    }


def assert_same(a, b, where: str = "") -> None:
    """Equal, arrays cell by cell (NaN where NaN): no tolerance, the JSON keeps every float."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=where)
    else:
        assert a == b, where


# that a drawing drew something (so that two equal drawings are not two empty ones)
DREW = {
    "attention": lambda p: p.visual_grid.values.size > 0,
    "dla": lambda p: bool(p.shown_values()),
    "lens": lambda p: p.table.rowCount() > 0 and bool(p.curves["kl"]),
    "answer": lambda p: p.label.text() != NO_ANSWER and p.patterns.rows() != [],
    "canvas": lambda p: bool(p.tokens) and p.values is not None,
}

PANELS = {
    "attention": (AttentionPanel, attention_shown),
    "dla": (DLAPanel, dla_shown),
    "lens": (LensPanel, lens_shown),
    "answer": (AnswerPanel, answer_shown),
    "canvas": (ImageCanvas, canvas_shown),
}


def new_panel(qtbot, name: str):
    panel = PANELS[name][0]()
    qtbot.addWidget(panel)
    if isinstance(panel, ImageCanvas):
        panel.set_image(core.load_image(SAMPLE.image_path))
    return panel


# ---- a live run and the same run restored -----------------------------------------------------


@pytest.mark.parametrize("which", ["answer", "token"])
@pytest.mark.parametrize("name", list(PANELS))
def test_a_restored_run_draws_what_the_live_run_drew(qtbot, live, name, which):
    result = live[which]
    again = restored(result)
    assert again is not result and again.to_dict() == as_json(result.to_dict())
    shown = PANELS[name][1]
    drawn_live, drawn_restored = new_panel(qtbot, name), new_panel(qtbot, name)
    drawn_live.draw(run_of(result), "analyze")
    drawn_restored.draw(run_of(again, run_id=9), "analyze")
    assert drawn_live.run.results["analyze"] is result and drawn_restored.run.results["analyze"] is again
    assert DREW[name](drawn_live) and DREW[name](drawn_restored)
    assert_same(shown(drawn_live), shown(drawn_restored), name)


@pytest.mark.parametrize("name", list(PANELS))
def test_drawing_no_run_empties_the_panel_as_it_started(qtbot, live, name):
    shown = PANELS[name][1]
    empty = shown(new_panel(qtbot, name))
    panel = new_panel(qtbot, name)
    panel.draw(run_of(live["answer"]), "analyze")
    panel.draw(None, None)
    assert panel.run is None
    assert_same(shown(panel), empty, name)


def test_drawn_content_is_the_runs_result(qtbot, live):
    """What each panel draws is read from the result, not only equal between two drawings."""
    result = live["answer"]
    run = run_of(result)
    attention, dla, lens, canvas = (new_panel(qtbot, n) for n in ("attention", "dla", "lens", "canvas"))
    for panel in (attention, dla, lens, canvas):
        panel.draw(run, "analyze")
    names = result.block_names
    assert attention.visual_grid.row_labels == [names[b] for b in sorted(names)]
    for a in result.attention:
        r, c = attention.layers.index(a.layer), attention.heads.index(a.head)
        assert attention.visual_grid.values[r, c] == a.visual_mass and attention.sink_grid.values[r, c] == a.bos_mass
    dla.set_top_k(0)
    assert dict(dla.shown_values()) == result.residual_decomposition.component_values("dla_frozen")
    tuned = result.tuned_lens.readers
    assert tuned and set(lens.curves["kl"]) == {LOGIT_LENS, *tuned}  # the run's own tuned-lens readers
    for name, rows in tuned.items():
        xs, ys = lens.curves["kl"][name].getData()
        assert list(ys) == [r.kl_to_final for r in sorted(rows, key=lambda r: r.layer) if r.kl_to_final is not None]
    rollout = result.rollout
    assert canvas.heatmap_label == f"rollout (alpha {rollout.alpha}): structural-flow approximation, not a cause"
    grid = np.asarray(rollout.visual_patch_mass, dtype=float)
    for t in canvas.tokens:
        if t.col >= 0:
            assert canvas.values[t.item] == grid[t.row, t.col]
    assert canvas.token_read == f"answer {result.target.answer!r}"  # named in every heatmap title
    # a run without a tuned lens draws the logit lens alone: no reader of an earlier run stays
    lens.draw(run_of(live["token"]), "analyze")
    assert set(lens.curves["kl"]) == {LOGIT_LENS}


# ---- the canvas: the maps of the run drawn ----------------------------------------------------


def test_the_canvas_maps_a_head_and_its_sources_of_the_run_drawn(qtbot, live):
    canvas = new_panel(qtbot, "canvas")
    assert not canvas.show_head_map(*HEAD) and not canvas.show_sources_map(*HEAD, [])  # no run drawn
    result = live["answer"]
    canvas.draw(run_of(restored(result)), "analyze")
    assert canvas.show_head_map(*HEAD)
    head = result.head(*HEAD)
    grid = np.asarray(head.visual_patch_mass, dtype=float)
    assert canvas.heatmap_label == f"{head.name}: answer-row attention (routing only)"
    assert [canvas.values[t.item] for t in canvas.tokens if t.col >= 0] == [
        grid[t.row, t.col] for t in canvas.tokens if t.col >= 0
    ]
    assert not canvas.show_head_map(99, 0)  # no such head: the map stays
    assert canvas.heatmap_label.startswith(head.name)
    values = np.arange(len(canvas.tokens), dtype=float)
    assert canvas.show_sources_map(*HEAD, values)
    assert canvas.heatmap_label == f"{head.block}.H{HEAD[1]}: frozen-scale DLA per source token"
    np.testing.assert_array_equal(canvas.values, values)
    image = canvas.image.copy()
    canvas.draw(None, None)  # the tokens, note and map were the run's; the image is the input
    assert canvas.tokens == [] and canvas.values is None and canvas.token_note() == ""
    np.testing.assert_array_equal(canvas.image, image)


def test_a_tiled_models_note_comes_with_its_run_and_goes_with_it(qtbot, live):
    from dataclasses import replace

    result = live["answer"]
    tiles = [replace(t, image=1) for t in result.input.visual_tokens[:4]]
    tiled = replace(result, input=replace(result.input, visual_tokens=[*result.input.visual_tokens, *tiles]))
    canvas = new_panel(qtbot, "canvas")
    canvas.draw(run_of(tiled), "analyze")
    assert "views of the image" in canvas.token_note()
    canvas.draw(run_of(result), "analyze")
    assert canvas.token_note() == ""


# ---- attention: the head selected stays with a new drawing ------------------------------------


def test_the_selected_head_stays_selected_when_another_run_is_drawn(qtbot, live):
    panel = new_panel(qtbot, "attention")
    panel.draw(run_of(live["answer"]), "analyze")
    assert panel.select_head(*HEAD)
    emitted = []
    panel.head_selected.connect(lambda *args: emitted.append(args))
    panel.draw(run_of(restored(live["token"])), "analyze")
    assert panel.selected == HEAD and emitted == []  # drawn, not clicked: the canvas keeps its rollout
    assert f"{live['token'].head(*HEAD).entropy:.3f} nats" in panel.details.text()
    panel.draw(None, None)
    assert panel.selected is None and panel.title.text() == NO_ANALYSIS


# ---- the Answer tab: each kind it shows -------------------------------------------------------


def test_the_answer_tab_draws_an_answer_a_generation_and_a_readouts_answer(qtbot, llava, live, generation):
    panel = new_panel(qtbot, "answer")
    answer = core.answer(llava, SAMPLE.image_path, SAMPLE.question)
    answer_run = run_of(answer, "answer", run_id=None)  # an answer is not recorded
    panel.draw(answer_run, "answer")
    assert panel.label.text() == f"answer: {answer.answer}  (p = {answer.prob:.3f})"
    assert table_cells(panel.table) == [[t, f"{p:.3f}"] for t, p in answer.top]
    caption = f"shapes-llava · {SAMPLE.image_path.name} · {SAMPLE.question}"
    assert panel.caption.text() == run_caption(answer_run) == caption
    assert panel.patterns.rows() == []  # no read-out in this run

    for result in (generation, restored(generation)):
        panel.draw(run_of(result), "generate")
        assert panel.label.text() == f"answer: {generation.text}"
        assert [row[0] for row in table_cells(panel.table)] == [f"{k}: {t}" for k, t in enumerate(generation.tokens)]

    # a read-out at the model's answer: its own forward's answer and alternatives, its answer patterns
    result = live["answer"]
    panel.caption_of = lambda run: run_caption(run, expected="square")  # the window's: a sample's ground truth
    panel.draw(run_of(result), "analyze")
    top = result.top
    assert panel.label.text() == f"answer: {top[0][0]}  (p = {top[0][1]:.3f})"
    assert panel.caption.text().endswith("\nexpected (sample ground truth): square")
    assert len(panel.patterns.rows()) == 1 and panel.patterns.section is result.answer_patterns

    # a read-out at one token of a generated answer: that token and the alternatives there
    result = live["token"]
    panel.draw(run_of(restored(result)), "analyze")
    k, token = result.answer_text.index, result.answer_text.token
    assert panel.label.text().startswith(f"answer token {k} {token!r}  (p = {result.target.prob:.3f})")
    assert panel.table_title.text() == f"top alternatives at answer token {k} {token!r}"
    assert len(panel.patterns.rows()) == k + 1  # a row per answer token predicted up to the one read

    # an answer added to a read-out's run: the answer drawn, the run's patterns kept
    both = run_of(live["answer"], answer=answer)  # the workspace's add_result of the same input
    panel.draw(both, "answer")
    assert panel.label.text() == f"answer: {answer.answer}  (p = {answer.prob:.3f})"
    assert panel.patterns.section is live["answer"].answer_patterns

    panel.draw(None, None)
    assert panel.label.text() == NO_ANSWER and panel.caption.text() == HOW_TO_ANSWER
    assert panel.patterns.title.text() == NO_PATTERNS and panel.table.rowCount() == 0
