"""The chain model (docs/METHODS.md §4.5, §4.11): a functional label stored with
the distribution it holds on (:class:`Label`, :class:`InputCondition`), and the
seven-step checklist that backs it (:class:`ValidationChain`, its
:class:`ChainStep` and :class:`Baseline` entries), whose :meth:`ValidationChain.status`
is one of :data:`CHAIN_STATUSES` with the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from core.errors import ReadoutError
from core.results.audit import AuditRecord
from core.results.readout import from_dict_fields, jsonable

SCHEMA_VERSION = 2  # 2: step statuses "passed" / "failed" / "not tested" (1 wrote "pass" / "fail" / "not-run")
CHAIN_STATUSES = ("not a candidate", "mechanism candidate", "candidate with intervention", "supported")
STEP_STATUSES = ("passed", "failed", "not tested")

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
        return jsonable(
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
        return jsonable(
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


_V1_STEP_STATUSES = {"pass": "passed", "fail": "failed", "not-run": "not tested"}


def _check_schema(d: dict) -> None:
    v = d.get("schema_version")
    if v not in (1, SCHEMA_VERSION):
        raise LabelError(f"schema_version {v!r} is not {SCHEMA_VERSION} (or 1)")


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

    @property
    def interval(self) -> tuple[float, float] | None:
        """The 95% interval of the baseline's value (a step 6 comparison: of the paired difference,
        candidate minus baseline); None when it has none."""
        stats = self.detail.get("paired_difference", self.detail.get("stats")) or {}
        ci = stats.get("ci95") or [None, None]
        return None if None in ci else (float(ci[0]), float(ci[1]))

    @property
    def compared_step(self) -> int | None:
        """A step 6 comparison's step (whose key metric it compares), else None."""
        return self.detail.get("step")

    @property
    def candidate_value(self) -> float | None:
        """A step 6 comparison's candidate value of that metric, else None."""
        return self.detail.get("candidate")

    def to_dict(self) -> dict:
        return jsonable(
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


@dataclass(frozen=True)
class PerSample:
    """A step's numbers per held-out input, in the order of ``sample`` (arrays in a run, lists
    read back from a session): step 1's ``hit`` and ``target_mass``, step 5's ``drop_mean`` and
    ``drop_zero``; what a step does not measure is None."""

    sample: list | None = None
    hit: list | None = None
    target_mass: list | None = None
    chance: list | None = None
    drop_mean: list | None = None
    drop_zero: list | None = None

    @classmethod
    def from_dict(cls, d: dict) -> PerSample:
        return from_dict_fields(cls, d)


@dataclass(frozen=True)
class SwapPair:
    """One swap pair of step 4: the head's mass on the target and on its partner location before
    and after the swap, and whether the pattern followed the swap."""

    sample: object
    mass_target_before: float | None
    mass_target_after: float | None
    mass_partner_before: float | None
    mass_partner_after: float | None
    follows: bool

    @classmethod
    def from_dict(cls, d: dict) -> SwapPair:
        return from_dict_fields(cls, d)


@dataclass
class ChainStep:
    """One step of the chain with its evidence.

    Attributes:
        number: 1-7 (:data:`STEP_TITLES`).
        criterion: the pass rule, fixed before the evaluation split was read.
        status: "passed", "failed" or "not tested".
        metric, value: the key number's name and value (what a table shows).
        n, split: how many samples and which split the evidence comes from.
        numbers: every measured number of the step.
        baselines: the controls and their values of the key metric.
        why: one line on what decided the status (shown in the chain's reason).
    """

    number: int
    criterion: str = ""
    status: str = "not tested"
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
        if self.status != "not tested" and self.n <= 0:
            raise LabelError(f"step {self.number} has status {self.status!r} but no samples (n=0)")
        self.value = _finite(self.value)

    @property
    def title(self) -> str:
        return STEP_TITLES[self.number]

    @property
    def per_sample(self) -> PerSample | None:
        """The step's numbers per held-out input (steps 1 and 5), None where it kept none (a
        step not tested, a chain recorded before they were kept)."""
        per = self.numbers.get("per_sample")
        return PerSample.from_dict(per) if per else None

    @property
    def swap_pairs(self) -> list[SwapPair]:
        """Step 4's swap pairs (empty for the other steps, or a chain recorded before they were kept)."""
        return [SwapPair.from_dict(p) for p in self.numbers.get("pairs") or []]

    def summary(self) -> str:
        if self.status == "not tested":
            return f"step {self.number} not tested"
        v = "n/a" if _finite(self.value) is None else f"{self.value:.3g}"
        out = f"step {self.number} {self.status} ({self.metric} {v}, n={self.n}, {self.split})"
        return f"{out}: {self.why}" if self.why else out

    def to_dict(self) -> dict:
        return jsonable(
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
            _V1_STEP_STATUSES.get(d["status"], d["status"]),
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
        steps: step number -> :class:`ChainStep` (all seven, "not tested" until filled).
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

    def steps_passed(self) -> str:
        """``"steps passed: 1 of 7 (step 7)"``: how many of the seven steps passed, and
        which: never a bare count, which reads as "the first k" or as "k passed" alike."""
        passed = [k for k, s in self.steps.items() if s.status == "passed"]
        which = f" ({'step' if len(passed) == 1 else 'steps'} {', '.join(map(str, passed))})" if passed else ""
        return f"steps passed: {len(passed)} of {len(self.steps)}{which}"

    def status(self) -> ChainStatus:
        """One of :data:`CHAIN_STATUSES` with the reason (which steps hold it back)."""
        s = self.steps
        missing = [s[k] for k in (1, 2, 3, 4) if s[k].status != "passed"]
        if missing:
            return ChainStatus(
                "not a candidate",
                "steps 1-4 must all pass for a mechanism candidate: " + "; ".join(x.summary() for x in missing),
            )
        if s[5].status != "passed":
            return ChainStatus(
                "mechanism candidate",
                "steps 1-4 pass (observation only); no intervention supports it yet: " + s[5].summary(),
            )
        held = [s[k] for k in (6, 7) if s[k].status != "passed"]
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
        caveats = list(self.steps[7].notes) if self.steps[7].status != "not tested" else []
        return Label(self.relation, self.subject, self.model, self.condition, st.status, st.reason, evidence, caveats)

    def table_row(self) -> dict:
        """``{"subject", "status", "1": "pass 0.62", ...}`` for a candidates x steps table."""
        row = {"subject": self.subject, "status": self.status().status}
        for k, x in self.steps.items():
            v = "" if x.value is None else f" {x.value:.3g}"
            row[str(k)] = x.status + (v if x.status != "not tested" else "")
        return row

    kind = "label"  # the session's run kind (core.results.readout.Readout)

    def summary(self) -> str:
        """``L2.H1 'color' (head): mechanism candidate; steps pass 1, 2, 3, 4``."""
        passed = [str(k) for k, x in self.steps.items() if x.status == "passed"]
        return (
            f"{self.subject} {self.relation!r} ({self.subject_kind}): {self.status().status}; "
            f"steps pass {', '.join(passed) or 'none'} of {len(self.steps)}"
        )

    def parameters(self) -> dict:
        return {"subject": self.subject, "relation": self.relation, "condition": self.condition.to_dict()}

    def audit_records(self) -> list[AuditRecord]:
        return [self.audit] if self.audit else []

    def to_dict(self) -> dict:
        st = self.status()
        return jsonable(
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
