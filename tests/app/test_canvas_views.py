"""The canvas's view selector (issue 14, part 5): each view of a tiled model's
image alone, or all of them laid out on the image, with the region each covers
outlined; the drawn grid, boxes and heatmap checked against the adapter's own
geometry and the run's per-view grids. Its own file: these tests wait on
workers (see tests/app/test_window.py's screenshot pitfall)."""

import numpy as np
import pytest
from PySide6.QtCore import QPointF, QRectF
from PySide6.QtWidgets import QApplication

import core
from app.canvas import ImageCanvas
from app.canvas.views import ALL_VIEWS, ALL_VIEWS_TEXT
from app.components import ModelChoice
from app.panels import analysis_of
from tests.app.test_window import run_until_idle


@pytest.fixture(scope="module")
def llava_next_folder(tmp_path_factory) -> str:
    """A LLaVA-NeXT-shaped model folder (the tiny random model of
    tests/core/test_llava_next.py, saved as a user's folder is: safetensors, the
    processor's files), which the window opens through its own loading path."""
    import torch

    from tests.core.test_llava_next import tiny_llava_next_float64

    torch.manual_seed(0)
    tiny = tiny_llava_next_float64()
    folder = tmp_path_factory.mktemp("llava-next")
    tiny.model.float().save_pretrained(folder, safe_serialization=True)
    tiny.processor.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def llava_next(llava_next_folder):
    """The folder's model as core.load_model loads it."""
    return core.load_model(llava_next_folder)


def expected_cells(tokens, images) -> list:
    """The adapter's patch tokens of ``images``, in token order."""
    return [t for t in tokens if t.col >= 0 and t.image in images]


def clipped_bounds(tokens, size) -> tuple[float, float, float, float]:
    """The bounding box of ``tokens``' boxes, clipped to a ``(width, height)`` image."""
    b = np.array([t.box for t in tokens], dtype=float)
    w, h = size
    return (max(b[:, 0].min(), 0), max(b[:, 1].min(), 0), min(b[:, 2].max(), w), min(b[:, 3].max(), h))


def rect_tuple(r: QRectF) -> tuple[float, float, float, float]:
    return (r.left(), r.top(), r.right(), r.bottom())


def assert_drawn(canvas: ImageCanvas, tokens, images, size) -> None:
    """The cells, grid rectangles and outlines are exactly the adapter's tokens of ``images``."""
    want = expected_cells(tokens, images)
    assert [(c.index, c.image, c.row, c.col) for c in canvas.cells] == [(t.index, t.image, t.row, t.col) for t in want]
    assert len(canvas.grid_item.rects) == len(want)
    for r, t in zip(canvas.grid_item.rects, want):
        assert rect_tuple(r) == pytest.approx(tuple(t.box), abs=1e-9)
    outlines = sorted(rect_tuple(r) for r in canvas.outline_item.rects)
    regions = sorted(clipped_bounds([t for t in want if t.image == im], size) for im in images)
    assert len(outlines) == len(regions)
    for got, region in zip(outlines, regions):
        assert got == pytest.approx(region, abs=1e-9)


def shown_analysis(window):
    """The analyze result the window's workspace shows (the panels draw from it), or None."""
    return analysis_of(window.workspace.shown)


def pick(canvas: ImageCanvas, choice) -> None:
    """Select ``choice`` in the view combo box, as a user does."""
    index = canvas.view_selector.findData(choice)
    assert index >= 0, (choice, canvas.view_selector.choices())
    canvas.view_selector.setCurrentIndex(index)
    assert canvas.view_choice() == choice


