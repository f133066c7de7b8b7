"""Functional labels and the validation chain (docs/METHODS.md §4.5, §4.11).

A functional label ("moves the asked colour from the target object to the
answer position") is a behaviour summary measured on a distribution, never an
architectural type. So a :class:`Label` is always stored with its
:class:`InputCondition` (dataset, split, templates, kinds, filters, n, seeds)
and refuses to exist without one.

The evidence for a label is a :class:`ValidationChain`: the seven steps of
4.11 as a checklist per candidate head or route, each step with its measured
evidence (numbers, n, the held-out split), its status (``pass`` / ``fail`` /
``not-run``) and the baselines it was compared with (a matched random head,
the other heads of the same layer, entropy-matched heads, position
baselines). :meth:`ValidationChain.status` turns the checklist into one of
:data:`CHAIN_STATUSES` with the reason:

* steps 1-4 pass -> ``mechanism candidate`` (observation only);
* and step 5 passes -> ``candidate with intervention``;
* and steps 6 and 7 pass -> ``supported``. Nothing less is shown as supported.

The second half of the module defines the steps for the synthetic shape
scenes (:mod:`core.zoo.scenes`), whose ground-truth object masks make each
step checkable: candidates are heads that move the asked attribute (colour
or shape) from the target object to the answer position, found on one split
(``val``) and tested on another (``heldout``). Conventions: the target ``S``
is the answer-minus-foil logit difference at the answer position; DLA is the
frozen-final-norm-scale DLA of :mod:`core.methods.contributions`; ablations
edit the head's ``z`` at the answer position only (the write the claim is
about), through :class:`core.edits.Edit`.

A subject is a head (:class:`HeadRef`) or a route (:class:`RouteRef`: several
heads of one block taken together, for a function the heads of a block share):
every step runs on either; :func:`find_routes` proposes the routes worth
testing, and a route's baselines are routes of the same size
(:class:`BaselinePlan`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from core.audit import AuditRecord
from core.errors import ReadoutError

SCHEMA_VERSION = 1
CHAIN_STATUSES = ("not a candidate", "mechanism candidate", "candidate with intervention", "supported")
STEP_STATUSES = ("pass", "fail", "not-run")

# The seven steps of docs/METHODS.md §4.11, in the chapter's words.
STEP_TITLES: dict[int, str] = {
    1: "the pattern meets a pre-registered relation on held-out inputs",
    2: "the source contribution matches the target content",
    3: "the head result predicts the change in the target S",
    4: "swapping the source feature changes the pattern as predicted",
    5: "patching / ablating the head changes behaviour as predicted",
    6: "a matched random head, other heads of the layer and position baselines are weaker",
    7: "side effects and alternative routes are reported",
}

BASELINE_KINDS = (
    "matched random head",
    "other heads of the layer",
    "entropy-matched heads",
    "position: uniform",
    "position: fixed patch",
    "position: background tokens",
)


class LabelError(ReadoutError):
    """A label or chain was built without what it needs (its input condition, a valid step)."""


def _clean(x: Any) -> Any:
    """JSON-safe copy: NaN / inf -> None, tuples -> lists, numpy / torch scalars -> Python."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _clean(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _finite(v):
    """A float, or None for a missing or non-finite value."""
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


# ---------------------------------------------------------------- the data model


@dataclass(frozen=True)
class InputCondition:
    """The distribution a label was measured on (4.5: "labels carry their input condition").

    Attributes:
        dataset: where the inputs come from ("core.zoo.scenes", a JSONL path...).
        split: the split the numbers were measured on.
        n_samples: how many inputs.
        kinds, templates: the question kinds and templates the inputs cover.
        filters: what was required of each input (e.g. ``{"min_distractors": 1}``).
        seeds: what fixes the inputs (split seed, sample indices, any RNG seed).
        query: the query position the claim is about.
    """

    dataset: str
    split: str
    n_samples: int
    kinds: tuple[str, ...] = ()
    templates: tuple[str, ...] = ()
    filters: dict = field(default_factory=dict)
    seeds: dict = field(default_factory=dict)
    query: str = "answer position"

    def __post_init__(self):
        if not str(self.dataset).strip() or not str(self.split).strip():
            raise LabelError("an input condition needs its dataset and split")
        if int(self.n_samples) <= 0:
            raise LabelError("an input condition needs n_samples > 0 (what was it measured on?)")
        object.__setattr__(self, "kinds", tuple(self.kinds))
        object.__setattr__(self, "templates", tuple(self.templates))

    def describe(self) -> str:
        what = "/".join(self.kinds) or "all kinds"
        filt = ", ".join(f"{k}={v}" for k, v in sorted(self.filters.items()))
        return (
            f"{self.dataset} split {self.split!r}, {what} questions ({', '.join(self.templates) or 'any template'}), "
            f"n={self.n_samples}{', ' + filt if filt else ''}, at the {self.query}"
        )

    def to_dict(self) -> dict:
        return _clean(
            {
                "dataset": self.dataset,
                "split": self.split,
                "n_samples": int(self.n_samples),
                "kinds": list(self.kinds),
                "templates": list(self.templates),
                "filters": dict(self.filters),
                "seeds": dict(self.seeds),
                "query": self.query,
            }
        )

    @classmethod
    def from_dict(cls, d: dict) -> InputCondition:
        return cls(
            d["dataset"],
            d["split"],
            int(d["n_samples"]),
            tuple(d.get("kinds", ())),
            tuple(d.get("templates", ())),
            dict(d.get("filters", {})),
            dict(d.get("seeds", {})),
            d.get("query", "answer position"),
        )


def _as_condition(condition) -> InputCondition:
    if isinstance(condition, InputCondition):
        return condition
    if isinstance(condition, dict):
        return InputCondition.from_dict(condition)
    raise LabelError(
        "a functional label is a claim about a distribution: give its input condition "
        "(dataset, split, kinds/templates, filters, n, seeds), not a bare tag"
    )


@dataclass
class Label:
    """A functional label with the distribution it holds on.

    ``status`` and ``reason`` come from the :class:`ValidationChain` that backs
    the label (:meth:`ValidationChain.label`); :meth:`text` shows it as
    supported only when the chain says so. ``caveats`` are what step 7 found
    (side effects on other kinds, alternative routes): one head can do
    several things, one function can be spread over heads.
    """

    name: str
    subject: str
    model: str
    condition: InputCondition
    status: str = "not a candidate"
    reason: str = "no validation chain run"
    evidence: dict = field(default_factory=dict)
    caveats: list[str] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        if not str(self.name).strip() or not str(self.subject).strip():
            raise LabelError("a label needs a name and the head or route it is about")
        self.condition = _as_condition(self.condition)
        if self.status not in CHAIN_STATUSES:
            raise LabelError(f"unknown label status {self.status!r}; expected one of {CHAIN_STATUSES}")

    @property
    def supported(self) -> bool:
        return self.status == "supported"

    def text(self) -> str:
        """How the label is shown: never without its condition, and marked
        as a candidate unless the chain supports it."""
        claim = f'{self.subject} "{self.name}" on {self.condition.describe()} ({self.model})'
        if self.caveats:
            claim += "; caveats: " + "; ".join(self.caveats)
        return claim if self.supported else f"[{self.status}, not a supported label] {claim}"

    def to_dict(self) -> dict:
        return _clean(
            {
                "schema_version": self.schema_version,
                "name": self.name,
                "subject": self.subject,
                "model": self.model,
                "condition": self.condition.to_dict(),
                "status": self.status,
                "reason": self.reason,
                "evidence": self.evidence,
                "caveats": list(self.caveats),
            }
        )

    @classmethod
    def from_dict(cls, d: dict) -> Label:
        _check_schema(d)
        return cls(
            d["name"],
            d["subject"],
            d["model"],
            d.get("condition"),
            d["status"],
            d["reason"],
            dict(d["evidence"]),
            list(d.get("caveats", [])),
        )


def _check_schema(d: dict) -> None:
    v = d.get("schema_version")
    if v != SCHEMA_VERSION:
        raise LabelError(f"schema_version {v!r} is not {SCHEMA_VERSION}")


@dataclass
class Baseline:
    """One control a step compared the candidate with.

    Attributes:
        kind: one of :data:`BASELINE_KINDS`.
        subjects: the heads (or the position rule) the baseline is made of.
        value: the baseline's value of the step's key metric (None: not defined for this step).
        n: the samples it was measured on.
    """

    kind: str
    subjects: list[str]
    value: float | None
    n: int
    detail: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in BASELINE_KINDS:
            raise LabelError(f"unknown baseline kind {self.kind!r}; expected one of {BASELINE_KINDS}")
        self.value = _finite(self.value)

    def to_dict(self) -> dict:
        return _clean(
            {
                "kind": self.kind,
                "subjects": list(self.subjects),
                "value": self.value,
                "n": self.n,
                "detail": self.detail,
            }
        )

    @classmethod
    def from_dict(cls, d: dict) -> Baseline:
        return cls(d["kind"], list(d["subjects"]), d["value"], int(d["n"]), dict(d.get("detail", {})))


