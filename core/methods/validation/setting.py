"""The synthetic setting's fixed choices: each step's pre-registered pass rule
(fixed before any evaluation split is read), the relation the chain tests, and
its subjects: a head (:class:`HeadRef`) or a route of several heads of one block
(:class:`RouteRef`), among the heads that read the visual tokens (:func:`visual_heads`).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.methods.validation.chain import LabelError
from core.methods.validation.spec import ATTRIBUTE_MOVING, criteria

# Pre-registered pass rules (fixed before any evaluation split is read): the attribute relation's,
# the defaults of every claim specification (core.methods.validation.spec.ClaimSpec).
HIT_RATIO_MIN = ATTRIBUTE_MOVING.hit_ratio  # step 1: hit rate at least this multiple of chance
HIT_P_MAX = ATTRIBUTE_MOVING.hit_p  # step 1: and an exact one-sided p-value against chance at most this
PREDICT_R_MIN = ATTRIBUTE_MOVING.prediction_r  # step 3: Pearson r between DLA and the re-run effect
FOLLOW_RATE_MIN = ATTRIBUTE_MOVING.follow_rate  # step 4: share of swaps whose attention moves with the attribute


CRITERIA: dict[int, str] = criteria(ATTRIBUTE_MOVING)
RELATION = ATTRIBUTE_MOVING.relation
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
        if kind == "cross" or (not cross and kind == "self")
        for h in range(a.n_heads)
    ]


def text_heads(loaded) -> list[HeadRef]:
    """Every head of a self-attention block: the heads whose keys are the sequence's own tokens."""
    a = loaded.adapter
    return [
        HeadRef(b, h, f"{name}.H{h}")
        for b, (name, kind) in enumerate(a.blocks)
        if kind == "self"
        for h in range(a.n_heads)
    ]


def relation_heads(loaded, spec) -> list[HeadRef]:
    """The heads a claim of ``spec`` can be about: those that read the image for a relation
    of visual tokens (:func:`visual_heads`), the self-attention heads for one of the sequence's
    own tokens (:func:`text_heads`)."""
    return visual_heads(loaded) if spec.on_image else text_heads(loaded)
