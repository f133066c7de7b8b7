"""A claim's specification: the relation a head or route is said to implement,
stated with what the chain's steps are derived from and the thresholds it is
pre-registered at (docs/METHODS.md §4.11, "Claim specifications").

One dataclass is both the file's schema (JSON, ``vlm-readout validate --spec
FILE``) and what :func:`core.validate.validate` runs: tuned-lens's style of a
command's schema serving as its executor. A shipped specification is named
(``--spec attribute-moving``, :data:`SHIPPED`); a user's file round-trips through
:meth:`ClaimSpec.to_dict` / :meth:`ClaimSpec.from_dict`, and a field that cannot be
read is refused in one line naming it.

A relation is read, on each input, at one query position over a set of keys
with sources among them (:mod:`core.methods.validation.relations` locates them);
each step is derived from a field: step 1 from ``pattern``, step 2 from
``content``, step 4 from ``counterfactual``, step 5 from ``effect`` (steps 3, 6
and 7 are the same for every relation, on the relation's own metric S).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from core.errors import ReadoutError

# the query position: the answer position; a seeded word of the question after its first; the
# question's last token that repeats an earlier one (with another token after that occurrence)
QUERIES = ("answer", "question_word", "repeat")
# the source positions: the visual tokens of the object the question names (the dataset's target
# mask, or the painted region); the token before the query; the token after the query token's
# earlier occurrence; the first token; the first token and every delimiter up to the query
SOURCES = ("target_object", "previous_token", "after_earlier_occurrence", "first_token", "sink_or_delimiter")
TEXT_SOURCES = SOURCES[1:]  # sources among the sequence's own positions (self-attention keys)
PATTERNS = ("argmax",)  # step 1: the query row's argmax over the keys lands on a source
# step 2: the sources' write favours the dataset's answer over its foil; favours the source token
# itself over a foil word (copying); is quieter per unit of attention than the other keys' (a sink)
CONTENTS = ("answer", "copy", "quiet")
# step 4: the asked attribute swapped onto another object (the sources move; the pattern should
# follow); one word inserted before the sources (they move one position on); another input's
# image under the same question (the sources stay; the pattern should stay)
COUNTERFACTUALS = ("attribute_swap", "shift", "other_image")
# step 5: mean ablation of the subject's z at the query lowers S; cutting the subject's edges from
# the query to the sources raises the norm of its z there (a parked head starts writing)
EFFECTS = ("lowers", "unparks")


MAX_SPEC_BYTES = 1 << 20


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
        pattern: step 1's pattern relation (:data:`PATTERNS`).
        content: step 2's content claim (:data:`CONTENTS`).
        counterfactual: step 4's counterfactual (:data:`COUNTERFACTUALS`).
        effect: step 5's predicted effect (:data:`EFFECTS`).
        templates: the question templates the claim is stated on (empty: every template of
            the claim's kind); the shape scenes' names, e.g. ``shape_of_color``.
        hit_ratio: step 1: the hit rate must be at least this multiple of chance.
        hit_p: step 1: and its exact one-sided p-value against chance at most this.
        prediction_r: step 3: Pearson r between the subject's DLA and the re-run drop, at least.
        follow_rate: step 4: share of counterfactual pairs whose argmax follows (or stays), at least.
        effect_size: step 5: the standardised mean effect (mean / sd) the claim states the
            intervention causes; None: not stated (then step 5 sets no minimum n).
        stated_r: step 3: the correlation the claim states the subject's DLA has with the
            re-run drop; None: not stated (then step 3 sets no minimum n).
    """

    name: str
    relation: str
    query: str = "answer"
    sources: str = "target_object"
    pattern: str = "argmax"
    content: str = "answer"
    counterfactual: str = "attribute_swap"
    effect: str = "lowers"
    templates: tuple[str, ...] = ()
    hit_ratio: float = 2.0
    hit_p: float = 0.00135  # the normal tail at 3 standard errors
    prediction_r: float = 0.5
    follow_rate: float = 0.5
    effect_size: float | None = None
    stated_r: float | None = None

    def __post_init__(self):
        for name in ("name", "relation"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise SpecError(f"claim specification: '{name}' must be a non-empty string")
        for name, allowed in (
            ("query", QUERIES),
            ("sources", SOURCES),
            ("pattern", PATTERNS),
            ("content", CONTENTS),
            ("counterfactual", COUNTERFACTUALS),
            ("effect", EFFECTS),
        ):
            if getattr(self, name) not in allowed:
                raise SpecError(
                    f"claim specification: {name!r} {getattr(self, name)!r}: expected one of {', '.join(allowed)}"
                )
        templates = self.templates
        if not isinstance(templates, list | tuple) or not all(isinstance(t, str) and t.strip() for t in templates):
            raise SpecError("claim specification: 'templates' must be a list of template names")
        object.__setattr__(self, "templates", tuple(templates))
        self._check_combination()
        _number(self.hit_ratio, "hit_ratio", low=1.0)
        _number(self.hit_p, "hit_p", low=0.0, high=1.0, open_low=True)
        _number(self.prediction_r, "prediction_r", low=0.0, high=1.0, open_low=True, open_high=True)
        _number(self.follow_rate, "follow_rate", low=0.0, high=1.0)
        if self.effect_size is not None:
            _number(self.effect_size, "effect_size", low=0.0, open_low=True)
        if self.stated_r is not None:
            _number(self.stated_r, "stated_r", low=0.0, high=1.0, open_low=True, open_high=True)

    def _check_combination(self) -> None:
        """Fields that cannot be read together: one line naming the second field."""
        on_image = self.sources == "target_object"
        problems = {
            "sources": on_image and self.query != "answer" and "the target object's tokens are read at the answer",
            "query": self.sources == "after_earlier_occurrence"
            and self.query != "repeat"
            and "the token after an earlier occurrence needs the 'repeat' query (a token that occurred before)",
            "content": (
                (self.content == "copy" and self.sources not in ("previous_token", "after_earlier_occurrence"))
                and "copying is stated of one source token (previous_token or after_earlier_occurrence)"
            )
            or (
                self.content in ("answer", "quiet")
                and self.query != "answer"
                and f"the {self.content!r} content is read toward the dataset's answer, at the answer position"
            ),
            "counterfactual": (
                (self.counterfactual == "attribute_swap" and not on_image)
                and "the attribute swap moves an object: it needs target_object sources"
            )
            or (
                (self.counterfactual == "shift" and self.sources not in ("previous_token", "after_earlier_occurrence"))
                and "an inserted word moves a token source (previous_token or after_earlier_occurrence)"
            )
            or (
                (self.counterfactual == "shift" and self.query == "answer")
                and "the word is inserted inside the question: the query must be in it (question_word or repeat)"
            )
            or (
                (self.counterfactual == "other_image" and self.sources not in ("first_token", "sink_or_delimiter"))
                and "another image leaves only the first token and the delimiters where they were"
            ),
            "effect": self.effect == "unparks" and on_image and "cutting edges to a sink needs text sources",
        }
        for name in ("sources", "query", "content", "counterfactual", "effect"):
            if problems[name]:
                raise SpecError(f"claim specification: {name!r} {getattr(self, name)!r} does not fit: {problems[name]}")

    @property
    def on_image(self) -> bool:
        """Whether the sources are visual tokens (else positions of the sequence itself)."""
        return self.sources == "target_object"

    def criteria(self) -> dict[int, str]:
        """Each step's pass rule at this specification's thresholds."""
        return criteria(self)

    def minimum_n_step3(self) -> int | None:
        """The smallest held-out n at which step 3's Fisher 95% interval of r excludes zero
        when r is the stated one: atanh(r) - 1.96 / sqrt(n - 3) > 0 (None where none is stated)."""
        if self.stated_r is None:
            return None
        return math.floor(3 + (1.96 / math.atanh(self.stated_r)) ** 2) + 1

    def minimum_n_step5(self) -> int | None:
        """The smallest held-out n at which step 5's normal 95% interval of the mean drop
        excludes zero when the drop is the stated standardised effect: 1.96 / sqrt(n) < d
        (None where no effect is stated)."""
        if self.effect_size is None:
            return None
        return math.floor((1.96 / self.effect_size) ** 2) + 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["templates"] = list(self.templates)
        return d

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
            size = p.stat().st_size
            if size > MAX_SPEC_BYTES:  # a specification is a few fields: a file this large is not one
                raise SpecError(f"{p}: {size:,} bytes is not a claim specification (at most {MAX_SPEC_BYTES:,})")
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SpecError(f"{p}: cannot read the claim specification ({type(e).__name__})") from None
        try:
            d = json.loads(text)
        except ValueError as e:
            raise SpecError(f"{p}: not JSON ({e})") from None
        except RecursionError:
            raise SpecError(f"{p}: not a claim specification (JSON nested too deep)") from None
        return cls.from_dict(d, where=str(p))


def _number(value, name: str, *, low: float, high: float = math.inf, open_low=False, open_high=False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SpecError(f"claim specification: {name!r} must be a finite number, got {value!r}")
    below = value <= low if open_low else value < low
    above = value >= high if open_high else value > high
    if below or above:
        span = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
        raise SpecError(f"claim specification: {name!r} {value!r} is outside {span}")


QUERY_WORDS = {  # as the input condition names it ("... at the answer position")
    "answer": "answer position",
    "question_word": "seeded word of the question (after its first)",
    "repeat": "question's last token that occurred before",
}
SOURCE_WORDS = {
    "target_object": "the target object's visual tokens",
    "previous_token": "the previous token",
    "after_earlier_occurrence": "the token after the query token's earlier occurrence",
    "first_token": "the first token",
    "sink_or_delimiter": "the first token and the delimiters",
}
KEY_WORDS = {True: "the patch tokens", False: "every position up to the query"}


def metric_words(spec: ClaimSpec) -> str:
    """What S is for ``spec``: the logit difference its steps 3 and 5 read."""
    if spec.content == "copy":
        return "S = the source token's logit minus a foil word's (absent from the input) at the query"
    return "S = answer-minus-foil logit difference at the answer position"


def criteria(spec: ClaimSpec) -> dict[int, str]:
    """Each step's pass rule at ``spec``'s thresholds (what the chain records and shows)."""
    row, keys, sources = f"the {QUERY_WORDS[spec.query]}", KEY_WORDS[spec.on_image], SOURCE_WORDS[spec.sources]
    contrast = "the strongest distractor region" if spec.on_image else "the strongest other single key"
    content = {
        "answer": (
            f"frozen-scale DLA toward answer minus foil summed over {sources}: mean > 0 and mean (sources minus "
            f"{contrast}) > 0, both with the 95% lower bound > 0"
        ),
        "copy": (
            f"frozen-scale DLA from {sources} toward that token's own unembedding minus a foil word's: mean > 0 and "
            f"mean (sources minus {contrast}) > 0, both with the 95% lower bound > 0"
        ),
        "quiet": (
            f"per unit of attention, {sources} write less than the other keys: mean log(other keys' write norm per "
            "unit mass / the sources') > 0 with the 95% lower bound > 0"
        ),
    }[spec.content]
    swap = {
        "attribute_swap": (
            "when the asked attribute is swapped onto another object (same question, same geometry), the query "
            "row's attention mass moves with it: mean shift 95% lower bound > 0 and follow rate >= "
        ),
        "shift": (
            "when one word is inserted before the sources (they move one position on), the query row's attention "
            "moves with them: mean shift 95% lower bound > 0 and follow rate >= "
        ),
        "other_image": (
            "under another input's image (same question), the query row's argmax stays on the sources: mass on "
            "them minus a uniform head's, 95% lower bound > 0, and stay rate >= "
        ),
    }[spec.counterfactual]
    effect = {
        "lowers": (
            "mean ablation of the subject's z at the query (mean over a reference set from the search split) "
            f"lowers S ({metric_words(spec)}): 95% lower bound of the mean drop > 0; zero ablation and accuracy "
            "changes reported beside it"
        ),
        "unparks": (
            "cutting the subject's edges from the query to the sources (before the softmax) raises the norm of its "
            "z at the query: 95% lower bound of the mean rise > 0"
        ),
    }[spec.effect]
    stated = f" (stated effect: standardised {spec.effect_size:g})" if spec.effect_size is not None else ""
    return {
        1: (
            f"the argmax of {row}'s attention row over {keys} lands on {sources}: hit rate >= "
            f"{spec.hit_ratio:g} x chance (a uniform head) and an exact one-sided p-value against chance "
            f"(Poisson-binomial: each sample's own chance) <= {spec.hit_p:g}, on the evaluation split (not the split "
            "the head was found on)"
        ),
        2: content,
        3: (
            f"across samples, Pearson r >= {spec.prediction_r:g} between the subject's frozen-scale DLA and the "
            f"actual re-run drop in S when its z is zeroed at the query ({metric_words(spec)}), its Fisher 95% "
            "lower bound > 0, with the same sign on average"
            + (f" (stated r: {spec.stated_r:g})" if spec.stated_r is not None else "")
        ),
        4: swap + f"{spec.follow_rate:g}",
        5: effect + stated,
        6: (
            "on the step 1, 2, 4 and 5 metrics (those run), the candidate beats the matched random head, the mean of "
            "the other heads of its layer, the entropy-matched heads and the position baselines: paired mean "
            "difference 95% lower bound > 0 for every comparison"
        ),
        7: (
            "reported, not gating: the mean-ablation effect on the other question kinds at the answer position and "
            "the joint ablation with the strongest alternative head (is the drop larger than either alone?)"
        ),
    }


ATTRIBUTE_MOVING = ClaimSpec(
    "attribute-moving",
    "moves the asked attribute (colour or shape) from the target object's visual tokens to the answer position",
)
OBJECT_NAME_COPYING = ClaimSpec(
    "object-name-copying",
    "copies the name of the object the question picks out (its shape word) from the object's visual tokens to the "
    "answer position",
    templates=("shape_of_color",),
)
PREVIOUS_TOKEN = ClaimSpec(
    "previous-token",
    "attends from a word of the question to the token before it and copies that token toward the output",
    query="question_word",
    sources="previous_token",
    content="copy",
    counterfactual="shift",
)
INDUCTION = ClaimSpec(
    "induction",
    "attends from a repeated token to the token that followed its earlier occurrence and copies it (induction)",
    query="repeat",
    sources="after_earlier_occurrence",
    content="copy",
    counterfactual="shift",
)
SINK_DELIMITER = ClaimSpec(
    "sink-delimiter",
    "parks the answer row's attention on the first token or a delimiter, which writes little, whatever the image",
    sources="sink_or_delimiter",
    content="quiet",
    counterfactual="other_image",
    effect="unparks",
)
SHIPPED: dict[str, ClaimSpec] = {
    s.name: s for s in (ATTRIBUTE_MOVING, OBJECT_NAME_COPYING, PREVIOUS_TOKEN, INDUCTION, SINK_DELIMITER)
}


def resolve(spec: str | dict | ClaimSpec | None) -> ClaimSpec:
    """A :class:`ClaimSpec`, its fields, a shipped one's name, a JSON file's path, or None
    (the attribute relation)."""
    if spec is None:
        return ATTRIBUTE_MOVING
    if isinstance(spec, ClaimSpec):
        return spec
    if isinstance(spec, dict):
        return ClaimSpec.from_dict(spec)
    if isinstance(spec, str) and spec in SHIPPED:
        return SHIPPED[spec]
    if Path(spec).suffix.lower() == ".json" or Path(spec).exists():
        return ClaimSpec.read(spec)
    raise SpecError(f"claim specification {spec!r}: not a shipped one ({', '.join(SHIPPED)}) nor a JSON file")