@dataclass
class ChainStep:
    """One step of the chain with its evidence.

    Attributes:
        number: 1-7 (:data:`STEP_TITLES`).
        criterion: the pass rule, fixed before the evaluation split was read.
        status: "pass", "fail" or "not-run".
        metric, value: the key number's name and value (what a table shows).
        n, split: how many samples and which split the evidence comes from.
        numbers: every measured number of the step.
        baselines: the controls and their values of the key metric.
        why: one line on what decided the status (shown in the chain's reason).
    """

    number: int
    criterion: str = ""
    status: str = "not-run"
    metric: str = ""
    value: float | None = None
    n: int = 0
    split: str = ""
    numbers: dict = field(default_factory=dict)
    baselines: list[Baseline] = field(default_factory=list)
    audit: AuditRecord | None = None
    notes: list[str] = field(default_factory=list)
    why: str = ""

    def __post_init__(self):
        if self.number not in STEP_TITLES:
            raise LabelError(f"step {self.number!r} is not one of 1-7")
        if self.status not in STEP_STATUSES:
            raise LabelError(f"unknown step status {self.status!r}; expected one of {STEP_STATUSES}")
        if self.status != "not-run" and self.n <= 0:
            raise LabelError(f"step {self.number} has status {self.status!r} but no samples (n=0)")
        self.value = _finite(self.value)

    @property
    def title(self) -> str:
        return STEP_TITLES[self.number]

    def summary(self) -> str:
        if self.status == "not-run":
            return f"step {self.number} not run"
        v = "n/a" if _finite(self.value) is None else f"{self.value:.3g}"
        out = f"step {self.number} {self.status} ({self.metric} {v}, n={self.n}, {self.split})"
        return f"{out}: {self.why}" if self.why else out

    def to_dict(self) -> dict:
        return _clean(
            {
                "number": self.number,
                "title": self.title,
                "criterion": self.criterion,
                "status": self.status,
                "metric": self.metric,
                "value": self.value,
                "n": self.n,
                "split": self.split,
                "numbers": self.numbers,
                "baselines": [b.to_dict() for b in self.baselines],
                "audit": self.audit.to_dict() if self.audit else None,
                "notes": list(self.notes),
                "why": self.why,
            }
        )

    @classmethod
    def from_dict(cls, d: dict) -> ChainStep:
        return cls(
            int(d["number"]),
            d.get("criterion", ""),
            d["status"],
            d.get("metric", ""),
            d.get("value"),
            int(d.get("n", 0)),
            d.get("split", ""),
            dict(d.get("numbers", {})),
            [Baseline.from_dict(b) for b in d.get("baselines", [])],
            AuditRecord.from_dict(d["audit"]) if d.get("audit") else None,
            list(d.get("notes", [])),
            d.get("why", ""),
        )


@dataclass(frozen=True)
class ChainStatus:
    """What the chain supports so far, and why."""

    status: str
    reason: str

    def __iter__(self):  # status, reason = chain.status()
        return iter((self.status, self.reason))


@dataclass
class ValidationChain:
    """The seven-step checklist of 4.11 for one candidate head or route.

    Attributes:
        subject: the head ("L2.xattn.H1") or route the chain is about.
        relation: the function it is claimed to perform (the label's name).
        condition: the evaluation distribution (held out from the search).
        search: how the candidate was found (split, n, rank, score): the
            evaluation split must differ from it.
        criteria: the pass rule of each step, fixed before evaluation.
        steps: step number -> :class:`ChainStep` (all seven, "not-run" until filled).
    """

    subject: str
    relation: str
    model: str
    condition: InputCondition
    subject_kind: str = "head"
    search: dict = field(default_factory=dict)
    criteria: dict = field(default_factory=dict)
    steps: dict = field(default_factory=dict)
    audit: AuditRecord | None = None
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        self.condition = _as_condition(self.condition)
        if self.subject_kind not in ("head", "route"):
            raise LabelError(f"subject_kind must be 'head' or 'route', not {self.subject_kind!r}")
        self.criteria = {int(k): v for k, v in self.criteria.items()}
        steps = {int(k): v for k, v in self.steps.items()}
        for k in STEP_TITLES:
            steps.setdefault(k, ChainStep(k, self.criteria.get(k, "")))
        self.steps = dict(sorted(steps.items()))
        search_split = self.search.get("split")
        if search_split is not None and search_split == self.condition.split:
            raise LabelError(
                f"the evaluation split {self.condition.split!r} is the split the candidate was found on; "
                "step 1 needs held-out inputs"
            )

    def record(self, step: ChainStep) -> None:
        """Fill one step (replaces what was there)."""
        if not isinstance(step, ChainStep):
            raise LabelError("record a ChainStep")
        if not step.criterion:
            step.criterion = self.criteria.get(step.number, "")
        self.steps[step.number] = step

    def status(self) -> ChainStatus:
        """One of :data:`CHAIN_STATUSES` with the reason (which steps hold it back)."""
        s = self.steps
        missing = [s[k] for k in (1, 2, 3, 4) if s[k].status != "pass"]
        if missing:
            return ChainStatus(
                "not a candidate",
                "steps 1-4 must all pass for a mechanism candidate: " + "; ".join(x.summary() for x in missing),
            )
        if s[5].status != "pass":
            return ChainStatus(
                "mechanism candidate",
                "steps 1-4 pass (observation only); no intervention supports it yet: " + s[5].summary(),
            )
        held = [s[k] for k in (6, 7) if s[k].status != "pass"]
        if held:
            return ChainStatus(
                "candidate with intervention",
                "steps 1-5 pass; steps 6 and 7 must pass before the label is supported: "
                + "; ".join(x.summary() for x in held),
            )
        return ChainStatus("supported", f"steps 1-7 pass on {self.condition.describe()}")

    def label(self) -> Label:
        """The label this chain backs, with its condition, status and key numbers."""
        st = self.status()
        evidence = {
            str(k): {"status": x.status, "metric": x.metric, "value": x.value, "n": x.n, "split": x.split}
            for k, x in self.steps.items()
        }
        caveats = list(self.steps[7].notes) if self.steps[7].status != "not-run" else []
        return Label(self.relation, self.subject, self.model, self.condition, st.status, st.reason, evidence, caveats)

    def table_row(self) -> dict:
        """``{"subject", "status", "1": "pass 0.62", ...}`` for a candidates x steps table."""
        row = {"subject": self.subject, "status": self.status().status}
        for k, x in self.steps.items():
            v = "" if x.value is None else f" {x.value:.3g}"
            row[str(k)] = x.status + (v if x.status != "not-run" else "")
        return row

    def to_dict(self) -> dict:
        st = self.status()
        return _clean(
            {
                "schema_version": self.schema_version,
                "subject": self.subject,
                "subject_kind": self.subject_kind,
                "relation": self.relation,
                "model": self.model,
                "condition": self.condition.to_dict(),
                "search": self.search,
                "criteria": {str(k): v for k, v in sorted(self.criteria.items())},
                "steps": {str(k): v.to_dict() for k, v in self.steps.items()},
                "status": st.status,
                "reason": st.reason,
                "audit": self.audit.to_dict() if self.audit else None,
            }
        )

    @classmethod
    def from_dict(cls, d: dict) -> ValidationChain:
        _check_schema(d)
        return cls(
            d["subject"],
            d["relation"],
            d["model"],
            d.get("condition"),
            d.get("subject_kind", "head"),
            dict(d.get("search", {})),
            {int(k): v for k, v in d.get("criteria", {}).items()},
            {int(k): ChainStep.from_dict(v) for k, v in d.get("steps", {}).items()},
            AuditRecord.from_dict(d["audit"]) if d.get("audit") else None,
        )


# ---------------------------------------------------------------- statistics


