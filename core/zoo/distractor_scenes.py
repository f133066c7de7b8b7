"""Synthetic scenes for the counterfactual's target-versus-distractor check
(:func:`core.methods.counterfactual.object_fill_effects`): the samples that
hold a target object and at least one distractor.
"""

from __future__ import annotations

from core.zoo import scenes


def scenes_with_distractor(split: str, n: int, start: int = 0) -> list:
    """The first ``n`` samples of ``split`` (from index ``start``) with a target
    object and at least one distractor (:func:`core.zoo.scenes.make_sample`)."""
    out, i = [], start
    while len(out) < n:
        s = scenes.make_sample(split, i)
        if s.target is not None and s.distractors:
            out.append(s)
        i += 1
    return out
