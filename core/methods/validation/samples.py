"""What the chain reads of one input: the image, the question, answer and
foil, and the ground-truth regions that say which visual tokens are "the
target object" and which are the distractors (:class:`ChainSample`), and
step 4's counterfactual of it (:class:`SwapScene`).

The synthetic scenes' :class:`core.zoo.scenes.Sample` has the same fields
(its objects also carry colour, shape and geometry, from which
:func:`core.zoo.label_scenes.swap_attribute` draws the swap); a
:class:`ChainSample` is an input of any other dataset, its regions read from
mask files (or painted), its swap given by the dataset or absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RegionObject:
    """One ground-truth region of an input: ``mask`` ``(H, W)`` bool, white in its file."""

    mask: np.ndarray = field(repr=False)
    source: str = ""  # where the mask came from (a file, "painted region")


@dataclass
class SwapScene:
    """An input with the asked attribute moved from the target to another
    object (same question): the question's answer becomes ``answer``, the
    old answer is the ``foil``.

    ``mask_a`` / ``mask_b``: ``(H, W)`` bool, the target's location (a) and the
    partner's location (b); the shape scenes' swap uses the union of the
    original and the redrawn ink at each.
    """

    image: np.ndarray
    partner: int
    answer: str
    foil: str
    mask_a: np.ndarray
    mask_b: np.ndarray


@dataclass
class ChainSample:
    """One input of the chain, from a dataset file.

    Attributes:
        image: ``(H, W, 3)`` uint8.
        objects: the regions; ``objects[target]`` is the target, ``distractors``
            index the others the claim is contrasted with.
        kind, template: the question's kind and template (free text; step 7
            groups the other kinds).
        split, index: which set and which line it came from (``where`` names the line).
        swap: step 4's counterfactual, when the dataset gives one.
    """

    image: np.ndarray = field(repr=False)
    question: str
    answer: str
    foil: str
    objects: list[RegionObject] = field(default_factory=list)
    target: int | None = None
    distractors: list[int] = field(default_factory=list)
    kind: str = ""
    template: str = ""
    split: str = ""
    index: int = -1
    where: str = ""
    swap: SwapScene | None = field(default=None, repr=False)