def _stats(x) -> dict:
    """n, mean, standard error and a normal 95% interval of the finite values."""
    v = np.asarray(x, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    n = int(v.size)
    if n == 0:
        return {"n": 0, "mean": None, "se": None, "ci95": [None, None]}
    mean = float(v.mean())
    se = float(v.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return {"n": n, "mean": mean, "se": se, "ci95": [mean - 1.96 * se, mean + 1.96 * se]}


def _lower(st: dict) -> float:
    lo = st["ci95"][0]
    return float("nan") if lo is None else float(lo)


def _pearson(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size < 3 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def _spearman(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size < 3:
        return float("nan")
    return _pearson(a.argsort().argsort(), b.argsort().argsort())


# ---------------------------------------------------------------- the synthetic setting

# Pre-registered pass rules (fixed here, before any evaluation split is read).
HIT_RATIO_MIN = 2.0  # step 1: hit rate at least this multiple of chance
HIT_Z_MIN = 3.0  # step 1: and this many binomial standard errors above chance
PREDICT_R_MIN = 0.5  # step 3: Pearson r between DLA and the re-run effect
FOLLOW_RATE_MIN = 0.5  # step 4: share of swaps whose attention moves with the attribute

CRITERIA: dict[int, str] = {
    1: (
        f"answer-row argmax over the patch tokens lands on the target object's tokens: hit rate >= {HIT_RATIO_MIN:g} "
        f"x chance (a uniform head) and >= {HIT_Z_MIN:g} binomial standard errors above chance, on the evaluation "
        "split (not the split the head was found on)"
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


def _image(sample):
    from PIL import Image

    return Image.fromarray(sample.image)


def _tokens(loaded, size, positions):
    return loaded.adapter.visual_tokens(size, positions)


def scene_samples(
    loaded,
    split: str,
    n: int,
    kind: str = "attribute",
    *,
    min_distractors: int = 1,
    start: int = 0,
    max_tries: int | None = None,
) -> tuple[list, InputCondition]:
    """The first ``n`` samples of ``split`` (from index ``start``) of question
    ``kind`` that pass the filters, and their :class:`InputCondition`.

    For ``kind="attribute"`` a sample must have at least ``min_distractors``
    distractors and a target covering at least one visual token (region
    cover >= 0.25 of the token's box); other kinds are taken as drawn.
    """
    from core.geometry import region_tokens
    from core.zoo import scenes

    out, indices, skipped = [], [], 0
    limit = max_tries or 20 * n + 100
    i = start
    toks = None
    while len(out) < n and i < start + limit:
        s = scenes.make_sample(split, i, kind=kind)
        i += 1
        if kind == "attribute":
            if len(s.distractors) < min_distractors:
                skipped += 1
                continue
            if toks is None:
                inp = loaded.adapter.prepare([_image(s)], [s.question])
                toks = _tokens(
                    loaded, (s.image.shape[1], s.image.shape[0]), loaded.adapter.visual_positions(inp)[0].tolist()
                )
            if not region_tokens(toks, s.objects[s.target].mask, REGION_MIN_COVER):
                skipped += 1
                continue
        out.append(s)
        indices.append(s.index)
    if not out:
        raise LabelError(f"no {kind} sample of split {split!r} passes the filters")
    filters = {"min_distractors": min_distractors, "target_tokens_min": 1, "region_min_cover": REGION_MIN_COVER}
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


def _length_groups(loaded, samples, batch_size: int) -> list[list[int]]:
    """Sample indices grouped by prompt length (no padding inside a group, so
    one edit position serves every row), in chunks of ``batch_size``."""
    a = loaded.adapter
    lengths: dict[str, int] = {}
    by_len: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        if s.question not in lengths:
            lengths[s.question] = int(a.prepare([_image(s)], [s.question]).input_ids.shape[1])
        by_len.setdefault(lengths[s.question], []).append(i)
    groups = []
    for _, idx in sorted(by_len.items()):
        groups += [idx[k : k + batch_size] for k in range(0, len(idx), batch_size)]
    return groups


class ChainCancelled(Exception):
    """Raised inside the context's computations when ``cancel()`` returns True;
    :func:`run_chain` catches it and returns the chain with the steps done so far."""


@dataclass
class HeadObservations:
    """Per-sample read-outs of every visual-reading head (one capture per sample).

    Attributes:
        heads: the heads, in column order.
        vis_attn: ``(n, heads, n_visual)`` answer-row attention on each visual token.
        dla_vis: ``(n, heads, n_visual)`` frozen-scale DLA (answer minus foil)
            of each visual token's source contribution.
        head_dla: ``(n, heads)`` the head's whole frozen-scale DLA at the answer
            position (every source; equals the residual component's ``dla_frozen``).
        entropy: ``(n, heads)`` entropy (nats) of the full answer row.
        z: ``(n, heads, d_head)`` the head's z at the answer position.
        logit_diff, correct: ``(n,)`` S and whether the top token is the answer.
        target, distractors, background, patches: per sample, visual-token index lists.
        routes: the :class:`RouteRef` columns after the heads' (added by :meth:`col` on first use).
    """

    split: str
    heads: list[HeadRef]
    vis_attn: np.ndarray
    dla_vis: np.ndarray
    head_dla: np.ndarray
    entropy: np.ndarray
    z: torch.Tensor
    logit_diff: np.ndarray
    correct: np.ndarray
    target: list[list[int]]
    distractors: list[list[list[int]]]
    background: list[list[int]]
    patches: list[list[int]]
    routes: list[RouteRef] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.target)

    def col(self, subject: Subject) -> int:
        """The column of a head, or of a route (derived from its heads' columns on first use)."""
        if isinstance(subject, HeadRef):
            return self.heads.index(subject)
        if subject not in self.routes:
            cols = [self.heads.index(m) for m in subject.members]
            self.vis_attn = np.concatenate([self.vis_attn, self.vis_attn[:, cols].mean(1, keepdims=True)], 1)
            self.dla_vis = np.concatenate([self.dla_vis, self.dla_vis[:, cols].sum(1, keepdims=True)], 1)
            self.head_dla = np.concatenate([self.head_dla, self.head_dla[:, cols].sum(1, keepdims=True)], 1)
            self.entropy = np.concatenate([self.entropy, self.entropy[:, cols].mean(1, keepdims=True)], 1)
            # a route has no single z: its ablation uses each head's own (ChainContext.ablated)
            self.z = torch.cat([self.z, torch.full_like(self.z[:, :1], float("nan"))], 1)
            self.routes.append(subject)
        return len(self.heads) + self.routes.index(subject)

    def hits(self) -> np.ndarray:
        """``(n, heads)`` 1 where the argmax over patch tokens is a target token."""
        out = np.zeros(self.vis_attn.shape[:2])
        for i in range(self.n):
            p = np.asarray(self.patches[i])
            best = p[self.vis_attn[i][:, p].argmax(-1)]
            out[i] = np.isin(best, self.target[i])
        return out

    def argmax_patch(self) -> np.ndarray:
        out = np.zeros(self.vis_attn.shape[:2], dtype=np.int64)
        for i in range(self.n):
            p = np.asarray(self.patches[i])
            out[i] = p[self.vis_attn[i][:, p].argmax(-1)]
        return out

    def chance(self) -> np.ndarray:
        """``(n,)`` share of patch tokens in the target: a uniform head's hit probability."""
        return np.array([len(t) / len(p) for t, p in zip(self.target, self.patches)])

    def region_sum(self, values: np.ndarray, regions: list[list[int]]) -> np.ndarray:
        """``values (n, heads, n_visual)`` summed over each sample's region -> ``(n, heads)``."""
        return np.stack([values[i][:, r].sum(-1) if r else np.zeros(values.shape[1]) for i, r in enumerate(regions)])

    def distractor_max(self, values: np.ndarray) -> np.ndarray:
        """``(n, heads)`` the largest per-distractor region sum (NaN without distractors)."""
        out = np.full(values.shape[:2], np.nan)
        for i, ds in enumerate(self.distractors):
            sums = [values[i][:, d].sum(-1) for d in ds if d]
            if sums:
                out[i] = np.max(np.stack(sums), axis=0)
        return out


def observe_heads(
    loaded,
    samples,
    heads: list[HeadRef] | None = None,
    *,
    split: str = "",
    batch_size: int = 32,
    progress=None,
    cancel=None,
) -> HeadObservations:
    """One capture per sample (batched by prompt length): answer-row
    attention, source DLA, entropy and z of every head in ``heads`` (default
    :func:`visual_heads`), with each sample's target / distractor / background token sets."""
    from core.capture import capture
    from core.geometry import region_tokens
    from core.methods.contributions import source_contributions
    from core.methods.patterns import entropy

    a = loaded.adapter
    heads = heads or visual_heads(loaded)
    n = len(samples)
    n_vis = None
    rows: dict[int, dict] = {}
    done = 0
    for group in _length_groups(loaded, samples, batch_size):
        if cancel is not None and cancel():
            raise ChainCancelled()
        batch = [samples[i] for i in group]
        inputs = a.prepare([_image(s) for s in batch], [s.question for s in batch])
        tr = capture(loaded, None, "", inputs=inputs)
        pos = int(inputs.answer_positions[0])
        for b, (i, s) in enumerate(zip(group, batch)):
            vpos = tr.visual_positions[b].tolist()
            toks = _tokens(loaded, (s.image.shape[1], s.image.shape[0]), vpos)
            n_vis = len(toks)
            aid, fid = a.token_id(s.answer), a.token_id(s.foil)
            sc = source_contributions(a, tr, aid, fid, batch=b)
            att = np.zeros((len(heads), n_vis))
            dla = np.zeros((len(heads), n_vis))
            hd = np.zeros(len(heads))
            ent = np.zeros(len(heads))
            z = torch.zeros(len(heads), a.d_head, dtype=torch.float64)
            for c, hr in enumerate(heads):
                keys = torch.arange(n_vis) if tr.block_kinds[hr.block] == "cross" else torch.as_tensor(vpos)
                pat = tr.patterns[hr.block][b, hr.head, 0].double()
                att[c] = pat[keys].cpu().numpy()
                ent[c] = float(entropy(pat))
                d = sc.dla_frozen[hr.block][hr.head].double()
                dla[c] = d[keys].cpu().numpy()
                hd[c] = float(d.sum())
                z[c] = tr.z[hr.block][b, pos, hr.head].double().cpu()
            target = region_tokens(toks, s.objects[s.target].mask, REGION_MIN_COVER) if s.target is not None else []
            ds = [
                [t for t in region_tokens(toks, s.objects[d].mask, REGION_MIN_COVER) if t not in target]
                for d in s.distractors
            ]
            union = np.zeros(s.image.shape[:2], dtype=bool)
            for o in s.objects:
                union |= o.mask
            touched = set(region_tokens(toks, union, 1e-9))
            patches = [k for k, t in enumerate(toks) if t.col >= 0]
            logits = tr.logits[b, pos].double()
            rows[i] = dict(
                att=att,
                dla=dla,
                hd=hd,
                ent=ent,
                z=z,
                ld=float(logits[aid] - logits[fid]),
                ok=bool(int(logits.argmax()) == aid),
                target=target,
                ds=ds,
                bg=[k for k in patches if k not in touched],
                patches=patches,
            )
        done += len(group)
        if progress:
            progress(done, n, f"observing heads ({split})")
    r = [rows[i] for i in range(n)]
    return HeadObservations(
        split,
        list(heads),
        np.stack([x["att"] for x in r]),
        np.stack([x["dla"] for x in r]),
        np.stack([x["hd"] for x in r]),
        np.stack([x["ent"] for x in r]),
        torch.stack([x["z"] for x in r]),
        np.array([x["ld"] for x in r]),
        np.array([x["ok"] for x in r]),
        [x["target"] for x in r],
        [x["ds"] for x in r],
        [x["bg"] for x in r],
        [x["patches"] for x in r],
    )


@torch.no_grad()
def mean_ablation_value(loaded, reference_samples, head: HeadRef, *, batch_size: int = 32) -> torch.Tensor:
    """``(d_head,)`` the mean of the head's z at the answer position over the
    reference samples: what mean ablation writes in place of the head's own z."""
    from core.capture import capture

    a = loaded.adapter
    total = torch.zeros(a.d_head, dtype=torch.float64)
    for group in _length_groups(loaded, reference_samples, batch_size):
        batch = [reference_samples[i] for i in group]
        inputs = a.prepare([_image(s) for s in batch], [s.question for s in batch])
        tr = capture(loaded, None, "", inputs=inputs, pattern_layers=[])
        pos = int(inputs.answer_positions[0])
        total += tr.z[head.block][:, pos, head.head].double().sum(0).cpu()
    return total / len(reference_samples)


def head_edit(head: HeadRef, position: int, value: torch.Tensor | None = None):
    """The :class:`core.edits.Edit` that zeroes (``value=None``) or replaces
    ``(d_head,)`` the head's z at ``position``."""
    from core.edits import Edit

    return Edit(head.block, head.head, (int(position),), None if value is None else value.reshape(1, -1))


@dataclass
class RunNumbers:
    """``(n,)`` S = answer-minus-foil logit difference and top-token correctness of one (edited) run."""

    logit_diff: np.ndarray
    correct: np.ndarray


@torch.no_grad()
def run_edited(loaded, samples, make_edits: Callable[[int], list], *, batch_size: int = 32, cancel=None) -> RunNumbers:
    """S and correctness of every sample under the edits ``make_edits(answer_position)``
    (an empty list: the model as is). Batched by prompt length."""
    from core.capture import capture

    a = loaded.adapter
    ld = np.zeros(len(samples))
    ok = np.zeros(len(samples), dtype=bool)
    for group in _length_groups(loaded, samples, batch_size):
        if cancel is not None and cancel():
            raise ChainCancelled()
        batch = [samples[i] for i in group]
        inputs = a.prepare([_image(s) for s in batch], [s.question for s in batch])
        pos = int(inputs.answer_positions[0])
        tr = capture(loaded, None, "", inputs=inputs, pattern_layers=[], edits=make_edits(pos))
        logits = tr.logits[:, pos].double()
        for b, (i, s) in enumerate(zip(group, batch)):
            aid, fid = a.token_id(s.answer), a.token_id(s.foil)
            ld[i] = float(logits[b, aid] - logits[b, fid])
            ok[i] = int(logits[b].argmax()) == aid
    return RunNumbers(ld, ok)


# ---------------------------------------------------------------- step 4's counterfactual scenes


@dataclass
class SwapScene:
    """A scene with the asked attribute moved from the target to ``partner``
    (same geometry, same question): the question's answer becomes ``answer``.

    ``mask_a`` / ``mask_b``: ``(H, W)`` bool, the union of the original and the
    redrawn ink at the target's location (a) and the partner's location (b).
    """

    image: np.ndarray
    partner: int
    answer: str
    foil: str
    mask_a: np.ndarray
    mask_b: np.ndarray


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
    from core.zoo import scenes

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


@dataclass
class SwapObservations:
    """Answer-row attention of every head before and after the swap.

    Attributes:
        rows: indices into the evaluation samples that admitted a swap.
        mass_a_orig, mass_b_orig, mass_a_swap, mass_b_swap: ``(m, heads)`` mass on
            the target's location (a) and the partner's location (b).
        swap_logit_diff, swap_correct: ``(m,)`` the model on the swapped scene
            (new answer minus new foil; whether the top token is the new answer).
    """

    rows: list[int]
    mass_a_orig: np.ndarray
    mass_b_orig: np.ndarray
    mass_a_swap: np.ndarray
    mass_b_swap: np.ndarray
    swap_logit_diff: np.ndarray
    swap_correct: np.ndarray
    n_tried: int
    heads: list[HeadRef] = field(default_factory=list)
    routes: list[RouteRef] = field(default_factory=list)

    def col(self, subject: Subject) -> int:
        """The column of a head, or of a route (its heads' mean mass, added on first use)."""
        if isinstance(subject, HeadRef):
            return self.heads.index(subject)
        if subject not in self.routes:
            cols = [self.heads.index(m) for m in subject.members]
            for key in ("mass_a_orig", "mass_b_orig", "mass_a_swap", "mass_b_swap"):
                v = getattr(self, key)
                setattr(self, key, np.concatenate([v, v[:, cols].mean(1, keepdims=True)], 1))
            self.routes.append(subject)
        return len(self.heads) + self.routes.index(subject)

    def shift(self) -> np.ndarray:
        """``(m, heads)``: mass gained at b plus mass lost at a, halved."""
        return 0.5 * ((self.mass_b_swap - self.mass_b_orig) + (self.mass_a_orig - self.mass_a_swap))

    def follows(self) -> np.ndarray:
        """``(m, heads)`` 1 where the head prefers a before and b after the swap."""
        return ((self.mass_a_orig > self.mass_b_orig) & (self.mass_b_swap > self.mass_a_swap)).astype(float)


@torch.no_grad()
def observe_swaps(loaded, samples, heads: list[HeadRef], *, seed: int = 0, cancel=None) -> SwapObservations:
    """Capture every sample and its :func:`swap_attribute` counterfactual and
    measure each head's answer-row mass on the two swapped locations."""
    from core.capture import capture
    from core.geometry import region_tokens

    a = loaded.adapter
    out = {k: [] for k in ("rows", "ao", "bo", "as", "bs", "ld", "ok")}
    for i, s in enumerate(samples):
        if cancel is not None and cancel():
            raise ChainCancelled()
        sw = swap_attribute(s, seed)
        if sw is None:
            continue
        from PIL import Image

        inputs = a.prepare([_image(s), Image.fromarray(sw.image)], [s.question, s.question])
        tr = capture(loaded, None, "", inputs=inputs)
        pos = int(inputs.answer_positions[0])
        size = (s.image.shape[1], s.image.shape[0])
        masses = []
        for b in (0, 1):
            vpos = tr.visual_positions[b].tolist()
            toks = _tokens(loaded, size, vpos)
            ra = region_tokens(toks, sw.mask_a, REGION_MIN_COVER)
            rb = region_tokens(toks, sw.mask_b, REGION_MIN_COVER)
            ra, rb = [k for k in ra if k not in rb], [k for k in rb if k not in ra]
            m = np.zeros((2, len(heads)))
            for c, hr in enumerate(heads):
                keys = torch.arange(len(toks)) if tr.block_kinds[hr.block] == "cross" else torch.as_tensor(vpos)
                vis = tr.patterns[hr.block][b, hr.head, 0, keys].double()
                m[0, c] = float(vis[ra].sum()) if ra else 0.0
                m[1, c] = float(vis[rb].sum()) if rb else 0.0
            masses.append(m)
        aid, fid = a.token_id(sw.answer), a.token_id(sw.foil)
        logits = tr.logits[1, pos].double()
        out["rows"].append(i)
        out["ao"].append(masses[0][0])
        out["bo"].append(masses[0][1])
        out["as"].append(masses[1][0])
        out["bs"].append(masses[1][1])
        out["ld"].append(float(logits[aid] - logits[fid]))
        out["ok"].append(int(logits.argmax()) == aid)
    h = len(heads)

    def arr(k):
        return np.stack(out[k]) if out[k] else np.zeros((0, h))

    return SwapObservations(
        out["rows"],
        arr("ao"),
        arr("bo"),
        arr("as"),
        arr("bs"),
        np.array(out["ld"]),
        np.array(out["ok"]),
        len(samples),
        list(heads),
    )


# ---------------------------------------------------------------- the shared context


@dataclass
class BaselinePlan:
    """The controls chosen for one candidate, from the search split only.

    Attributes:
        random_head: a seeded random draw among the other heads of the same block.
        layer_heads: every other head of the same block.
        entropy_matched: the heads of other blocks whose mean answer-row entropy
            on the search split is closest to the candidate's.
        fixed_patch: the visual token the candidate picks most often on the search
            split (a head that always attends there is the position baseline).

    For a :class:`RouteRef` of k heads the head baselines are routes of k heads
    too: a seeded random other k-subset of the same block, the rest of the block
    as one route (a single head when one is left), and the k-subsets of other
    blocks closest in mean entropy. A route of a whole block has no same-block
    baseline; every other visual block, whole, is an entropy-matched baseline,
    each compared apart (``each_matched``: a block as strong as the candidate
    is not hidden in a mean over weaker ones).
    """

    random_head: Subject | None
    layer_heads: list[Subject]
    entropy_matched: list[Subject]
    fixed_patch: int
    seed: int
    each_matched: bool = False  # compare with each entropy-matched subject apart (a whole block: each other block)

    def to_dict(self) -> dict:
        return {
            "random_head": self.random_head.name if self.random_head else None,
            "layer_heads": [h.name for h in self.layer_heads],
            "entropy_matched": [h.name for h in self.entropy_matched],
            "each_matched": self.each_matched,
            "fixed_patch": self.fixed_patch,
            "seed": self.seed,
        }


class ChainContext:
    """What the steps share for one model: the search and evaluation samples,
    per-sample observations of every visual-reading head, and cached
    (edited) runs. Everything is computed on first use.

    Args:
        search_samples, search_condition: where candidates are found (and the
            mean-ablation reference set comes from).
        eval_samples, eval_condition: the held-out evaluation split.
        side_samples: ``{kind: samples}`` of other question kinds on the
            evaluation split (step 7); ``side_reference``: the same kinds on
            the search split (their mean-ablation values).
        progress: ``progress(done, total, message)``; cancel: returns True to stop.
    """

    def __init__(
        self,
        loaded,
        search_samples,
        search_condition: InputCondition,
        eval_samples,
        eval_condition: InputCondition,
        *,
        side_samples: dict | None = None,
        side_reference: dict | None = None,
        seed: int = 0,
        batch_size: int = 32,
        progress=None,
        cancel=None,
    ):
        if search_condition.split == eval_condition.split:
            raise LabelError("the evaluation split must differ from the search split (held-out inputs)")
        self.loaded = loaded
        self.search_samples, self.search_condition = list(search_samples), search_condition
        self.eval_samples, self.eval_condition = list(eval_samples), eval_condition
        self.side_samples = dict(side_samples or {})
        self.side_reference = dict(side_reference or {})
        self.seed = seed
        self.batch_size = batch_size
        self.progress = progress
        self.cancel = cancel
        self.pool = visual_heads(loaded)
        self._cache: dict = {}
        self._routes: list[RouteRef] = []  # routes planned so far: every observation gets their columns

    def _get(self, key, make):
        if key not in self._cache:
            value = make()
            if key in ("eval_obs", "swap_obs"):
                for route in self._routes:
                    value.col(route)
            self._cache[key] = value
        return self._cache[key]

    def _report(self, message: str):
        if self.progress:
            self.progress(0, 0, message)

    @property
    def search_obs(self) -> HeadObservations:
        return self._get(
            "search_obs",
            lambda: observe_heads(
                self.loaded,
                self.search_samples,
                self.pool,
                split=self.search_condition.split,
                batch_size=self.batch_size,
                progress=self.progress,
                cancel=self.cancel,
            ),
        )

    @property
    def eval_obs(self) -> HeadObservations:
        return self._get(
            "eval_obs",
            lambda: observe_heads(
                self.loaded,
                self.eval_samples,
                self.pool,
                split=self.eval_condition.split,
                batch_size=self.batch_size,
                progress=self.progress,
                cancel=self.cancel,
            ),
        )

    @property
    def swap_obs(self) -> SwapObservations:
        return self._get(
            "swap_obs",
            lambda: observe_swaps(self.loaded, self.eval_samples, self.pool, seed=self.seed, cancel=self.cancel),
        )

    @property
    def pattern_stats(self):
        """:func:`core.methods.patterns.pattern_statistics` on the evaluation
        split with region = the target mask: an independent recomputation of
        step 1's estimator (one unbatched capture per sample). Returns the
        result, or the error's one-line text when it cannot run on this model."""
        from core.methods.patterns import pattern_statistics

        def make():
            items = [(s.image, s.question, s.objects[s.target].mask) for s in self.eval_samples]
            try:
                out = pattern_statistics(self.loaded, items, region_min_cover=REGION_MIN_COVER, cancel=self.cancel)
            except (IndexError, RuntimeError) as e:
                return f"{type(e).__name__}: {e}"
            if out.n_samples < len(items):
                raise ChainCancelled()
            return out

        return self._get("pattern_stats", make)

    def mean_z(self, head: HeadRef, kind: str = "attribute") -> torch.Tensor:
        """``(d_head,)`` the mean-ablation value: mean z at the answer position over the search-split reference set."""
        if not isinstance(head, HeadRef):
            raise LabelError(f"{head.name}: a route has no single z; ablate its heads")
        if kind == "attribute":
            return self.search_obs.z[:, self.search_obs.col(head)].mean(0)
        return self._get(
            ("mean_z", kind, head),
            lambda: mean_ablation_value(self.loaded, self.side_reference[kind], head, batch_size=self.batch_size),
        )

    def samples(self, which: str):
        return self.eval_samples if which == "eval" else self.side_samples[which]

    def base(self, which: str = "eval") -> RunNumbers:
        return self._get(
            ("base", which),
            lambda: run_edited(
                self.loaded, self.samples(which), lambda pos: [], batch_size=self.batch_size, cancel=self.cancel
            ),
        )

    def ablated(self, heads: Sequence[Subject], mode: str, which: str = "eval") -> RunNumbers:
        """The run with every head in ``heads`` (a route: each of its heads)
        zeroed (``mode="zero"``) or set to its mean z (``"mean"``) at the answer position."""
        if mode not in ("zero", "mean"):
            raise ValueError("mode is 'zero' or 'mean'")
        heads = tuple(sorted({m for h in heads for m in _members(h)}, key=lambda h: (h.block, h.head)))
        kind = "attribute" if which == "eval" else which

        def make():
            values = {h: (None if mode == "zero" else self.mean_z(h, kind)) for h in heads}
            return run_edited(
                self.loaded,
                self.samples(which),
                lambda pos: [head_edit(h, pos, values[h]) for h in heads],
                batch_size=self.batch_size,
                cancel=self.cancel,
            )

        return self._get(("ablated", heads, mode, which), make)

    def drop(self, heads: Sequence[Subject], mode: str, which: str = "eval") -> np.ndarray:
        """``(n,)`` S(model) - S(ablated): positive when the ablation lowers the answer's margin."""
        return self.base(which).logit_diff - self.ablated(heads, mode, which).logit_diff

    def plan(self, cand: Subject) -> BaselinePlan:
        """The candidate's baselines (:class:`BaselinePlan`). A route and the
        routes of its plan get their columns in the observations here, before
        any step builds its per-column arrays."""

        def make():
            if isinstance(cand, RouteRef):
                same, layer, others = self._route_baselines(cand)
            else:
                same = layer = [h for h in self.pool if h.block == cand.block and h != cand]
                others = [h for h in self.pool if h.block != cand.block]
            rng = np.random.default_rng([self.seed, zlib.crc32(cand.name.encode())])
            random_head = same[int(rng.integers(len(same)))] if same else None
            obs = self.search_obs
            cols = {h: obs.col(h) for h in [cand, *others]}  # (adds route columns first)
            ent = obs.entropy.mean(0)
            mine = ent[cols[cand]]
            others = sorted(others, key=lambda h: abs(ent[cols[h]] - mine))
            # a whole block is compared with every other block: there are few, and entropy
            # matching alone would leave out a block that matters (LLaVA's L0, say)
            whole_block = isinstance(cand, RouteRef) and not layer
            counts = np.bincount(obs.argmax_patch()[:, cols[cand]], minlength=obs.vis_attn.shape[2])
            matched = others if whole_block else others[:2]
            return BaselinePlan(random_head, layer, matched, int(counts.argmax()), self.seed, whole_block)

        plan = self._get(("plan", cand), make)
        for subject in [cand, plan.random_head, *plan.layer_heads, *plan.entropy_matched]:
            if isinstance(subject, RouteRef) and subject not in self._routes:
                self._routes.append(subject)
                for key in ("eval_obs", "swap_obs"):  # already observed: add the column now
                    if key in self._cache:
                        self._cache[key].col(subject)
        return plan

    def _route_baselines(self, route: RouteRef) -> tuple[list, list, list]:
        """``(same-block routes of the same size, [the rest of the block], same-size routes of other blocks)``."""
        from itertools import combinations

        blocks: dict[int, list[HeadRef]] = {}
        for h in self.pool:
            blocks.setdefault(h.block, []).append(h)

        def as_subject(heads) -> Subject:
            heads = list(heads)
            if len(heads) == 1:
                return heads[0]
            return RouteRef(heads[0].block, tuple(h.head for h in heads), heads[0].name.rsplit(".H", 1)[0])

        k = len(route.heads)
        same = [r for c in combinations(blocks[route.block], k) if (r := as_subject(c)) != route]
        rest = [h for h in blocks[route.block] if h.head not in route.heads]
        others = [as_subject(c) for b, hs in blocks.items() if b != route.block for c in combinations(hs, k)]
        return same, [as_subject(rest)] if rest else [], others


def _group_values(ctx: ChainContext, plan: BaselinePlan, per_head: Callable[[Subject], np.ndarray]) -> list[tuple]:
    """``(kind, heads, per-sample values, {head: mean})`` of the three head
    baselines (a group's per-sample value is the mean over its heads; with
    ``plan.each_matched`` each entropy-matched subject is a group of its own)."""
    out = []
    matched = [[h] for h in plan.entropy_matched] if plan.each_matched else [plan.entropy_matched]
    for kind, heads in (
        ("matched random head", [plan.random_head] if plan.random_head is not None else []),
        ("other heads of the layer", plan.layer_heads),
        *(("entropy-matched heads", group) for group in matched),
    ):
        if heads:
            values = [per_head(h) for h in heads]
            out.append(
                (kind, heads, np.mean(values, 0), {h.name: _finite(np.nanmean(v)) for h, v in zip(heads, values)})
            )
    return out


def _baselines(groups: list[tuple], n: int) -> list[Baseline]:
    """Baselines from ``(kind, subjects, per-sample values[, per-head means])``."""
    out = []
    for kind, heads, values, *per in groups:
        st = _stats(values)
        detail = {"stats": st, "per_head": per[0] if per else {}}
        out.append(
            Baseline(
                kind, [h.name if isinstance(h, (HeadRef, RouteRef)) else str(h) for h in heads], st["mean"], n, detail
            )
        )
    return out


def _audit(method: str, controls: list[str], parameters: dict, notes: list[str] | None = None) -> AuditRecord:
    return AuditRecord.for_method(method, controls=controls, parameters=parameters, notes=notes)


# ---------------------------------------------------------------- the steps


def step1_pattern(ctx: ChainContext, cand: Subject) -> ChainStep:
    """Answer-row argmax over the patch tokens on the target's tokens, against
    chance, on the evaluation split (the estimator of
    :func:`core.methods.patterns.pattern_statistics`, which is run beside it as a check)."""
    from core.methods.patterns import Distribution

    obs, plan = ctx.eval_obs, ctx.plan(cand)
    c = obs.col(cand)
    hits, chance_i = obs.hits(), obs.chance()
    n = obs.n
    k, rate, chance = float(hits[:, c].sum()), float(hits[:, c].mean()), float(chance_i.mean())
    # hits are a sum of Bernoulli(p_i) under a uniform head: mean sum p_i, variance sum p_i (1 - p_i)
    z = (k - chance_i.sum()) / math.sqrt(max(float((chance_i * (1 - chance_i)).sum()), 1e-12))
    passed = rate >= HIT_RATIO_MIN * chance and z >= HIT_Z_MIN
    groups = _group_values(ctx, plan, lambda h: hits[:, obs.col(h)])
    fixed = np.array([float(plan.fixed_patch in t) for t in obs.target])
    groups += [
        ("position: uniform", ["uniform over the patch tokens"], chance_i),
        ("position: fixed patch", [f"visual token {plan.fixed_patch}"], fixed),
    ]
    mass = obs.region_sum(obs.vis_attn, obs.target)[:, c]
    numbers = {
        "hit_rate": rate,
        "chance_hit_rate": chance,
        "ratio_to_chance": rate / chance if chance else None,
        "z_vs_chance": z,
        "target_mass": Distribution.of(mass, value_range=(0.0, 1.0)).to_dict(),
        "entropy": Distribution.of(obs.entropy[:, c]).to_dict(),
        "search_split": ctx.search_condition.split,
    }
    notes = ["a hit rate above chance is a routing regularity on this distribution, not evidence the head is used"]
    stats = None if isinstance(cand, RouteRef) else ctx.pattern_stats
    if stats is None:
        numbers["pattern_statistics_hit_rate"] = None
        notes.append("a route's pattern is its heads' mean answer row; pattern_statistics checks single heads only")
    elif isinstance(stats, str):
        numbers["pattern_statistics_hit_rate"] = None
        notes.append(f"pattern_statistics could not run on this model ({stats}); the estimator above is its definition")
    else:
        mine = next(h for h in stats.heads if (h.block, h.head) == (cand.block, cand.head))
        numbers["pattern_statistics_hit_rate"] = mine.hit_rate
        if mine.hit_rate is not None and abs(mine.hit_rate - rate) > 1.5 / n:
            notes.append(f"pattern_statistics (unbatched) gives hit rate {mine.hit_rate:.3f}: argmax ties differ")
    audit = _audit(
        "pattern analysis",
        [
            "argmax over patch tokens only (sink, delimiters, text excluded)",
            f"target tokens: box covered >= {REGION_MIN_COVER:g} by the ground-truth mask",
            "chance = a uniform head's hit probability, per sample",
            "evaluation split held out from the search split",
            "matched random / same-layer / entropy-matched heads and fixed-patch position baseline",
        ],
        {"n": n, "split": obs.split, "search_split": ctx.search_condition.split, "head": cand.name},
        notes[:1],
    )
    why = f"hit rate {rate:.3f} vs chance {chance:.3f} (x{rate / chance if chance else float('nan'):.1f}, z={z:.1f})"
    return ChainStep(
        1,
        CRITERIA[1],
        "pass" if passed else "fail",
        "hit rate",
        rate,
        n,
        obs.split,
        numbers,
        _baselines(groups, n),
        audit,
        notes,
        why=why,
    )


def step2_content(ctx: ChainContext, cand: Subject) -> ChainStep:
    """Frozen-scale DLA (answer minus foil) from the target's tokens versus distractor regions."""
    obs, plan = ctx.eval_obs, ctx.plan(cand)
    target = obs.region_sum(obs.dla_vis, obs.target)
    dmax = obs.distractor_max(obs.dla_vis)
    c = obs.col(cand)
    t_st, diff_st = _stats(target[:, c]), _stats(target[:, c] - dmax[:, c])
    passed = _lower(t_st) > 0 and _lower(diff_st) > 0
    groups = _group_values(ctx, plan, lambda h: target[:, obs.col(h)])
    bg = obs.region_sum(obs.dla_vis, obs.background)
    scale = np.array([len(t) / len(b) if b else np.nan for t, b in zip(obs.target, obs.background)])
    groups.append(
        ("position: background tokens", ["object-free tokens, scaled to the target's token count"], bg[:, c] * scale)
    )
    mass = obs.region_sum(obs.vis_attn, obs.target)[:, c]
    audit = _audit(
        "source contribution",
        [
            "value path as computed (biases included)",
            f"{ctx.loaded.adapter.frozen_convention} (dla_frozen)",
            "signed, toward answer minus foil (competing token)",
            "target versus the strongest distractor region, per sample",
            "background-token position baseline",
        ],
        {"n": obs.n, "split": obs.split, "region_min_cover": REGION_MIN_COVER, "head": cand.name},
        [
            "a positive direct write from the target does not show later layers keep it (see steps 3 and 5)",
            "a source is the stream at that token as the head's block reads it: in a self-attention model, "
            "earlier layers may already have mixed other positions into it",
        ],
    )
    why = (
        f"target DLA {t_st['mean']:.3g} (95% lower {_lower(t_st):.3g}); target minus strongest distractor "
        f"{diff_st['mean']:.3g} (95% lower {_lower(diff_st):.3g})"
    )
    return ChainStep(
        2,
        CRITERIA[2],
        "pass" if passed else "fail",
        "target DLA",
        t_st["mean"],
        t_st["n"],
        obs.split,
        {
            "target_dla": t_st,
            "strongest_distractor_dla": _stats(dmax[:, c]),
            "target_minus_distractor": diff_st,
            "target_dla_per_token": _stats(target[:, c] / np.maximum([len(t) for t in obs.target], 1)),
            "target_attention_mass": _stats(mass),
            "share_of_head_dla_from_target": _stats(
                target[:, c] / np.where(obs.head_dla[:, c] == 0, np.nan, obs.head_dla[:, c])
            ),
        },
        _baselines(groups, obs.n),
        audit,
        why=why,
    )


def step3_prediction(ctx: ChainContext, cand: Subject) -> ChainStep:
    """Does the head's DLA predict the re-run effect of zeroing it (per sample)?"""
    obs, plan = ctx.eval_obs, ctx.plan(cand)
    c = obs.col(cand)
    x = obs.head_dla[:, c]
    y = ctx.drop([cand], "zero")
    r, rho = _pearson(x, y), _spearman(x, y)
    same_sign = np.sign(x.mean()) == np.sign(y.mean())
    passed = bool(np.isfinite(r) and r >= PREDICT_R_MIN and same_sign)
    groups = []
    for kind, heads, *_ in _group_values(ctx, plan, lambda h: np.zeros(obs.n)):
        rs = [_pearson(obs.head_dla[:, obs.col(h)], ctx.drop([h], "zero")) for h in heads]
        groups.append((kind, heads, rs))
    base = [
        Baseline(
            kind,
            [h.name for h in heads],
            float(np.nanmean(rs)) if np.isfinite(rs).any() else None,
            obs.n,
            {"per_head": dict(zip([h.name for h in heads], rs))},
        )
        for kind, heads, rs in groups
    ]
    slope = float(np.polyfit(x, y, 1)[0]) if x.std() > 0 else None
    audit = _audit(
        "residual DLA",
        [
            f"{ctx.loaded.adapter.frozen_convention} (dla_frozen)",
            "actual re-run: the head's z zeroed at the answer position, later layers recomputed",
            "competing token (foil)",
            "per-sample correlation on the evaluation split",
        ],
        {"n": obs.n, "split": obs.split, "head": cand.name, "edited_positions": "answer position"},
        ["zero ablation moves activations off their distribution; the re-run is one intervention"],
    )
    why = f"r={r:.2f} (rho={rho:.2f}); mean DLA {x.mean():.3g} vs mean re-run drop {y.mean():.3g}"
    return ChainStep(
        3,
        CRITERIA[3],
        "pass" if passed else "fail",
        "Pearson r",
        r,
        obs.n,
        obs.split,
        {
            "pearson_r": r,
            "spearman_rho": rho,
            "slope": slope,
            "head_dla": _stats(x),
            "rerun_drop_zero": _stats(y),
            "same_sign": bool(same_sign),
        },
        base,
        audit,
        why=why,
    )


def step4_swap(ctx: ChainContext, cand: Subject) -> ChainStep:
    """Swap the asked attribute onto another object; does the attention follow?"""
    sw, plan = ctx.swap_obs, ctx.plan(cand)
    m = len(sw.rows)
    if m == 0:
        return ChainStep(4, CRITERIA[4], "not-run", notes=["no evaluation sample admitted a swap"])
    c = sw.col(cand)
    shift, follows = sw.shift(), sw.follows()
    st = _stats(shift[:, c])
    rate = float(follows[:, c].mean())
    passed = _lower(st) > 0 and rate >= FOLLOW_RATE_MIN
    groups = _group_values(ctx, plan, lambda h: shift[:, sw.col(h)])
    groups.append(("position: fixed patch", [f"visual token {plan.fixed_patch}"], np.zeros(m)))
    audit = _audit(
        "pattern analysis",
        [
            "paired scenes: same question, geometry and other objects; only the asked attribute moved",
            "mass on the union of the old and redrawn ink at each location",
            "tokens touching both locations left out",
        ],
        {"n_swapped": m, "n_tried": sw.n_tried, "split": ctx.eval_condition.split, "head": cand.name},
        ["a pattern that follows the attribute is routing sensitivity, not the swap's effect on the answer"],
    )
    why = f"follow rate {rate:.2f}; mean mass shift {st['mean']:.3g} (95% lower {_lower(st):.3g})"
    return ChainStep(
        4,
        CRITERIA[4],
        "pass" if passed else "fail",
        "follow rate",
        rate,
        m,
        ctx.eval_condition.split,
        {
            "follow_rate": rate,
            "mass_shift": st,
            "mass_target_location_before": _stats(sw.mass_a_orig[:, c]),
            "mass_target_location_after": _stats(sw.mass_a_swap[:, c]),
            "mass_partner_location_before": _stats(sw.mass_b_orig[:, c]),
            "mass_partner_location_after": _stats(sw.mass_b_swap[:, c]),
            "model_follows_swap_accuracy": float(sw.swap_correct.mean()),
            "model_swap_logit_diff": _stats(sw.swap_logit_diff),
            "n_tried": sw.n_tried,
        },
        _baselines(groups, m),
        audit,
        ["the fixed-patch position baseline cannot move: its shift is 0 by construction"],
        why=why,
    )


def step5_ablation(ctx: ChainContext, cand: Subject) -> ChainStep:
    """Zero and mean ablation of the head at the answer position."""
    plan = ctx.plan(cand)
    base = ctx.base("eval")
    n = len(base.logit_diff)
    mean_drop, zero_drop = ctx.drop([cand], "mean"), ctx.drop([cand], "zero")
    st = _stats(mean_drop)
    passed = _lower(st) > 0
    groups = _group_values(ctx, plan, lambda h: ctx.drop([h], "mean"))
    acc0 = float(base.correct.mean())
    audit = _audit(
        "functional label",
        [
            "mean ablation (mean z over the search-split reference set) and zero ablation",
            "edited at the answer position only",
            "S = answer-minus-foil logit difference",
        ],
        {"n": n, "split": ctx.eval_condition.split, "head": cand.name, "reference": ctx.search_condition.split},
        ["an ablation shows the head's write is used here; it does not show which feature of the write is"],
    )
    why = (
        f"mean-ablation drop {st['mean']:.3g} (95% lower {_lower(st):.3g}), zero-ablation drop "
        f"{float(zero_drop.mean()):.3g}; accuracy {acc0:.3f} -> {float(ctx.ablated([cand], 'mean').correct.mean()):.3f}"
    )
    return ChainStep(
        5,
        CRITERIA[5],
        "pass" if passed else "fail",
        "mean-ablation drop",
        st["mean"],
        n,
        ctx.eval_condition.split,
        {
            "mean_ablation_drop": st,
            "zero_ablation_drop": _stats(zero_drop),
            "accuracy": acc0,
            "accuracy_mean_ablated": float(ctx.ablated([cand], "mean").correct.mean()),
            "accuracy_zero_ablated": float(ctx.ablated([cand], "zero").correct.mean()),
            "baseline_logit_diff": _stats(base.logit_diff),
            "mean_value_reference_n": len(ctx.search_samples),
        },
        _baselines(groups, n),
        audit,
        why=why,
    )


def step6_baselines(ctx: ChainContext, cand: Subject, chain: ValidationChain | None = None) -> ChainStep:
    """Paired comparisons of the candidate with every baseline on the step 1, 2, 4, 5 metrics."""
    obs, plan = ctx.eval_obs, ctx.plan(cand)
    hits = obs.hits()
    target = obs.region_sum(obs.dla_vis, obs.target)
    bg = obs.region_sum(obs.dla_vis, obs.background)
    scale = np.array([len(t) / len(b) if b else np.nan for t, b in zip(obs.target, obs.background)])
    metrics: dict[int, tuple[str, Callable, dict]] = {
        1: (
            "hit",
            lambda h: hits[:, obs.col(h)],
            {
                "position: uniform": obs.chance(),
                "position: fixed patch": np.array([float(plan.fixed_patch in t) for t in obs.target]),
            },
        ),
        2: (
            "target DLA",
            lambda h: target[:, obs.col(h)],
            {"position: background tokens": bg[:, obs.col(cand)] * scale},
        ),
        5: ("mean-ablation drop", lambda h: ctx.drop([h], "mean"), {}),
    }
    ran = {k for k, s in chain.steps.items() if s.status != "not-run"} if chain is not None else {1, 2, 4, 5}
    if 4 in ran and len(ctx.swap_obs.rows):
        sw = ctx.swap_obs
        metrics[4] = (
            "mass shift",
            lambda h: sw.shift()[:, sw.col(h)],
            {"position: fixed patch": np.zeros(len(sw.rows))},
        )
    comparisons, worst = [], None
    for k in sorted(metrics):
        if k not in ran:
            continue
        name, per_head, positions = metrics[k]
        mine = per_head(cand)
        groups = _group_values(ctx, plan, per_head) + [(kind, [kind], v) for kind, v in positions.items()]
        for kind, heads, values, *_ in groups:
            st = _stats(mine - values)
            row = {
                "step": k,
                "metric": name,
                "baseline": kind,
                "subjects": [h.name if isinstance(h, (HeadRef, RouteRef)) else str(h) for h in heads],
                "candidate": _stats(mine)["mean"],
                "baseline_value": _stats(values)["mean"],
                "paired_difference": st,
                "weaker": bool(_lower(st) > 0),
            }
            comparisons.append(row)
            if worst is None or _lower(st) < _lower(worst["paired_difference"]) or not np.isfinite(_lower(st)):
                worst = row
    if not comparisons:
        return ChainStep(6, CRITERIA[6], "not-run", notes=["no step 1, 2, 4 or 5 evidence to compare"])
    passed = all(r["weaker"] for r in comparisons)
    n_weaker = sum(r["weaker"] for r in comparisons)
    layer_max = {}
    for k in sorted(metrics):
        if k in ran and plan.layer_heads:
            _, per_head, _ = metrics[k]
            best = max(plan.layer_heads, key=lambda h: float(np.nanmean(per_head(h))))
            layer_max[str(k)] = {"head": best.name, "value": float(np.nanmean(per_head(best)))}
    base = [
        Baseline(
            r["baseline"],
            r["subjects"],
            r["baseline_value"],
            r["paired_difference"]["n"],
            {
                "step": r["step"],
                "metric": r["metric"],
                "candidate": r["candidate"],
                "paired_difference": r["paired_difference"],
            },
        )
        for r in comparisons
    ]
    audit = _audit(
        "functional label",
        [
            "matched random head (same block, seeded)",
            "mean of the other heads of the block",
            "entropy-matched heads (other blocks, search split)",
            "position baselines (uniform, fixed patch, background)",
            "paired per-sample differences on the evaluation split",
        ],
        {"plan": plan.to_dict(), "steps_compared": sorted(k for k in metrics if k in ran)},
        ["the strongest single head of the layer is reported beside the mean (a shared function is not refuted by it)"],
    )
    lost = [r for r in comparisons if not r["weaker"]]
    why = (
        "not weaker: "
        + "; ".join(
            f"{r['baseline']} on step {r['step']} ({r['baseline_value']:.3g} vs {r['candidate']:.3g})" for r in lost
        )
        if lost
        else f"all {len(comparisons)} baselines weaker"
    )
    return ChainStep(
        6,
        CRITERIA[6],
        "pass" if passed else "fail",
        "comparisons won",
        n_weaker / len(comparisons),
        obs.n,
        obs.split,
        {
            "comparisons": comparisons,
            "n_comparisons": len(comparisons),
            "n_weaker": n_weaker,
            "weakest_comparison": worst,
            "strongest_other_head_of_layer": layer_max,
            "plan": plan.to_dict(),
        },
        base,
        audit,
        why=why,
    )


def step7_side_effects(ctx: ChainContext, cand: Subject) -> ChainStep:
    """Effect of the ablation on other question kinds, and the strongest alternative route."""
    side = {}
    for kind in ctx.side_samples:
        if kind not in ctx.side_reference:
            continue
        base = ctx.base(kind)
        side[kind] = {
            "n": len(base.logit_diff),
            "mean_ablation_drop": _stats(ctx.drop([cand], "mean", kind)),
            "zero_ablation_drop": _stats(ctx.drop([cand], "zero", kind)),
            "accuracy": float(base.correct.mean()),
            "accuracy_mean_ablated": float(ctx.ablated([cand], "mean", kind).correct.mean()),
        }
    others = [h for h in ctx.pool if h not in _members(cand)]
    drops = {h: float(ctx.drop([h], "mean").mean()) for h in others}
    alt = max(others, key=lambda h: drops[h]) if others else None
    route = {}
    if alt is not None:
        d_c, d_a = ctx.drop([cand], "mean"), ctx.drop([alt], "mean")
        d_both = ctx.drop([cand, alt], "mean")
        m_c, m_a, m_b = float(d_c.mean()), float(d_a.mean()), float(d_both.mean())
        route = {
            "alternative": alt.name,
            "chosen_by": "largest mean-ablation drop among the other visual-reading heads (evaluation split)",
            "drop_candidate": _stats(d_c),
            "drop_alternative": _stats(d_a),
            "drop_joint": _stats(d_both),
            "joint_minus_max_single": _stats(d_both - (d_c if m_c >= m_a else d_a)),
            "joint_larger_than_either": bool(m_b > max(m_c, m_a)),
            "additivity_ratio": m_b / (m_c + m_a) if (m_c + m_a) != 0 else None,
        }
    n_eval = len(ctx.eval_samples)
    done = bool(side) and bool(route)
    notes = []
    task = float(ctx.drop([cand], "mean").mean())
    for kind, v in side.items():
        d = v["mean_ablation_drop"]["mean"] or 0.0
        if task > 0 and abs(d) >= 0.5 * task:
            notes.append(f"not specific: mean ablation also moves {kind} questions by {d:.3g} (attribute: {task:.3g})")
    if route and route["joint_larger_than_either"]:
        r = route["additivity_ratio"]
        notes.append(
            f"an alternative route exists: ablating {route['alternative']} as well lowers S further "
            f"(joint / sum of singles = {r:.2f}{', more than additive: redundancy' if r and r > 1 else ''})"
        )
    audit = _audit(
        "functional label",
        [
            "mean ablation with each kind's own search-split reference mean",
            "zero ablation beside it",
            "joint ablation with the strongest alternative head",
        ],
        {"side_kinds": sorted(side), "n_eval": n_eval, "head": cand.name},
        ["one head can do several things; one function can be spread over heads (4.5)"],
    )
    n = n_eval + sum(v["n"] for v in side.values())
    why = "; ".join(notes) if notes else ("reported: no large side effect, no stronger joint route" if done else "")
    return ChainStep(
        7,
        CRITERIA[7],
        "pass" if done else "not-run",
        "largest side-effect drop",
        max((v["mean_ablation_drop"]["mean"] or 0.0 for v in side.values()), default=None, key=abs) if side else None,
        n if done else 0,
        ctx.eval_condition.split,
        {"side_effects": side, "alternative_route": route, "attribute_mean_ablation_drop": task},
        [],
        audit,
        notes,
        why=why,
    )


STEP_FUNCTIONS: dict[int, Callable] = {
    1: step1_pattern,
    2: step2_content,
    3: step3_prediction,
    4: step4_swap,
    5: step5_ablation,
    6: step6_baselines,
    7: step7_side_effects,
}


def find_candidates(ctx: ChainContext, k: int = 3, *, add_attention_top: bool = True) -> list[tuple[HeadRef, dict]]:
    """Heads that write the target's attribute toward the answer, ranked on
    the *search* split by mean target-source DLA (answer minus foil); the top
    ``k``, plus the head with the highest target hit rate if it is not among
    them (an attention-picked candidate, for contrast). Returns ``(head, search
    numbers)`` with the search table of every head under ``"table"``."""
    obs = ctx.search_obs
    nh = len(obs.heads)  # the heads' columns (routes planned so far come after them)
    target_dla = obs.region_sum(obs.dla_vis, obs.target).mean(0)[:nh]
    hits = obs.hits().mean(0)[:nh]
    mass = obs.region_sum(obs.vis_attn, obs.target).mean(0)[:nh]
    chance = float(obs.chance().mean())
    table = [
        {
            "head": h.name,
            "target_dla": float(target_dla[c]),
            "hit_rate": float(hits[c]),
            "target_mass": float(mass[c]),
            "entropy": float(obs.entropy[:, c].mean()),
        }
        for c, h in enumerate(obs.heads)
    ]
    order = list(np.argsort(-target_dla))
    picked = [(int(c), "top target-source DLA") for c in order[:k]]
    if add_attention_top:
        top_att = int(np.argmax(hits))
        if top_att not in [c for c, _ in picked]:
            picked.append((top_att, "top target hit rate (attention only)"))
    out = []
    for c, why in picked:
        out.append(
            (
                obs.heads[c],
                {
                    "split": ctx.search_condition.split,
                    "n": obs.n,
                    "picked_by": why,
                    "rank_by_target_dla": order.index(c) + 1,
                    "target_dla": float(target_dla[c]),
                    "hit_rate": float(hits[c]),
                    "chance_hit_rate": chance,
                    "target_mass": float(mass[c]),
                    "condition": ctx.search_condition.to_dict(),
                    "table": table,
                },
            )
        )
    return out


def find_routes(ctx: ChainContext, found: Sequence[tuple[HeadRef, dict]]) -> list[tuple[RouteRef, dict]]:
    """Routes to test when a function may be shared by the heads of a block
    (4.5: "one function can be spread over heads"): for each block holding two
    or more of the ``found`` candidates (:func:`find_candidates`), those
    candidates together, and the whole block if it has more heads. Returns
    ``(route, search numbers)`` measured on the search split like a head's."""
    by_block: dict[int, list[HeadRef]] = {}
    for head, _ in found:
        by_block.setdefault(head.block, []).append(head)
    obs = ctx.search_obs
    out = []
    for block, heads in by_block.items():
        if len(heads) < 2:
            continue
        block_name = heads[0].name.rsplit(".H", 1)[0]
        whole = [h.head for h in ctx.pool if h.block == block]
        routes = [
            (RouteRef(block, tuple(h.head for h in heads), block_name), "the candidate heads of one block, together")
        ]
        if len(whole) > len(heads):
            routes.append(
                (RouteRef(block, tuple(whole), block_name), "every head of a block with two or more candidates")
            )
        for route, why in routes:
            c = obs.col(route)
            out.append(
                (
                    route,
                    {
                        "split": ctx.search_condition.split,
                        "n": obs.n,
                        "picked_by": why,
                        "members": [m.name for m in route.members],
                        "target_dla": float(obs.region_sum(obs.dla_vis, obs.target)[:, c].mean()),
                        "hit_rate": float(obs.hits()[:, c].mean()),
                        "chance_hit_rate": float(obs.chance().mean()),
                        "target_mass": float(obs.region_sum(obs.vis_attn, obs.target)[:, c].mean()),
                        "condition": ctx.search_condition.to_dict(),
                    },
                )
            )
    return out


def run_chain(
    ctx: ChainContext, cand: Subject, search: dict | None = None, *, steps: Sequence[int] = tuple(range(1, 8))
) -> ValidationChain:
    """Run the steps on one candidate head or route; a cancelled run keeps what
    was done (the rest stays not-run)."""
    chain = ValidationChain(
        cand.name,
        RELATION,
        ctx.loaded.spec,
        ctx.eval_condition,
        subject_kind="route" if isinstance(cand, RouteRef) else "head",
        search={k: v for k, v in (search or {"split": ctx.search_condition.split}).items() if k != "table"},
        criteria=dict(CRITERIA),
    )
    try:
        for k in sorted(steps):
            ctx._report(f"{cand.name}: step {k}")
            chain.record(step6_baselines(ctx, cand, chain) if k == 6 else STEP_FUNCTIONS[k](ctx, cand))
    except ChainCancelled:
        pass
    chain.audit = _audit(
        "functional label",
        [
            "evaluation split held out from the search split",
            "baselines: matched random head, other heads of the layer, entropy-matched heads, position",
            "mean and zero ablation",
        ],
        {
            "subject": cand.name,
            "search": chain.search.get("split"),
            "evaluation": ctx.eval_condition.split,
            "model": ctx.loaded.spec,
            "fingerprint": getattr(ctx.loaded, "fingerprint", ""),
        },
        ["the label holds on its input condition only; outside it, it is a hypothesis"],
    )
    return chain


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
        seed=seed,
        batch_size=batch_size,
        progress=progress,
        cancel=cancel,
    )
