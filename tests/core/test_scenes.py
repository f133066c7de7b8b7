"""The synthetic scene generator: determinism and exact ground truth."""

import numpy as np
import pytest

from core.zoo import scenes
from core.zoo.scenes import COLORS, make_sample, render_coverage


def test_same_seed_same_sample_and_splits_differ():
    a, b = make_sample("heldout", 7), make_sample("heldout", 7)
    assert np.array_equal(a.image, b.image) and a.question == b.question
    assert not np.array_equal(make_sample("train", 7).image, a.image)


@pytest.mark.parametrize("index", range(40))
def test_ground_truth_is_exact(index):
    s = make_sample("heldout", index)
    assert 1 <= len(s.objects) <= scenes.MAX_OBJECTS
    assert s.image.shape == (scenes.IMAGE_SIZE, scenes.IMAGE_SIZE, 3) and s.image.dtype == np.uint8
    assert s.answer in scenes.ANSWER_WORDS and s.foil in scenes.ANSWER_WORDS and s.answer != s.foil
    pairs = {(o.color, o.shape) for o in s.objects}
    assert len(pairs) == len(s.objects), "objects are distinct (colour, shape) pairs"
    union = np.zeros(s.image.shape[:2], int)
    for o in s.objects:
        ys, xs = np.nonzero(o.mask)
        assert o.box == [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
        assert np.array_equal(o.mask, o.coverage > 0)
        lo, hi = scenes.SIZE_RANGE
        assert lo * scenes.IMAGE_SIZE - 1e-6 <= o.size <= hi * scenes.IMAGE_SIZE + 1e-6
        union += o.mask
    assert union.max() <= 1, "objects never overlap, so every mask is exact"
    # Fully covered pixels show the object's colour (within jitter and noise).
    for o in s.objects:
        full = o.coverage >= 1.0
        if full.sum() > 4:
            mean = s.image[full].mean(axis=0)
            assert np.abs(mean - np.array(COLORS[o.color])).max() < scenes.COLOR_JITTER + 6
    _check_answer(s)


def _check_answer(s):
    """Recompute the answer from the objects alone."""
    objs = s.objects
    if s.template == "color_of_shape":
        (o,) = [o for o in objs if o.shape in s.question]
        assert s.answer == o.color
    elif s.template == "shape_of_color":
        (o,) = [o for o in objs if f" {o.color} " in s.question]
        assert s.answer == o.shape
    elif s.template == "count_all":
        assert s.answer == scenes.COUNT_WORDS[len(objs)]
    elif s.template == "count_shape":
        shape = [k for k, v in scenes.SHAPE_PLURALS.items() if v in s.question][0]
        assert s.answer == scenes.COUNT_WORDS[sum(o.shape == shape for o in objs)]
    elif s.template == "count_color":
        color = [c for c in COLORS if f" {c} " in s.question][0]
        assert s.answer == scenes.COUNT_WORDS[sum(o.color == color for o in objs)]
    elif s.template == "exist":
        present = any(f"{o.color} {o.shape}" in s.question for o in objs)
        assert s.answer == ("yes" if present else "no")
    elif s.template == "relation":
        a, b = objs[s.target], objs[s.reference]
        rel = [r for r in scenes.RELATIONS if f" {r} " in s.question][0]
        dx, dy = a.center[0] - b.center[0], a.center[1] - b.center[1]
        d = {"left of": -dx, "right of": dx, "above": -dy, "below": dy}[rel]
        assert abs(d) >= scenes.RELATION_MARGIN * scenes.IMAGE_SIZE
        assert s.answer == ("yes" if d > 0 else "no")


def test_every_kind_and_balanced_yes_no():
    samples = [make_sample("heldout", i) for i in range(400)]
    kinds = {s.kind for s in samples}
    assert kinds == set(scenes.QUESTION_KINDS)
    for kind in ("exist", "relation"):
        yes = np.mean([s.answer == "yes" for s in samples if s.kind == kind])
        assert 0.35 < yes < 0.65


def test_coverage_is_antialiased_and_area_is_right():
    cov = render_coverage("circle", 64.3, 60.7, 40.0, 0.0, 128, 4)
    assert 0 < ((cov > 0) & (cov < 1)).sum(), "edges are partially covered"
    assert abs(cov.sum() - np.pi * 20**2) / (np.pi * 20**2) < 0.02
    sq = render_coverage("square", 64, 64, 30.0, 10.0, 128, 4)
    assert abs(sq.sum() - 900) / 900 < 0.02
    tri = render_coverage("triangle", 64, 64, 30.0, -5.0, 128, 4)
    assert abs(tri.sum() - np.sqrt(3) / 4 * 900) / (np.sqrt(3) / 4 * 900) < 0.03


def test_vocabulary_lists_templates_and_palette():
    v = scenes.scene_vocabulary()
    assert v["colors"]["red"] == list(COLORS["red"])
    assert set(v["templates"]) == set(scenes.TEMPLATES)
    assert v["templates"]["relation"]["placeholders"] == ["color", "shape", "relation", "color2", "shape2"]


def test_patch_labels_mark_each_object_centre():
    s = make_sample("heldout", 3)
    color, shape, centre = scenes.patch_labels(s.objects)
    assert centre.sum() == len(s.objects)
    assert set(color[centre == 1]) == {1 + list(COLORS).index(o.color) for o in s.objects}
