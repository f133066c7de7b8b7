"""A claim's specification: the relation a head or route is said to implement,
stated with what the chain's steps are derived from and the thresholds it is
pre-registered at (docs/METHODS.md §4.11, "Claim specifications").

One dataclass is both the file's schema (JSON, ``vlm-readout validate --spec
FILE``) and what :func:`core.validate.validate` runs: tuned-lens's style of a
command's schema serving as its executor. A shipped specification is named
(``--spec attribute-moving``); a user's file round-trips through
:meth:`ClaimSpec.to_dict` / :meth:`ClaimSpec.from_dict`, and a field that cannot be
read is refused in one line naming it.

This version's chain observes one kind of relation: the answer position's
attention and write over the target object's visual tokens (the dataset's mask).
``query`` and ``sources`` name it; other query and source kinds are not accepted
yet (each would need its own observations), so a file naming one is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from core.errors import ReadoutError

QUERIES = ("answer",)  # the position the head is read at
SOURCES = ("target_object",)  # where its attention and write should come from


class SpecError(ReadoutError):
    """A claim specification that cannot be read (the message names the field)."""


@dataclass(frozen=True)
class ClaimSpec:
    """The relation and its pre-registered tests.

    Attributes:
        name: the specification's name (a shipped one, or the user's).
        relation: the sentence the verdict names as tested.
        query: the query position (:data:`QUERIES`).
        sources: the source positions (:data:`SOURCES`).
        hit_ratio: step 1: the hit rate must be at least this multiple of chance.
        hit_p: step 1: and its exact one-sided p-value against chance at most this.
        prediction_r: step 3: Pearson r between the head's DLA and the re-run drop, at least.
        follow_rate: step 4: share of swaps whose attention follows the attribute, at least.
        effect_size: step 5: the standardised mean drop (mean / sd) the claim states the
            ablation causes; None: not stated (then step 5 sets no minimum n).
    """

    name: str
    relation: str
    query: str = "answer"
    sources: str = "target_object"
    hit_ratio: float = 2.0
    hit_p: float = 0.00135  # the normal tail at 3 standard errors
    prediction_r: float = 0.5
    follow_rate: float = 0.5
    effect_size: float | None = None

    def __post_init__(self):
        for name in ("name", "relation"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise SpecError(f"claim specification: '{name}' must be a non-empty string")
        if self.query not in QUERIES:
            raise SpecError(f"claim specification: 'query' {self.query!r}: this version reads {', '.join(QUERIES)}")
        if self.sources not in SOURCES:
            raise SpecError(f"claim specification: 'sources' {self.sources!r}: this version reads {', '.join(SOURCES)}")
        _number(self.hit_ratio, "hit_ratio", low=1.0)
        _number(self.hit_p, "hit_p", low=0.0, high=1.0, open_low=True)
        _number(self.prediction_r, "prediction_r", low=0.0, high=1.0, open_low=True, open_high=True)
        _number(self.follow_rate, "follow_rate", low=0.0, high=1.0)
        if self.effect_size is not None:
            _number(self.effect_size, "effect_size", low=0.0, open_low=True)

    def criteria(self) -> dict[int, str]:
        """Each step's pass rule at this specification's thresholds."""
        return criteria(self)

    def minimum_n_step5(self) -> int | None:
        """The smallest held-out n at which step 5's normal 95% interval of the mean drop
        excludes zero when the drop is the stated standardised effect: 1.96 / sqrt(n) < d
        (None where no effect is stated)."""
        if self.effect_size is None:
            return None
        return math.floor((1.96 / self.effect_size) ** 2) + 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d, where: str = "claim specification") -> ClaimSpec:
        """The specification ``d`` describes; one line naming the field otherwise."""
        if not isinstance(d, dict):
            raise SpecError(f"{where}: expected an object of fields, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise SpecError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(sorted(known))})")
        missing = [name for name in ("name", "relation") if name not in d]
        if missing:
            raise SpecError(f"{where}: missing field {missing[0]!r}")
        try:
            return cls(**d)
        except SpecError as e:
            raise SpecError(str(e).replace("claim specification", where, 1)) from None

    @classmethod
    def read(cls, path: str | Path) -> ClaimSpec:
        """A specification file (JSON); one line naming the file and the field otherwise."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SpecError(f"{p}: cannot read the claim specification ({type(e).__name__})") from None
        try:
            d = json.loads(text)
        except ValueError as e:
            raise SpecError(f"{p}: not JSON ({e})") from None
        return cls.from_dict(d, where=str(p))


