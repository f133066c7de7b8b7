"""The validation chain on the shape scenes of :mod:`core.zoo.scenes`, whose
ground-truth object masks make each step checkable: the filtered samples and
their input condition (:func:`scene_samples`), step 4's counterfactual scenes
(:func:`swap_attribute`), and the context of the attribute chain
(:func:`attribute_context`) that :mod:`core.methods.validation` runs its steps on.
"""

from __future__ import annotations

import numpy as np

from core.forward.geometry import region_tokens
from core.methods.validation.chain import InputCondition, LabelError
from core.methods.validation.context import ChainContext
from core.methods.validation.observations import _image, _tokens
from core.methods.validation.samples import SwapScene
from core.methods.validation.setting import ATTRIBUTE_TEMPLATES, REGION_MIN_COVER, SIDE_KINDS
from core.zoo import scenes


def scene_samples(
    loaded,
    split: str,
    n: int,
    kind: str = "attribute",
    *,
    min_distractors: int = 1,
    start: int = 0,
    max_tries: int | None = None,
    templates: tuple[str, ...] = (),
    target_tokens: bool = True,
) -> tuple[list, InputCondition]:
    """The first ``n`` samples of ``split`` (from index ``start``) of question
    ``kind`` that pass the filters, and their :class:`InputCondition`.

    For ``kind="attribute"`` a sample must have at least ``min_distractors``
    distractors and (``target_tokens``) a target covering at least one visual token
    (region cover >= 0.25 of the token's box); other kinds are taken as drawn.
    ``templates``: only questions of these templates (empty: every one).
    """

    out, indices, skipped = [], [], 0
    limit = max_tries or 20 * n + 100
    i = start
    toks = None
    while len(out) < n and i < start + limit:
        s = scenes.make_sample(split, i, kind=kind)
        i += 1
        if templates and s.template not in templates:
            skipped += 1
            continue
        if kind == "attribute":
            if len(s.distractors) < min_distractors:
                skipped += 1
                continue
            if target_tokens and toks is None:
                inp = loaded.adapter.prepare([_image(s)], [s.question])
                toks = _tokens(
                    loaded, (s.image.shape[1], s.image.shape[0]), loaded.adapter.visual_positions(inp)[0].tolist()
                )
            if target_tokens and not region_tokens(toks, s.objects[s.target].mask, REGION_MIN_COVER):
                skipped += 1
                continue
        out.append(s)
        indices.append(s.index)
    if not out:
        raise LabelError(f"no {kind} sample of split {split!r} passes the filters")
    filters = {"min_distractors": min_distractors}
    if target_tokens:
        filters.update(target_tokens_min=1, region_min_cover=REGION_MIN_COVER)
    cond = InputCondition(
        "core.zoo.scenes",
        split,
        len(out),
        (kind,),
        tuple(sorted({s.template for s in out})),
        filters if kind == "attribute" else {},
        {"split_seed": scenes.SPLIT_SEEDS[split], "indices": indices, "skipped": skipped},
    )
    return out, cond


