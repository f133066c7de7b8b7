"""The image canvas (grid, heatmap, hover, interpolated view, painting) and the
counterfactual panel (tools, fills, run / sweep requests, result display)."""

import numpy as np
import pytest
from PIL import Image
from PySide6.QtCore import QEvent, QObject, QPoint, QPointF, Qt
from PySide6.QtGui import QMouseEvent
from PySide6.QtWidgets import QApplication

import core
from app.canvas import INTERPOLATED_TEXT, ImageCanvas, box_slices, describe_token_layout, stroke_footprint
from app.components import ModelChoice
from app.panels.counterfactual_panel import CounterfactualPanel
from app.samples import bundled_samples
from core.forward.geometry import VisualToken, resize_crop_boxes
from core.methods.counterfactual import mask_from_box, occlusion_sweep, region_counterfactual
from core.results.readout import restore_result

SAMPLE = bundled_samples()[0]


@pytest.fixture
def llava(model_cache):
    choice = ModelChoice("shapes-llava")  # the window's default: shared with the windows of this run
    if choice not in model_cache:
        model_cache[choice] = core.load_model("shapes-llava", **choice.load_options())
    return model_cache[choice]


@pytest.fixture
def sample_image():
    return core.load_image(SAMPLE.image_path)


@pytest.fixture
def panel(qtbot):
    p = CounterfactualPanel()
    qtbot.addWidget(p)
    p.resize(1280, 800)
    p.show()
    qtbot.waitExposed(p)
    return p