def _number(value, name: str, *, low: float, high: float = math.inf, open_low=False, open_high=False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SpecError(f"claim specification: {name!r} must be a finite number, got {value!r}")
    below = value <= low if open_low else value < low
    above = value >= high if open_high else value > high
    if below or above:
        span = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
        raise SpecError(f"claim specification: {name!r} {value!r} is outside {span}")


def criteria(spec: ClaimSpec) -> dict[int, str]:
    """Each step's pass rule at ``spec``'s thresholds (what the chain records and shows)."""
    return {
        1: (
            f"answer-row argmax over the patch tokens lands on the target object's tokens: hit rate >= "
            f"{spec.hit_ratio:g} x chance (a uniform head) and an exact one-sided p-value against chance "
            f"(Poisson-binomial: each sample's own chance) <= {spec.hit_p:g}, on the evaluation split (not the split "
            "the head was found on)"
        ),
        2: (
            "frozen-scale DLA toward answer minus foil summed over the target's source tokens: mean > 0 and mean "
            "(target minus the strongest distractor region) > 0, both with the 95% lower bound > 0"
        ),
        3: (
            f"across samples, Pearson r >= {spec.prediction_r:g} between the head's frozen-scale DLA and the actual "
            "re-run drop in S when the head's z is zeroed at the answer position, with the same sign on average"
        ),
        4: (
            "when the asked attribute is swapped onto another object (same question, same geometry), the answer "
            f"row's attention mass moves with it: mean shift 95% lower bound > 0 and follow rate >= {spec.follow_rate:g}"
        ),
        5: (
            "mean ablation of the head's z at the answer position (mean over a reference set from the search split) "
            "lowers S = answer-minus-foil logit difference: 95% lower bound of the mean drop > 0; zero ablation and "
            "accuracy changes reported beside it"
            + (f" (stated effect: standardised drop {spec.effect_size:g})" if spec.effect_size is not None else "")
        ),
        6: (
            "on the step 1, 2, 4 and 5 metrics (those run), the candidate beats the matched random head, the mean of "
            "the other heads of its layer, the entropy-matched heads and the position baselines: paired mean "
            "difference 95% lower bound > 0 for every comparison"
        ),
        7: (
            "reported, not gating: the mean-ablation effect on the other question kinds (relation, count, exist) "
            "and the joint ablation with the strongest alternative head (is the drop larger than either alone?)"
        ),
    }


ATTRIBUTE_MOVING = ClaimSpec(
    "attribute-moving",
    "moves the asked attribute (colour or shape) from the target object's visual tokens to the answer position",
)
SHIPPED: dict[str, ClaimSpec] = {s.name: s for s in (ATTRIBUTE_MOVING,)}


def resolve(spec: str | dict | ClaimSpec | None) -> ClaimSpec:
    """A :class:`ClaimSpec`, its fields, a shipped one's name, a JSON file's path, or None
    (the attribute relation)."""
    if spec is None:
        return ATTRIBUTE_MOVING
    if isinstance(spec, ClaimSpec):
        return spec
    if isinstance(spec, dict):
        return ClaimSpec.from_dict(spec)
    if spec in SHIPPED:
        return SHIPPED[spec]
    if Path(spec).suffix.lower() == ".json" or Path(spec).exists():
        return ClaimSpec.read(spec)
    raise SpecError(f"claim specification {spec!r}: not a shipped one ({', '.join(SHIPPED)}) nor a JSON file")