def _background_plane(image: np.ndarray, ink: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel ``a + b x + c y`` fitted to the pixels no object touches,
    evaluated everywhere ``(H, W, 3)``, and the residual noise sigma ``(3,)``."""
    h, w = ink.shape
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    X = np.stack([np.ones(h * w), xx.ravel(), yy.ravel()], 1)
    keep = ~ink.ravel()
    img = image.reshape(-1, 3).astype(np.float64)
    coef, *_ = np.linalg.lstsq(X[keep], img[keep], rcond=None)
    plane = X @ coef
    sigma = (img[keep] - plane[keep]).std(0)
    return plane.reshape(h, w, 3), sigma


def _ink_rgb(image: np.ndarray, obj) -> np.ndarray:
    """The object's colour as drawn: median over its fully covered pixels."""
    full = obj.coverage >= 0.99
    if full.sum() < 4:
        full = obj.coverage >= 0.5
    return np.median(image[full].astype(np.float64), axis=0)


def swap_attribute(sample, seed: int = 0) -> SwapScene | None:
    """Move the asked attribute onto a distractor: for "what color is the
    {shape}?" the two objects swap shapes, for "what shape is the {color}
    object?" they swap colours; everything else (positions, sizes, rotations,
    the other attribute, the other objects, the question) stays, and the
    answer becomes the partner's attribute (the old answer is the foil). The
    two objects are erased with a background plane fitted to the uncovered
    pixels (plus noise of the measured sigma) and redrawn. None when no
    distractor admits a valid swap (same answered attribute, a duplicate
    (colour, shape) pair, an overlap or the image edge)."""
    if sample.template not in ATTRIBUTE_TEMPLATES or sample.target is None:
        return None
    objs = sample.objects
    t = objs[sample.target]
    size = sample.image.shape[0]
    ink = np.zeros(sample.image.shape[:2], dtype=bool)
    for o in objs:
        ink |= o.mask
    for p in sample.distractors:
        q = objs[p]
        if sample.template == "color_of_shape":  # the asked shape moves: swap shapes
            new_a, new_b = (t.color, q.shape), (q.color, t.shape)
            answer, foil = q.color, t.color
            rgb_a, rgb_b = _ink_rgb(sample.image, t), _ink_rgb(sample.image, q)
        else:  # the asked colour moves: swap colours
            new_a, new_b = (q.color, t.shape), (t.color, q.shape)
            answer, foil = q.shape, t.shape
            rgb_a, rgb_b = _ink_rgb(sample.image, q), _ink_rgb(sample.image, t)
        if answer == foil:  # the partner shares the answered attribute: the answer would not change
            continue
        others = [o for k, o in enumerate(objs) if k not in (sample.target, p)]
        if any((o.color, o.shape) in (new_a, new_b) for o in others):
            continue
        covs = []
        for (_, shape), o in ((new_a, t), (new_b, q)):
            rad = scenes.circumradius(shape, o.size) + 1
            cx, cy = o.center
            if cx - rad < 0 or cy - rad < 0 or cx + rad > size or cy + rad > size:
                covs = None
                break
            covs.append(scenes.render_coverage(shape, cx, cy, o.size, o.rotation_deg, size, 4))
        if covs is None:
            continue
        other_ink = np.zeros_like(ink)
        for o in others:
            other_ink |= o.mask
        ca, cb = covs[0] > 0, covs[1] > 0
        if (ca & cb).any() or ((ca | cb) & other_ink).any():
            continue
        rng = np.random.default_rng([seed, sample.index, p])
        plane, sigma = _background_plane(sample.image, ink)
        img = sample.image.astype(np.float64)
        erase = t.mask | q.mask
        img[erase] = plane[erase] + rng.normal(0, 1, (int(erase.sum()), 3)) * sigma
        for cov, rgb in ((covs[0], rgb_a), (covs[1], rgb_b)):
            img = img * (1 - cov[:, :, None]) + rgb[None, None, :] * cov[:, :, None]
            drawn = cov > 0
            img[drawn] += rng.normal(0, 1, (int(drawn.sum()), 3)) * sigma
        out = np.clip(np.rint(img), 0, 255).astype(np.uint8)
        return SwapScene(out, p, answer, foil, t.mask | ca, q.mask | cb)
    return None


def attribute_context(
    loaded,
    *,
    n_search: int = 150,
    n_eval: int = 150,
    n_side: int = 50,
    search_split: str = "val",
    eval_split: str = "heldout",
    seed: int = 0,
    batch_size: int = 32,
    progress=None,
    cancel=None,
) -> ChainContext:
    """The synthetic setting: attribute questions with at least one distractor,
    candidates found on ``search_split`` and evaluated on ``eval_split``;
    ``n_side`` samples of each other question kind for step 7."""
    search, s_cond = scene_samples(loaded, search_split, n_search)
    ev, e_cond = scene_samples(loaded, eval_split, n_eval)
    side = {k: scene_samples(loaded, eval_split, n_side, k)[0] for k in SIDE_KINDS} if n_side else {}
    ref = {k: scene_samples(loaded, search_split, n_side, k)[0] for k in SIDE_KINDS} if n_side else {}
    return ChainContext(
        loaded,
        search,
        s_cond,
        ev,
        e_cond,
        side_samples=side,
        side_reference=ref,
        swap=swap_attribute,
        seed=seed,
        batch_size=batch_size,
        progress=progress,
        cancel=cancel,
    )


def scene_of_row(row: dict, image: np.ndarray, masks: list, target: int, question: str, answer: str, foil: str):
    """A dataset line of the shape scenes (its ``objects`` with colour, shape,
    centre, size and rotation, as :mod:`core.zoo.dataset` writes them) as a
    :class:`core.zoo.scenes.Sample`, so that step 4 can draw its swap
    (:func:`swap_attribute`); None for any other line.

    The pixels and the masks are the file's; each object's coverage (which the
    swap reads the ink colour through) is re-rendered at 4x supersampling,
    since the line does not record the scene's own."""
    objects, template = row.get("objects"), row.get("template")
    h, w = image.shape[:2]
    if template not in ATTRIBUTE_TEMPLATES or h != w or not isinstance(objects, list) or len(objects) != len(masks):
        return None
    drawn = []
    try:
        for o, mask in zip(objects, masks):
            color, shape = o["color"], o["shape"]
            cx, cy = (float(v) for v in o["center"])
            size, rot = float(o["size"]), float(o["rotation_deg"])
            if color not in scenes.COLORS or shape not in scenes.SHAPES:
                return None
            coverage = scenes.render_coverage(shape, cx, cy, size, rot, h, 4)
            ys, xs = np.nonzero(mask)
            box = [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1] if len(xs) else [0, 0, 0, 0]
            drawn.append(scenes.SceneObject(color, shape, (cx, cy), size, rot, box, mask, coverage))
    except (KeyError, TypeError, ValueError):
        return None
    reference = row.get("reference")
    reference = reference if isinstance(reference, int) and not isinstance(reference, bool) else None
    return scenes.Sample(image, drawn, question, answer, foil, "attribute", template, target, reference)
