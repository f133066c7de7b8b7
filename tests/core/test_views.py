"""core.views on each family's own geometry: the views' tokens, grids and the
regions they cover, checked against the processors' arithmetic worked out here
(resize, crop, pad, tiling), not against the adapters' boxes."""

import numpy as np
import pytest
import torch

import core
from core.forward.geometry import VisualToken
from core.methods.patterns import patch_grids
from core.views import covered_area, disjoint, family_view_names, image_views, overlay_order, patch_values


@pytest.fixture(scope="module")
def llava():
    return core.load_model("shapes-llava")


@pytest.fixture(scope="module")
def llava_next():
    from tests.core.test_llava_next import tiny_llava_next_float64

    return tiny_llava_next_float64()


def assert_boxes_equal(got, want):
    assert np.asarray(got) == pytest.approx(np.asarray(want, dtype=float), abs=1e-9)


@pytest.mark.parametrize(
    "size, region",
    [
        # shortest edge 128, 128 x 128 centre crop: a 300 x 200 image is resized to 192 x 128 and
        # loses 32 px a side, 32 * 300/192 = 50 original pixels
        ((300, 200), (50, 0, 250, 200)),
        ((200, 300), (0, 50, 200, 250)),
        ((128, 128), (0, 0, 128, 128)),
    ],
)
def test_llava_centre_crop_is_the_one_view_region(llava, size, region):
    tokens = llava.adapter.visual_tokens(size)
    (view,) = image_views(tokens, size, family_view_names(llava.adapter, size))
    assert view.name == "image" and view.grid == (8, 8) and view.items == tuple(range(64))
    assert_boxes_equal(view.region, region)
    assert family_view_names(llava.adapter, size) == {}  # LLaVA-1.5 has one view: the geometry names it


def test_llava_next_base_and_high_res_views(llava_next):
    from tests.core.test_llava_next import IMAGE_SIZE, PATCH

    a = llava_next.adapter
    tokens = a.visual_tokens(IMAGE_SIZE)
    base, high = image_views(tokens, IMAGE_SIZE, family_view_names(a, IMAGE_SIZE))
    assert (base.name, high.name) == ("base", "high-res (2x2 tiles)")
    assert base.title == "base: 4x4" and high.grid == (4, 8)
    assert base.items == tuple(range(16))
    # the newline token after each high-res row (col = -1) is in no view
    assert high.items == tuple(16 + r * 9 + c for r in range(4) for c in range(8))
    assert all(tokens[i].image == 1 and tokens[i].col >= 0 for i in high.items)
    assert_boxes_equal(base.region, (0, 0, 90, 50))
    # 90 x 50 on a 64 x 64 canvas: resized to 64 x 36 with 14 px of padding above; unpad_image keeps
    # feature rows 2..5 (canvas y 16..48), so the top and bottom 2 canvas px reach the base view only
    w, h, top = IMAGE_SIZE[0], IMAGE_SIZE[1], 14
    y0, y1 = (2 * PATCH - top) * h / 36, (6 * PATCH - top) * h / 36
    assert_boxes_equal(high.region, (0, y0, w, y1))
    assert high.region[1] > 0 and high.region[3] < h  # narrower than the image
    assert [v.image for v in overlay_order([base, high])] == [1, 0]  # the high-res view is the finer
    # without the family's names both span the image: no tiles, no global
    assert [v.name for v in image_views(tokens, IMAGE_SIZE)] == ["image 0", "image 1"]


def test_idefics3_tiles_and_global_view():
    from tests.core.test_idefics3 import GRID, IMAGE_SIZE, TILE, tiny_model_float64

    a = tiny_model_float64().adapter
    tokens = a.visual_tokens(IMAGE_SIZE)
    views = image_views(tokens, IMAGE_SIZE, family_view_names(a, IMAGE_SIZE))
    # 100 x 60 is cut as 96 x 64 (2 x 3 tiles of 32 px), then the global 32 x 32 image
    sx, sy = IMAGE_SIZE[0] / (3 * TILE), IMAGE_SIZE[1] / (2 * TILE)
    assert [v.image for v in views] == list(range(7))
    for k, v in enumerate(views[:6]):
        r, c = divmod(k, 3)
        assert v.name == f"tile {k} (row {r}, col {c})" and v.grid == (GRID, GRID)
        assert v.items == tuple(range(k * GRID * GRID, (k + 1) * GRID * GRID))
        assert_boxes_equal(v.region, (c * TILE * sx, r * TILE * sy, (c + 1) * TILE * sx, (r + 1) * TILE * sy))
    assert views[6].name == "global"
    assert_boxes_equal(views[6].region, (0, 0, *IMAGE_SIZE))
    assert disjoint([v.region for v in views[:6]], 1e-6) and not disjoint([v.region for v in views], 1e-6)
    assert covered_area([v.region for v in views[:6]]) == pytest.approx(IMAGE_SIZE[0] * IMAGE_SIZE[1])
    assert [v.image for v in overlay_order(views)][-1] == 6  # the global view is the coarsest


