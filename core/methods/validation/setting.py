"""The synthetic setting's fixed choices: each step's pre-registered pass rule
(fixed before any evaluation split is read), the relation the chain tests, and
its subjects: a head (:class:`HeadRef`) or a route of several heads of one block
(:class:`RouteRef`), among the heads that read the visual tokens (:func:`visual_heads`).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.methods.validation.chain import LabelError

# Pre-registered pass rules (fixed here, before any evaluation split is read).
HIT_RATIO_MIN = 2.0  # step 1: hit rate at least this multiple of chance
HIT_P_MAX = 0.00135  # step 1: and an exact one-sided p-value against chance at most this (the normal tail at 3 SE)
PREDICT_R_MIN = 0.5  # step 3: Pearson r between DLA and the re-run effect
FOLLOW_RATE_MIN = 0.5  # step 4: share of swaps whose attention moves with the attribute

CRITERIA: dict[int, str] = {
    1: (
        f"answer-row argmax over the patch tokens lands on the target object's tokens: hit rate >= {HIT_RATIO_MIN:g} "
        f"x chance (a uniform head) and an exact one-sided p-value against chance (Poisson-binomial: each sample's "
        f"own chance) <= {HIT_P_MAX:g}, the normal tail at 3 standard errors, on the evaluation split (not the split "
        "the head was found on)"
    ),
    2: (
        "frozen-scale DLA toward answer minus foil summed over the target's source tokens: mean > 0 and mean "
        "(target minus the strongest distractor region) > 0, both with the 95% lower bound > 0"
    ),
    3: (
        f"across samples, Pearson r >= {PREDICT_R_MIN:g} between the head's frozen-scale DLA and the actual re-run "
        "drop in S when the head's z is zeroed at the answer position, with the same sign on average"
    ),
    4: (
        "when the asked attribute is swapped onto another object (same question, same geometry), the answer row's "
        f"attention mass moves with it: mean shift 95% lower bound > 0 and follow rate >= {FOLLOW_RATE_MIN:g}"
    ),
    5: (
        "mean ablation of the head's z at the answer position (mean over a reference set from the search split) "
        "lowers S = answer-minus-foil logit difference: 95% lower bound of the mean drop > 0; zero ablation and "
        "accuracy changes reported beside it"
    ),
    6: (
        "on the step 1, 2, 4 and 5 metrics (those run), the candidate beats the matched random head, the mean of the "
        "other heads of its layer, the entropy-matched heads and the position baselines: paired mean difference "
        "95% lower bound > 0 for every comparison"
    ),
    7: (
        "reported, not gating: the mean-ablation effect on the other question kinds (relation, count, exist) and the "
        "joint ablation with the strongest alternative head (is the drop larger than either alone?)"
    ),
}

RELATION = "moves the asked attribute (colour or shape) from the target object's visual tokens to the answer position"
ATTRIBUTE_TEMPLATES = ("color_of_shape", "shape_of_color")
SIDE_KINDS = ("relation", "count", "exist")
REGION_MIN_COVER = 0.25


@dataclass(frozen=True)
class HeadRef:
    """A head in canonical block numbering (``Trace.block_names``)."""

    block: int
    head: int
    name: str


@dataclass(frozen=True)
class RouteRef:
    """Several heads of one block taken together (4.11's "route"): the chain
    asks whether they, as a group, move the attribute.

    How a route is read: its answer-row attention is the mean of its heads'
    rows (a distribution, so hit rate, mass and entropy are defined as for a
    head); its DLA is the sum of theirs (their joint write); ablating it
    ablates every head in it, each with its own mean-ablation value; its
    entropy is the mean of its heads' entropies (what baselines are matched on).
    """

    block: int
    heads: tuple[int, ...]
    block_name: str

    def __post_init__(self):
        if len(self.heads) < 2 or len(set(self.heads)) != len(self.heads):
            raise LabelError(f"a route needs two or more distinct heads, got {self.heads}")
        object.__setattr__(self, "heads", tuple(sorted(self.heads)))

    @property
    def name(self) -> str:
        return f"{self.block_name}." + "+".join(f"H{h}" for h in self.heads)

    @property
    def members(self) -> tuple[HeadRef, ...]:
        return tuple(HeadRef(self.block, h, f"{self.block_name}.H{h}") for h in self.heads)


Subject = HeadRef | RouteRef


def _members(subject: Subject) -> tuple[HeadRef, ...]:
    return subject.members if isinstance(subject, RouteRef) else (subject,)


def visual_heads(loaded) -> list[HeadRef]:
    """Every head whose keys include the visual tokens: the heads of the
    cross-attention blocks, or every self-attention head when the visual
    tokens sit in the sequence. (A cross-attention model's text-only blocks
    cannot read the image and are left out.)"""
    a = loaded.adapter
    cross = any(kind == "cross" for _, kind in a.blocks)
    return [
        HeadRef(b, h, f"{name}.H{h}")
        for b, (name, kind) in enumerate(a.blocks)
        if kind == "cross" or not cross
        for h in range(a.n_heads)
    ]