def test_each_view_of_a_llava_next_run_is_drawn_from_the_adapters_geometry(qtbot, window, llava_next_folder):
    """A LLaVA-NeXT-shaped folder opened and read out through the window (the real engine):
    select each view and check the grid, boxes, outline and heatmap; a new run
    on an image of another size shows its own views, nothing of the old run."""
    from tests.core.exactness import noise_image
    from tests.core.test_llava_next import IMAGE_SIZE, QUESTION

    window.inputs.model_picker.setCurrentText(llava_next_folder)  # the folder, as a user picks it
    assert window.set_image(noise_image(IMAGE_SIZE), name="noise")
    window.set_question(QUESTION)
    run_until_idle(qtbot, window, window.actions.run_readout)
    analysis = shown_analysis(window)
    assert analysis is not None, window.inputs.error_label.text()
    adapter = window.loaded_model().adapter  # what the window loaded from the folder
    assert adapter.family == "llava_next"
    canvas = window.canvas
    tokens = adapter.visual_tokens(IMAGE_SIZE)
    selector = canvas.view_selector
    assert selector.isVisible() and selector.choices() == [0, 1, ALL_VIEWS]
    assert [selector.itemText(i) for i in range(selector.count())] == [
        "base: 4x4",
        "high-res (2x2 tiles): 4x8",
        ALL_VIEWS_TEXT,
    ]
    note = canvas.note_label.text()
    assert "views of the image" in note and "not drawn" not in note
    painter = window.counterfactual_panel.canvas.view_selector  # the Counterfactual tab's canvas names them too
    assert [painter.itemText(i) for i in range(painter.count())][:2] == ["base: 4x4", "high-res (2x2 tiles): 4x8"]
    # the default is the read-outs' primary (whole-image) view
    assert canvas.view_choice() == analysis.rollout.primary_image == 0
    assert_drawn(canvas, tokens, [0], IMAGE_SIZE)

    row = next(r for r in analysis.attention if r.visual_patch_mass_by_image)
    grids = {g["image"]: np.asarray(g["grid"], dtype=float) for g in row.visual_patch_mass_by_image}
    assert window.attention_panel.select_head(row.layer, row.head)  # its map goes on the canvas
    for choice in (1, 0):
        pick(canvas, choice)
        assert canvas.shown_image == choice
        assert_drawn(canvas, tokens, [choice], IMAGE_SIZE)
        drawn = [(t.image, t.row, t.col, v) for t, v, _ in canvas.heatmap_item.cells]
        assert drawn == [
            (t.image, t.row, t.col, grids[t.image][t.row, t.col]) for t in expected_cells(tokens, [choice])
        ]
        finite = [v for *_, v in drawn]
        assert canvas.levels == (min(finite), max(finite))  # the scale covers the view drawn
        t = expected_cells(tokens, [choice])[5]
        hit = canvas.token_at((t.box[0] + t.box[2]) / 2, (t.box[1] + t.box[3]) / 2)
        assert (hit.index, hit.image) == (t.index, choice)
    # the high-res view leaves the top and bottom strips to the base view: its outline is narrower
    pick(canvas, 1)
    ((_, top, _, bottom),) = [rect_tuple(r) for r in canvas.outline_item.rects]
    assert 0 < top and bottom < IMAGE_SIZE[1]

    pick(canvas, ALL_VIEWS)
    assert canvas.shown_image is None
    assert_drawn(canvas, tokens, [0, 1], IMAGE_SIZE)
    # laid out, the finer high-res view is on top; the strip above it shows the base view
    mid = canvas.token_at(IMAGE_SIZE[0] / 2, IMAGE_SIZE[1] / 2)
    strip = canvas.token_at(IMAGE_SIZE[0] / 2, top / 2)
    assert mid.image == 1 and strip.image == 0 and strip.row == 0

    # a new run on a tall image (2 x 1 tiles): the chosen "all views" stays, with the new run's geometry
    size = (40, 100)
    assert window.set_image(noise_image(size), name="tall")
    assert canvas.cells == [] and not selector.isVisible()
    run_until_idle(qtbot, window, window.actions.run_readout)
    assert shown_analysis(window) is not None, window.inputs.error_label.text()
    tokens = adapter.visual_tokens(size)
    assert canvas.view_choice() == ALL_VIEWS
    assert_drawn(canvas, tokens, [0, 1], size)
    assert selector.itemText(1) == "high-res (2x1 tiles): 8x4"  # 64 x 32 canvas, 8 x 4 patches of 8 px
    # a picked view the new run has no view of that name falls back to the default view
    pick(canvas, 1)
    assert_drawn(canvas, tokens, [1], size)
    assert window.set_image(noise_image(IMAGE_SIZE), name="wide")
    run_until_idle(qtbot, window, window.actions.run_readout)
    assert canvas.view_choice() == 0
    assert_drawn(canvas, adapter.visual_tokens(IMAGE_SIZE), [0], IMAGE_SIZE)


def test_llava_centre_crop_outline(canvas, model_cache):
    """LLaVA-1.5's centre crop leaves a wide image's sides out: the one view's outline shows it."""
    llava = ModelChoice("shapes-llava")  # the window's cache key: the default dtype and device
    if llava not in model_cache:
        model_cache[llava] = core.load_model("shapes-llava", **llava.load_options())
    adapter = model_cache[llava].adapter
    size = (300, 200)
    canvas.set_image(np.zeros((size[1], size[0], 3), np.uint8))
    canvas.set_tokens(adapter.visual_tokens(size))
    # shortest edge 128: 300 x 200 becomes 192 x 128; the 128 px crop drops 32 px a side = 50 original px
    assert [rect_tuple(r) for r in canvas.outline_item.rects] == [(50.0, 0.0, 250.0, 200.0)]
    assert canvas.view_selector.choices() == [0] and not canvas.view_selector.isVisible()
    with pytest.raises(ValueError, match="no view 1"):
        canvas.set_view(1)