def test_mllama_tiles_clip_to_the_image():
    from tests.core.test_mllama import IMAGE_SIZE, MAX_TILES, TILE, tiny_mllama_float64

    a = tiny_mllama_float64().adapter
    tokens = a.visual_tokens(IMAGE_SIZE)
    views = image_views(tokens, IMAGE_SIZE)
    # 140 x 50 on a 1 x 3 canvas of 32 px tiles (96 x 32): scaled by min(96/140, 32/50) = 0.64 to 89.6,
    # floored to 89 x 32, padded on the right; the 4th tile is padding (no patches)
    assert len(views) == 3 < MAX_TILES
    s = IMAGE_SIZE[0] / 89
    for c, v in enumerate(views):
        assert v.name == f"tile {c} (row 0, col {c})" and v.grid == (4, 4)
        assert all(tokens[i].image == c and tokens[i].col >= 0 for i in v.items) and len(v.items) == 16
        assert_boxes_equal(v.region, (c * TILE * s, 0, min((c + 1) * TILE * s, 140), 50))
    assert views[2].extent[2] == pytest.approx(3 * TILE * s) and 3 * TILE * s > 140  # past the edge: padding


def test_qwen2_vl_one_image_and_several():
    from tests.core.test_qwen2_vl import IMAGE_SIZE, tiny_qwen_float64

    a = tiny_qwen_float64().adapter
    tokens = a.visual_tokens(IMAGE_SIZE)
    (view,) = image_views(tokens, IMAGE_SIZE, family_view_names(a, IMAGE_SIZE))
    assert view.name == "image" and view.grid == (3, 4) and len(view.items) == 12
    assert_boxes_equal(view.region, (0, 0, *IMAGE_SIZE))
    # The engine feeds one image per prompt; two images' tokens (as a several-image prompt gives
    # them) are two views over the whole image, named by their index.
    two = tokens + [VisualToken(12 + t.index, None, 1, t.row, t.col, t.box) for t in tokens]
    views = image_views(two, IMAGE_SIZE)
    assert [(v.name, v.items) for v in views] == [("image 0", tuple(range(12))), ("image 1", tuple(range(12, 24)))]


def test_patch_values_read_back_every_views_grid(llava_next):
    """patch_values inverts core.methods.patterns.patch_grids (the read-outs' writer)."""
    from tests.core.test_llava_next import IMAGE_SIZE

    tokens = llava_next.adapter.visual_tokens(IMAGE_SIZE)
    values = torch.arange(1.0, len(tokens) + 1, dtype=torch.float64)
    grids = patch_grids(values, tokens)
    by_image = [{"image": im, "grid": g.tolist()} for im, g in grids]
    got = patch_values(tokens, grids[0][1].tolist(), by_image)
    patch = np.array([t.col >= 0 for t in tokens])
    assert np.array_equal(got[patch], values.numpy()[patch]) and np.isnan(got[~patch]).all()
    # only the primary grid: the other view's tokens get no value
    from core.methods.patterns import primary_image

    primary = primary_image(tokens)
    alone = patch_values(tokens, dict(grids)[primary].tolist())
    on_primary = np.array([t.col >= 0 and t.image == primary for t in tokens])
    assert np.array_equal(alone[on_primary], values.numpy()[on_primary]) and np.isnan(alone[~on_primary]).all()


def test_covered_area_and_disjoint_match_pixel_counts():
    rng = np.random.default_rng(0)
    for _ in range(20):
        boxes = []
        for _ in range(int(rng.integers(1, 6))):
            x0, y0 = rng.integers(0, 30, 2)
            w, h = rng.integers(1, 15, 2)
            boxes.append((float(x0), float(y0), float(x0 + w), float(y0 + h)))
        canvas = np.zeros((50, 50), dtype=bool)
        counts = np.zeros((50, 50), dtype=int)
        for x0, y0, x1, y1 in boxes:
            canvas[int(y0) : int(y1), int(x0) : int(x1)] = True
            counts[int(y0) : int(y1), int(x0) : int(x1)] += 1
        assert covered_area(boxes) == canvas.sum()
        assert disjoint(boxes) == (counts.max() <= 1)