def grid_tokens(width=200, height=120, patch=20, extra=True) -> list[dict]:
    """A 6 x 10 patch grid over a width x height image (boxes in pixels), plus a
    newline token after each row and a CLS token (col < 0: not cells)."""
    out = []
    if extra:
        out.append({"index": 0, "position": 1, "image": 0, "row": -1, "col": -1, "box": [0, 0, width, height]})
    for r in range(height // patch):
        for c in range(width // patch):
            out.append(
                {
                    "index": len(out),
                    "image": 0,
                    "row": r,
                    "col": c,
                    "box": [c * patch, r * patch, (c + 1) * patch, (r + 1) * patch],
                }
            )
        if extra:
            out.append(
                {"index": len(out), "image": 0, "row": r, "col": -1, "box": [0, r * patch, width, (r + 1) * patch]}
            )
    return out


def viewport_pos(c: ImageCanvas, x: float, y: float) -> QPoint:
    """Where image point (x, y) is drawn in the canvas's viewport (widget pixels)."""
    scene = c.viewbox.mapViewToScene(QPointF(x, y))
    return c.view.mapFromScene(scene)


def send_mouse(c: ImageCanvas, kind, pos: QPoint, button=Qt.MouseButton.LeftButton, buttons=None) -> None:
    if buttons is None:
        buttons = Qt.MouseButton.NoButton if kind == QEvent.Type.MouseButtonRelease else button
    vp = c.view.viewport()
    event = QMouseEvent(
        kind, QPointF(pos), QPointF(vp.mapToGlobal(pos)), button, buttons, Qt.KeyboardModifier.NoModifier
    )
    QApplication.sendEvent(vp, event)


def line_pixels(p0, p1, n=600):
    """(rows, cols) of the pixels under the segment p0 -> p1 (x, y)."""
    t = np.linspace(0, 1, n)
    xs = p0[0] + t * (p1[0] - p0[0])
    ys = p0[1] + t * (p1[1] - p0[1])
    return ys.astype(int), xs.astype(int)


# ---------------------------------------------------------------- grid, hover, heatmap


def test_grid_cell_count_equals_patch_tokens(canvas, llava, sample_image):
    tokens = llava.adapter.visual_tokens(sample_image.size)
    canvas.set_image(sample_image)
    canvas.set_tokens(tokens)
    patch_tokens = [t for t in tokens if t.col >= 0]
    assert len(canvas.cells) == len(canvas.grid_item.rects) == len(patch_tokens) == 64
    assert canvas.image_item.image.shape == (sample_image.height, sample_image.width, 3)  # row-major, upright

    canvas.set_tokens(grid_tokens())  # dicts with a CLS and one newline per row
    assert len(canvas.cells) == 60 and len(canvas.grid_item.rects) == 60
    assert all(t.col >= 0 for t in canvas.cells)
    r = canvas.grid_item.rects[13]  # row 1, col 3
    assert (r.x(), r.y(), r.width(), r.height()) == (60, 20, 20, 20)


def test_grid_shows_the_whole_image_view_of_tiled_tokens(canvas):
    base = [
        VisualToken(i, None, 0, r, c, box)
        for i, (r, c, box) in enumerate(resize_crop_boxes((64, 64), 64, (64, 64), 32))
    ]
    tiles = [VisualToken(4 + i, None, 1 + i // 4, (i // 2) % 2, i % 2, [0, 0, 16, 16]) for i in range(16)]
    canvas.set_tokens(base + tiles)
    assert canvas.shown_image == 0 and len(canvas.cells) == 4
    canvas.set_tokens(base + tiles, image=None)
    assert len(canvas.cells) == 20
    note = describe_token_layout(base + tiles)
    assert "views of the image" in note
    assert describe_token_layout(base) == ""
    assert "merged 2x2 block" in describe_token_layout(base, family="qwen2_vl")
    assert "no patch of their own" in describe_token_layout(grid_tokens())


def test_hover_lookup_returns_the_token_under_a_pixel(canvas, llava, sample_image):
    tokens = llava.adapter.visual_tokens(sample_image.size)
    canvas.set_image(sample_image)
    canvas.set_tokens(tokens)
    for t in tokens:
        x0, y0, x1, y1 = t.box
        for x, y in (((x0 + x1) / 2, (y0 + y1) / 2), (x0, y0), (x1 - 0.01, y1 - 0.01)):
            hit = canvas.token_at(x, y)
            assert hit is not None and (hit.index, hit.row, hit.col) == (t.index, t.row, t.col)
    assert canvas.token_at(-3, 5) is None and canvas.token_at(5, sample_image.height + 1) is None

    canvas.set_heatmap([float(t.index) / 10 for t in tokens], label="mass")
    t = tokens[19]
    x0, y0, x1, y1 = t.box
    text = canvas.describe_point((x0 + x1) / 2, (y0 + y1) / 2)
    assert f"token {t.index}" in text and f"row {t.row}, col {t.col}" in text
    assert f"box [{x0:.1f}, {y0:.1f}, {x1:.1f}, {y1:.1f}]" in text and "mass = 1.9" in text

    # a real mouse move over the viewport updates the hover label, tooltip and highlight
    with_signal = []
    canvas.token_hovered.connect(with_signal.append)
    send_mouse(
        canvas,
        QEvent.Type.MouseMove,
        viewport_pos(canvas, (x0 + x1) / 2, (y0 + y1) / 2),
        Qt.MouseButton.NoButton,
        Qt.MouseButton.NoButton,
    )
    assert with_signal[-1] == 19
    assert canvas.hover_label.text() == text == canvas.view.toolTip()
    assert canvas.hover_item.isVisible() and canvas.hover_item.rect().topLeft() == QPointF(x0, y0)


def test_heatmap_values_land_in_the_right_cells(canvas):
    canvas.set_image(np.zeros((120, 200, 3), np.uint8))  # black: a drawn cell shows its colour x opacity
    tokens = grid_tokens()
    canvas.set_tokens(tokens)
    values = [10.0 * t["row"] + t["col"] if t["col"] >= 0 else 999.0 for t in tokens]
    canvas.set_heatmap(values, label="10 row + col")
    assert canvas.levels == (0.0, 59.0)  # col < 0 tokens carry a value but are not cells
    assert len(canvas.heatmap_item.cells) == 60
    for t, v, _ in canvas.heatmap_item.cells:
        assert v == 10 * t.row + t.col
        assert t.box == (t.col * 20, t.row * 20, (t.col + 1) * 20, (t.row + 1) * 20)

    # the same from a (rows, cols) grid, from one value per cell, and from {index: value}
    grid = np.arange(60, dtype=float).reshape(6, 10)
    canvas.set_heatmap(grid)
    assert all(v == grid[t.row, t.col] for t, v, _ in canvas.heatmap_item.cells)
    canvas.set_heatmap(grid.ravel()[::-1].copy())
    assert all(v == 59 - (10 * t.row + t.col) for t, v, _ in canvas.heatmap_item.cells)
    canvas.set_heatmap({t["index"]: 1.0 for t in tokens if t["row"] == 2 and t["col"] >= 0})
    assert sum(np.isfinite(v) for _, v, _ in canvas.heatmap_item.cells) == 10
    with pytest.raises(ValueError, match="do not fit"):
        canvas.set_heatmap(np.ones(7))

    # rendered: the colour at a cell's centre is that cell's colour-map colour (x opacity over black)
    canvas.set_heatmap(grid, label="index")
    canvas.set_grid_visible(False)
    QApplication.processEvents()
    shot = canvas.view.grab().toImage()
    opacity = canvas.heatmap_item.opacity()
    for row, col in ((0, 0), (5, 9), (2, 7), (4, 1)):
        p = viewport_pos(canvas, col * 20 + 10, row * 20 + 10)
        seen = shot.pixelColor(p * shot.devicePixelRatio())
        want = canvas.color_of(grid[row, col])
        for a, b in ((seen.red(), want.red()), (seen.green(), want.green()), (seen.blue(), want.blue())):
            assert abs(a - b * opacity) <= 8, (row, col, seen.getRgb(), want.getRgb())

    canvas.set_heatmap(np.linspace(-2, 1, 60))  # signed values: symmetric levels, diverging map
    assert canvas.levels == (-2.0, 2.0) and canvas.colorbar.isVisible()
    canvas.clear_heatmap()
    assert not canvas.colorbar.isVisible() and not canvas.heatmap_item.isVisible()


def view_contains(c: ImageCanvas, width: float, height: float, slack: float = 0.1) -> bool:
    """The view shows the whole ``width x height`` image and, along its tighter axis, little more."""
    (x0, x1), (y0, y1) = c.viewbox.viewRange()
    whole = x0 <= 0 and y0 <= 0 and x1 >= width and y1 >= height
    return whole and min((x1 - x0) / width, (y1 - y0) / height) <= 1 + slack


def test_a_new_image_is_fitted_whatever_came_before(canvas, qtbot):
    """Issue 13: a 64 px image after a 512 px one (its grid and heatmap still set) was a speck."""
    canvas.set_image(np.zeros((512, 512, 3), np.uint8))
    canvas.set_tokens(grid_tokens(512, 512, 64, extra=False))
    canvas.set_heatmap(np.arange(64.0).reshape(8, 8))
    qtbot.waitUntil(lambda: view_contains(canvas, 512, 512))
    canvas.set_image(np.zeros((64, 64, 3), np.uint8))  # tokens and heatmap of the big one are kept
    qtbot.waitUntil(lambda: view_contains(canvas, 64, 64))
    canvas.viewbox.scaleBy((0.2, 0.2))  # zoomed in: the image no longer fits
    assert not view_contains(canvas, 64, 64, slack=5)
    qtbot.mouseClick(canvas.fit_button, Qt.MouseButton.LeftButton)  # "Fit"
    assert view_contains(canvas, 64, 64)
    canvas.viewbox.scaleBy((0.2, 0.2))
    qtbot.keyClick(canvas.view, Qt.Key.Key_F)  # or F, while the canvas has the focus
    assert view_contains(canvas, 64, 64) and canvas.fit_button.toolTip().endswith("(F)")


def test_hover_and_labels_go_when_the_map_or_tokens_change(canvas):
    """Issue 13, bug 5: the hover box and line stayed after the map changed, and a
    label such as "L1.H1: per patch" stayed over an emptied map."""
    canvas.set_image(np.zeros((120, 200, 3), np.uint8))
    tokens = grid_tokens()
    prompt = canvas.hover_label.text()
    for change in (
        lambda: canvas.set_heatmap(np.ones(60)),
        canvas.clear_heatmap,
        lambda: canvas.set_tokens(tokens),
        lambda: canvas.set_image(np.zeros((120, 200, 3), np.uint8)),
    ):
        canvas.set_tokens(tokens)
        canvas.set_heatmap(np.arange(60.0), label="L1.H1: per patch")
        assert canvas.hover_at(30, 30) is not None
        assert canvas.hover_item.isVisible() and "L1.H1: per patch" in canvas.hover_label.text()
        change()
        assert not canvas.hover_item.isVisible()
        assert canvas.hover_label.text() == prompt and canvas.view.toolTip() == ""
    canvas.set_heatmap(np.arange(60.0), label="L1.H1: per patch")
    assert canvas.heatmap_title.text() == "heatmap: L1.H1: per patch" and canvas.colorbar_label()
    canvas.clear_heatmap()
    assert canvas.heatmap_title.text() == "" and canvas.colorbar_label() == ""


def test_long_heatmap_labels_are_elided_not_overlapping(canvas, qtbot):
    """The colour-bar label overlapped the tick values (the bar's axis had a fixed
    width) and ran past the bar; the title above the canvas wrapped and pushed the image down."""
    from PySide6.QtGui import QFontMetricsF

    long = "rollout (alpha 0.5): structural-flow approximation, not a cause; " * 3
    canvas.set_image(np.zeros((120, 200, 3), np.uint8))
    canvas.set_tokens(grid_tokens())
    title_height = canvas.heatmap_title.height()
    canvas.set_heatmap(np.arange(60.0) / 1000, label=long)
    canvas.view.grab()  # paint: the axis measures its tick labels
    QApplication.processEvents()
    axis = canvas.colorbar.axis
    shown = canvas.colorbar_label()
    assert shown.endswith("…") and long.startswith(shown[:-1])
    assert QFontMetricsF(axis.label.font()).horizontalAdvance(shown) <= canvas.colorbar.geometry().height()
    assert axis.width() >= axis.textWidth + axis.label.boundingRect().height()  # room for ticks and label
    assert canvas.colorbar.toolTip() == long
    title = canvas.heatmap_title
    assert title.text() == f"heatmap: {long}" and title.toolTip() == title.text()
    assert title.fontMetrics().horizontalAdvance(title.shown_text()) <= title.contentsRect().width()
    assert title.height() == title_height  # one line, whatever the label


def test_interpolated_label_visible_iff_toggled(canvas, qtbot):
    canvas.set_image(np.full((120, 200, 3), 90, np.uint8))
    canvas.set_tokens(grid_tokens())
    canvas.set_heatmap(np.arange(60.0).reshape(6, 10))
    assert not canvas.interpolated_label.isVisible() and canvas.heatmap_item.isVisible()

    qtbot.mouseClick(canvas.interpolated_check, Qt.MouseButton.LeftButton)
    assert canvas.is_interpolated()
    label = canvas.interpolated_label
    assert label.isVisible() and label.text() == INTERPOLATED_TEXT
    assert label.text() == "interpolated: visual smoothing, not a causal pixel mask"
    assert canvas.view.rect().contains(label.geometry())  # on the canvas, inside the view
    assert canvas.smooth_item.isVisible() and not canvas.heatmap_item.isVisible()
    smooth = canvas.smooth_item.image
    assert smooth.shape[0] > 6 and smooth.shape[1] > 10  # upsampled, not the 6 x 10 grid
    rect = canvas.smooth_item.mapRectToParent(canvas.smooth_item.boundingRect())
    assert (rect.x(), rect.y(), rect.width(), rect.height()) == (0, 0, 200, 120)

    canvas.set_heatmap(np.ones((6, 10)))  # new data keeps the mode, and the label
    assert label.isVisible()
    canvas.set_interpolated(False)
    assert not label.isVisible() and not canvas.interpolated_check.isChecked()
    assert canvas.heatmap_item.isVisible() and not canvas.smooth_item.isVisible()


def test_token_note(canvas):
    assert not canvas.note_label.isVisible()
    canvas.set_token_note("each visual token is a merged 2x2 block of patches")
    assert canvas.note_label.isVisible() and "merged" in canvas.token_note()
    canvas.set_token_note("")
    assert not canvas.note_label.isVisible()


# ---------------------------------------------------------------- painting


def test_fast_stroke_paints_a_continuous_line(canvas):
    canvas.set_image(np.zeros((400, 400, 3), np.uint8))
    canvas.set_mode("brush")
    canvas.set_brush_size(4)
    a, b = (50.0, 60.0), (290.0, 240.0)  # two mouse events 300 px apart
    canvas.begin_stroke(*a)
    canvas.stroke_to(*b)
    canvas.end_stroke()
    m = canvas.mask()
    rows, cols = line_pixels(a, b)
    assert m[rows, cols].all()
    assert m[:, 51:290].any(axis=0).all() and m[61:240].any(axis=1).all()  # no gap in any column or row
    assert not m[300:].any() and m.sum() < 4 * 300 * 1.3  # a line 4 px wide, not a blob

    # the same through real mouse events on the viewport: press, one far move, release
    canvas.clear_mask()
    send_mouse(canvas, QEvent.Type.MouseButtonPress, viewport_pos(canvas, *a))
    send_mouse(canvas, QEvent.Type.MouseMove, viewport_pos(canvas, *b))
    send_mouse(canvas, QEvent.Type.MouseButtonRelease, viewport_pos(canvas, *b))
    m2 = canvas.mask()
    assert m2[rows, cols].all()
    assert canvas.undo_stack.count() == 3  # the first stroke, the clear, the mouse stroke


def test_stroke_footprint_geometry():
    pieces = stroke_footprint((10.5, 10.5), (10.5, 10.5), 5, (30, 30))
    m = np.zeros((30, 30), bool)
    for (y0, y1, x0, x1), hit in pieces:
        m[y0:y1, x0:x1] |= hit
    ys, xs = np.nonzero(m)
    assert m[10, 10] and ((xs + 0.5 - 10.5) ** 2 + (ys + 0.5 - 10.5) ** 2 <= 2.5**2 + 1e-9).all()
    assert stroke_footprint((-50, -50), (-40, -40), 4, (30, 30)) == []  # off the image
    one = stroke_footprint((3.0, 3.0), (3.0, 3.0), 1, (10, 10))  # a 1 px brush on a pixel corner still paints
    assert sum(int(h.sum()) for _, h in one) == 4


def test_one_stroke_is_one_undo_step_and_undo_redo_restore_exactly(canvas):
    canvas.set_image(np.zeros((200, 300, 3), np.uint8))
    changes = []
    canvas.mask_changed.connect(changes.append)
    canvas.set_mode("brush")
    canvas.set_brush_size(9)
    canvas.begin_stroke(20, 20)
    for i in range(1, 40):
        canvas.stroke_to(20 + 6 * i, 20 + 3 * i)
    canvas.end_stroke()
    assert canvas.undo_stack.count() == 1
    assert len(changes) == 1 and np.array_equal(changes[0], canvas.mask())  # once per stroke, not per move
    states = [np.zeros((200, 300), bool), canvas.mask()]

    canvas.set_mode("eraser")
    canvas.begin_stroke(100, 0)
    canvas.stroke_to(100, 199)
    canvas.end_stroke()
    states.append(canvas.mask())
    canvas.set_mode("box")
    canvas.paint_box(200, 150, 260, 190)
    states.append(canvas.mask())
    canvas.clear_mask()
    states.append(canvas.mask())
    assert canvas.undo_stack.count() == 4 and not states[-1].any()
    assert all(not np.array_equal(a, b) for a, b in zip(states, states[1:]))

    for want in reversed(states[:-1]):
        canvas.undo()
        assert np.array_equal(canvas.mask(), want)
        assert np.array_equal(changes[-1], want)
    assert not canvas.undo_stack.canUndo()
    for want in states[1:]:
        canvas.redo()
        assert np.array_equal(canvas.mask(), want)
    # the overlay shows exactly the mask
    assert np.array_equal(canvas.painter.overlay.overlay_pixels()[..., 3] > 0, canvas.painter.mask)
    canvas.undo()
    canvas.undo()
    assert np.array_equal(canvas.painter.overlay.overlay_pixels()[..., 3] > 0, states[2])


def test_box_tool(canvas):
    canvas.set_image(np.zeros((100, 160, 3), np.uint8))
    canvas.set_mode("box")
    canvas.paint_box(50.5, 60.1, 10.2, 20.7)  # corners in any order
    want = mask_from_box((160, 100), [10.2, 20.7, 50.5, 60.1])
    assert np.array_equal(canvas.mask(), want) and want.sum() == 40 * 39  # columns 10..49, rows 21..59 (pixel centres)
    assert box_slices(0, 0, 0.4, 10, (100, 160)) is None
    assert canvas.undo_stack.count() == 1

    canvas.clear_mask()
    start, end = viewport_pos(canvas, 30, 10), viewport_pos(canvas, 90, 70)
    send_mouse(canvas, QEvent.Type.MouseButtonPress, start)
    send_mouse(canvas, QEvent.Type.MouseMove, end)
    send_mouse(canvas, QEvent.Type.MouseButtonRelease, end)
    ys, xs = np.nonzero(canvas.mask())
    assert (
        len(xs)
        and abs(xs.min() - 30) <= 2
        and abs(xs.max() - 89) <= 2
        and abs(ys.min() - 10) <= 2
        and abs(ys.max() - 69) <= 2
    )
    assert canvas.mask()[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1].all()  # a filled rectangle
    assert not canvas.box_item.isVisible()


def test_eraser(canvas):
    canvas.set_image(np.zeros((100, 100, 3), np.uint8))
    canvas.paint_box(0, 0, 100, 100)
    canvas.set_mode("eraser")
    canvas.set_brush_size(10)
    canvas.begin_stroke(0, 50.5)
    canvas.stroke_to(100, 50.5)
    canvas.end_stroke()
    m = canvas.mask()
    assert not m[46:55].any()  # a 10 px band cleared
    assert m[:45].all() and m[56:].all()  # the rest untouched
    canvas.undo()
    assert canvas.mask().all()


def test_pan_mode_does_not_paint(canvas):
    canvas.set_image(np.zeros((100, 100, 3), np.uint8))
    canvas.set_mode("view")
    send_mouse(canvas, QEvent.Type.MouseButtonPress, viewport_pos(canvas, 20, 20))
    send_mouse(canvas, QEvent.Type.MouseMove, viewport_pos(canvas, 80, 80))
    send_mouse(canvas, QEvent.Type.MouseButtonRelease, viewport_pos(canvas, 80, 80))
    assert not canvas.mask().any() and canvas.undo_stack.count() == 0


def test_a_brush_move_on_1024_repaints_only_its_dirty_rectangle(canvas):
    """A brush move on a 1024 x 1024 image repaints only its dirty rectangle
    (what keeps painting smooth at any image size). Its cost against the frame
    budget is measured in bench/app_latency.py, not here (timed asserts on a
    shared machine are flaky)."""
    canvas.set_image(np.random.default_rng(0).integers(0, 255, (1024, 1024, 3), dtype=np.uint8))
    canvas.set_tokens(grid_tokens(1024, 1024, 32, extra=False))
    canvas.set_heatmap(np.random.default_rng(1).random(1024))
    canvas.set_mode("brush")
    canvas.set_brush_size(40)
    QApplication.processEvents()
    painted = []

    class PaintSpy(QObject):
        def eventFilter(self, obj, event):
            if event.type() == QEvent.Type.Paint:
                painted.append(event.rect())
            return False

    spy = PaintSpy()
    canvas.view.viewport().installEventFilter(spy)
    canvas.begin_stroke(40, 40)
    for i in range(1, 120):
        canvas.stroke_to(40 + 7 * i, 40 + 5 * i)  # a brisk drag: 8.6 image px per event
        QApplication.processEvents()  # the dirty-rect repaint
    canvas.end_stroke()
    canvas.view.viewport().removeEventFilter(spy)
    viewport_area = canvas.view.viewport().width() * canvas.view.viewport().height()
    assert len(painted) >= 100  # each move repainted ...
    assert np.median([r.width() * r.height() for r in painted]) < 0.05 * viewport_area  # ... only its dirty rectangle
    assert canvas.mask().sum() > 0


# ---------------------------------------------------------------- the counterfactual panel


def paint_blue_square(panel) -> None:
    panel.set_brush_size(12)
    c = panel.canvas
    c.set_mode("brush")
    c.begin_stroke(38, 28)
    for x, y in ((66, 30), (62, 55), (36, 52), (50, 40)):
        c.stroke_to(x, y)
    c.end_stroke()


def test_panel_tools_drive_the_canvas(panel, qtbot, sample_image):
    panel.set_image(sample_image)
    assert panel.canvas.mode() == "brush" and panel.tool_buttons["brush"].isChecked()
    qtbot.mouseClick(panel.tool_buttons["eraser"], Qt.MouseButton.LeftButton)
    assert panel.canvas.mode() == "eraser"
    qtbot.mouseClick(panel.tool_buttons["box"], Qt.MouseButton.LeftButton)
    assert panel.canvas.mode() == "box"
    panel.size_slider.setValue(37)
    assert panel.canvas.brush_size() == 37 and panel.size_label.text() == "size 37 px"
    assert not panel.undo_button.isEnabled()
    panel.canvas.paint_box(10, 10, 40, 40)
    assert panel.undo_button.isEnabled() and not panel.redo_button.isEnabled()
    assert panel.region_label.text().startswith("region: 900 px")
    qtbot.mouseClick(panel.undo_button, Qt.MouseButton.LeftButton)
    assert not panel.mask().any() and panel.redo_button.isEnabled()
    qtbot.mouseClick(panel.redo_button, Qt.MouseButton.LeftButton)
    assert panel.mask().sum() == 900
    qtbot.mouseClick(panel.clear_button, Qt.MouseButton.LeftButton)
    assert not panel.mask().any()


def test_run_requested_carries_the_mask_and_fill(panel, qtbot, sample_image):
    panel.set_image(sample_image)
    runs = []
    panel.run_requested.connect(lambda m, f, o: runs.append((m, f, o)))
    assert not panel.request_run() and runs == []  # nothing painted yet
    assert "paint a region" in panel.message_label.text()

    paint_blue_square(panel)
    panel.set_fill("constant", color=(10, 20, 30))
    with qtbot.waitSignal(panel.run_requested) as blocker:
        qtbot.mouseClick(panel.run_button, Qt.MouseButton.LeftButton)
    mask, fill, options = blocker.args
    assert mask.shape == (sample_image.height, sample_image.width) and mask.dtype == bool
    assert np.array_equal(mask, panel.mask()) and mask.sum() > 500
    assert fill == "constant" and options == {"color": (10, 20, 30)}

    panel.set_fill("blur", radius=2.5)
    assert panel.request_run() and runs[-1][1:] == ("blur", {"radius": 2.5})
    panel.set_fill("noise", seed=7)
    assert panel.request_run() and runs[-1][1:] == ("noise", {"seed": 7})
    for kind in ("mean", "inpaint"):
        panel.set_fill(kind)
        assert panel.request_run() and runs[-1][1:] == (kind, {})
    panel.set_fill("paste")
    n = len(runs)
    assert not panel.request_run() and len(runs) == n  # no source image chosen
    panel.set_fill("paste", paste_from=bundled_samples()[1].image_path)
    assert panel.request_run() and runs[-1][1:] == ("paste", {"paste_from": str(bundled_samples()[1].image_path)})

    with qtbot.waitSignal(panel.sweep_requested) as blocker:
        panel.sweep_k.setValue(2)
        qtbot.mouseClick(panel.sweep_button, Qt.MouseButton.LeftButton)
    assert blocker.args == [2]


def test_set_result_shows_the_numbers(panel, llava, sample_image):
    panel.set_image(sample_image)
    panel.set_tokens(llava.adapter.visual_tokens(sample_image.size))
    paint_blue_square(panel)
    runs = []
    panel.run_requested.connect(lambda m, f, o: runs.append((m, f, o)))
    panel.request_run()
    mask, fill, options = runs[0]
    result = region_counterfactual(llava, sample_image, SAMPLE.question, mask, fill, foil="triangle", **options)
    panel.set_result(result)

    d = result.to_dict()
    o, e, eff = d["original"], d["edited"], d["effect"]
    table = panel.answer_table
    assert [table.item(0, c).text() for c in range(3)] == [
        o["predicted"],
        e["predicted"],
        "flipped" if eff["flipped"] else "same",
    ]
    assert [table.item(1, c).text() for c in range(3)] == [
        f"{o['prob']:.4f}",
        f"{e['prob']:.4f}",
        f"{eff['prob_change']:+.4f}",
    ]
    assert [table.item(3, c).text() for c in range(3)] == [
        f"{o['logit_diff']:.4f}",
        f"{e['logit_diff']:.4f}",
        f"{eff['logit_diff_change']:+.4f}",
    ]
    assert panel.tokens_label.text() == f"answer {o['answer']!r} vs foil 'triangle'"
    assert ("flipped" in panel.flip_label.text()) and (panel.flip_label.text().startswith("not") != eff["flipped"])
    heads = sorted(d["routing"]["attention_mass"], key=lambda h: -h["mass"])[:5]
    assert panel.heads_table.rowCount() == 5
    assert [panel.heads_table.item(r, 0).text() for r in range(5)] == [f"L{h['layer']}.H{h['head']}" for h in heads]
    assert [panel.heads_table.item(r, 2).text() for r in range(5)] == [f"{h['mass']:.4f}" for h in heads]
    assert panel.rollout_value.text().startswith(f"{d['routing']['rollout_mass']:.4f}")
    assert panel.dla_value.text().startswith(f"{d['routing']['dla_through_region']:+.4f}")
    assert np.array_equal(panel.edited_view.image, result.edited_image)
    assert f"region {int(mask.sum())} px" in panel.fill_summary.text()
    panel.top_k.setValue(3)
    assert panel.heads_table.rowCount() == 3

    # the CLI JSON (a plain dict, no routing, no edited image)
    canned = {**d, "routing": None}
    panel.set_result(restore_result("counterfactual", canned))
    assert panel.heads_table.rowCount() == 0 and panel.rollout_value.text() == "—"
    assert "not computed" in panel.heads_title.text() and panel.edited_view.image is None
    assert table.item(1, 0).text() == f"{o['prob']:.4f}"


def test_set_sweep_shows_the_map_on_the_patch_grid(panel, llava, sample_image):
    panel.set_image(sample_image)
    panel.set_tokens(llava.adapter.visual_tokens(sample_image.size))
    sweep = occlusion_sweep(llava, sample_image, SAMPLE.question, k=2, foil="triangle")
    panel.set_sweep(sweep)
    sc = panel.sweep_canvas
    assert len(sc.cells) == 16  # 8 x 8 patches in 2 x 2 cells
    eff = sweep.effect
    for t, v, _ in sc.heatmap_item.cells:
        assert v == pytest.approx(eff[t.row, t.col])
    worst = np.unravel_index(np.argmin(eff), eff.shape)
    assert f"at cell [{worst[0]}, {worst[1]}]" in panel.sweep_summary.text()
    assert "k = 2" in panel.sweep_title.text() and sc.heatmap_label == "logit diff change"

    # a bare (rows, cols) map on the panel's tokens (k = 1)
    grid = np.arange(64.0).reshape(8, 8)
    panel.set_sweep(grid)
    assert len(sc.cells) == 64
    assert all(v == grid[t.row, t.col] for t, v, _ in sc.heatmap_item.cells)


def test_panel_screenshot_renders(panel, llava, sample_image, tmp_path):
    panel.set_image(Image.open(SAMPLE.image_path))
    panel.set_tokens(llava.adapter.visual_tokens(sample_image.size))
    paint_blue_square(panel)
    QApplication.processEvents()
    path = tmp_path / "panel.png"
    assert panel.grab().save(str(path))
    shot = Image.open(path)
    assert shot.size[0] >= 1280 and shot.size[1] >= 800


def test_controls_sit_beside_the_painter_in_a_short_tab(panel, qtbot, sample_image):
    """Issue 13, item 8: at 1280 x 800 the tab is about 1250 x 560; Fill, Run and the sweep sit
    in a column beside the canvas, and so do the window's intervention buttons (add_controls)."""
    from PySide6.QtWidgets import QPushButton

    panel.set_image(sample_image)
    ablate = QPushButton("Ablate selected head")
    panel.add_controls(ablate)
    panel.resize(1250, 560)
    qtbot.waitUntil(lambda: panel.height() == 560)
    QApplication.processEvents()
    canvas_right = panel.canvas.mapTo(panel, QPoint(panel.canvas.width(), 0)).x()
    for widget in (panel.fill_combo, panel.run_button, panel.sweep_k, panel.sweep_button, ablate):
        top_left = widget.mapTo(panel, QPoint(0, 0))
        assert widget.isVisible() and top_left.x() >= canvas_right  # beside the painter, not under it
        assert top_left.y() + widget.height() <= panel.height()
    assert panel.canvas.view.height() >= 400  # the painter keeps the height