def test_all_views_draw_the_finest_on_top(canvas, qtbot, llava_next):
    """Rendered: with all views laid out, a pixel under the high-res view shows its
    cell's colour alone (not blended with the base cell under it), the strip it
    leaves shows the base view's; so does the interpolated view."""
    from tests.core.test_llava_next import IMAGE_SIZE

    tokens = llava_next.adapter.visual_tokens(IMAGE_SIZE)
    canvas.set_image(np.zeros((IMAGE_SIZE[1], IMAGE_SIZE[0], 3), np.uint8))  # black: a cell shows colour x opacity
    canvas.set_tokens(tokens, image=None)
    assert canvas.view_choice() == ALL_VIEWS
    values = [0.0 if t.image == 0 else 1.0 for t in tokens]
    canvas.set_heatmap(values, label="view")
    canvas.set_grid_visible(False)
    canvas.outline_item.hide()
    QApplication.processEvents()
    shot = canvas.view.grab().toImage()
    opacity = canvas.heatmap_item.opacity()
    high = [t for t in tokens if t.image == 1 and t.col >= 0]
    top = min(t.box[1] for t in high)
    for (x, y), value in (((45, 25), 1.0), ((20, top / 2), 0.0), ((70, IMAGE_SIZE[1] - top / 2), 0.0)):
        scene = canvas.viewbox.mapViewToScene(QPointF(x, y))
        seen = shot.pixelColor(canvas.view.mapFromScene(scene) * shot.devicePixelRatio())
        want = canvas.color_of(value)
        for a, b in ((seen.red(), want.red()), (seen.green(), want.green()), (seen.blue(), want.blue())):
            assert abs(a - b * opacity) <= 8, ((x, y), seen.getRgb(), want.getRgb())

    canvas.set_interpolated(True)
    smooth = canvas.smooth_item.image  # (rows, cols, RGBA) over the cells' extent
    rect = canvas.smooth_item.mapRectToParent(canvas.smooth_item.boundingRect())
    assert rect_tuple(rect) == pytest.approx((0, 0, *IMAGE_SIZE))
    h, w = smooth.shape[:2]
    for (x, y), value in (((45, 25), 1.0), ((20, top / 2), 0.0)):
        px = smooth[int(y / IMAGE_SIZE[1] * h), int(x / IMAGE_SIZE[0] * w)]
        want = canvas.color_of(value)
        assert tuple(px[:3]) == (want.red(), want.green(), want.blue()) and px[3] == 255


def test_mllama_tiles_are_laid_out_by_default(canvas):
    """No single Mllama tile covers the image: the canvas opens on all tiles laid out."""
    from tests.core.test_mllama import IMAGE_SIZE, tiny_mllama_float64

    tokens = tiny_mllama_float64().adapter.visual_tokens(IMAGE_SIZE)
    canvas.set_image(np.zeros((IMAGE_SIZE[1], IMAGE_SIZE[0], 3), np.uint8))
    canvas.set_tokens(tokens)
    assert canvas.view_choice() == ALL_VIEWS and canvas.view_selector.choices() == [0, 1, 2, ALL_VIEWS]
    assert_drawn(canvas, tokens, [0, 1, 2], IMAGE_SIZE)
    assert canvas.view_selector.itemText(1) == "tile 1 (row 0, col 1): 4x4"


# The families of issue 26 (their tiny models: tests/core/test_<family>.py), opened as folders.
NEW_FAMILIES = (
    "llava_onevision", "internvl", "mistral3", "qwen3_vl", "gemma3",
    "glm4v", "aya_vision", "janus", "molmo2", "idefics2",
)  # fmt: skip


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_a_new_familys_folder_opens_in_the_window_with_each_view_selectable(qtbot, window, tmp_path, family):
    """The family's tiny model saved as a user's folder, picked in the model box, read out
    through the window: every view the selector offers is drawn exactly from the
    adapter's own geometry; a family whose visual tokens cover no patch (Idefics2's
    resampler latents) reads out with no grid drawn and says so."""
    import importlib

    from tests.core.exactness import noise_image

    module = importlib.import_module(f"tests.core.test_{family}")
    tiny = module.traced_case(module.CASES[0])[0]
    tiny.model.save_pretrained(tmp_path / family, safe_serialization=True)
    tiny.processor.save_pretrained(tmp_path / family)
    size = module.IMAGE_SIZE
    window.inputs.model_picker.setCurrentText(str(tmp_path / family))
    assert window.set_image(noise_image(size), name="noise")
    window.set_question(getattr(module, "QUESTION", None) or module.PREFIX)
    run_until_idle(qtbot, window, window.actions.run_readout)
    analysis = shown_analysis(window)
    assert analysis is not None, window.inputs.error_label.text()
    adapter = window.loaded_model().adapter
    assert adapter.family == family
    tokens = adapter.visual_tokens(size)
    canvas = window.canvas
    views = [c for c in canvas.view_selector.choices() if c != ALL_VIEWS]
    if not any(t.col >= 0 for t in tokens):  # latents: no patch, no view to draw
        assert views == [] and canvas.cells == []
        assert analysis.rollout.visual_patch_mass is None
        return
    assert views == sorted({t.image for t in tokens if t.col >= 0})
    for choice in views:
        if len(views) > 1:
            pick(canvas, choice)
        assert_drawn(canvas, tokens, [choice], size)
