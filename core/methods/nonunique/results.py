"""What a search reports: one :class:`LevelResult` per constraint level, gathered
in a :class:`NonuniqueResult`, with the sentences each says about a routing
claim and the audit row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from core.methods.nonunique.problem import HeadProblem
from core.results.audit import AuditRecord
from core.results.readout import from_dict_fields, jsonable

SCHEMA_VERSION = 1  # of the ``nonunique`` JSON (NonuniqueResult.to_dict)
HEADER = ("component", "region", "model", "input")  # a search on one input: what it was of (last in the JSON)

LEVEL_NAMES = {
    "a": "simplex and mask only",
    "b": "softmax of the real scores + delta, |delta|_inf <= B",
    "c-query": "softmax of a free post-rotation query against the real keys",
    "c-residual": "query formed from a residual through the real norm, W_Q, b_Q and rotation; real keys",
}


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> float | None:
    """KL(p || q) in nats; None when infinite (p puts mass where q has none)."""
    support = p > 0
    if bool((q[support] <= 0).any()):
        return None
    return float((p[support] * (p[support].log() - q[support].log())).sum())


@dataclass
class LevelResult:
    """The best alternative found at one constraint level.

    Attributes:
        level: "a", "b", "c-query" or "c-residual".
        ran: False when the level does not apply (reason in ``reason``).
        feasible: the reported ``A'`` reproduces the output within the tolerance.
        alternative: feasible and it moves at least ``min_moved`` mass off the
            set (half the set's mass when the set holds less than ``2 min_moved``).
        output_error: ``||o' - o|| / ||o||`` of the reported ``A'``.
        start_error: the same for this level's own reproduction of A (a: A
            itself; b: delta = 0; c: the real query / residual).
        source_mass: ``A'(S)``; ``moved_mass = A(S) - A'(S)``.
        certified_min_source_mass: a proven lower bound on ``A'(S)`` over every
            pattern of this level within tolerance (a: convex bound; b: what the
            bound B allows even ignoring the output); None where only a local
            search ran.
        pattern: ``(keys,)`` the reported ``A'`` (0 on masked keys).
        delta: ``(keys,)`` level b's perturbation (0 on masked keys).
        query: ``(d_head,)`` level c's post-rotation query.
        residual: ``(d_model,)`` c-residual's residual.
        extra: per level: ``target_set`` (the keys whose mass was minimised;
            the source set unless ``objective="tv"``); a: ``duality_gap``,
            ``newton_steps``; b: ``bound_only_min_set_mass``; c:
            ``query_reachable``, ``reach_ratio`` (below 1: some residual of the
            real residual's scale produces the query), ``query_norm_ratio``;
            c-residual: ``construction_error``, ``residual_rms_ratio``,
            ``residual_cosine_to_real``.

    ``moved_mass``, ``source_mass`` and ``certified_min_source_mass`` always
    refer to the source set S, whatever the objective.
    """

    level: str
    constraint: str
    parameters: dict
    ran: bool = True
    reason: str | None = None
    feasible: bool = False
    alternative: bool = False
    output_error: float = 0.0
    start_error: float = 0.0
    source_mass: float = 0.0
    moved_mass: float = 0.0
    moved_fraction: float = 0.0
    total_variation: float = 0.0
    kl_new_to_real: float | None = 0.0
    kl_real_to_new: float | None = 0.0
    certified_min_source_mass: float | None = None
    search: str = ""
    statement: str = ""
    pattern: torch.Tensor | None = field(default=None, repr=False)
    delta: torch.Tensor | None = field(default=None, repr=False)
    query: torch.Tensor | None = field(default=None, repr=False)
    residual: torch.Tensor | None = field(default=None, repr=False)
    extra: dict = field(default_factory=dict)

    def to_dict(self, tensors: bool = True) -> dict:
        out = {}
        for k, v in self.__dict__.items():
            if isinstance(v, torch.Tensor):
                if tensors:
                    out[k] = v.tolist()
            elif isinstance(v, float):
                out[k] = jsonable(v)
            else:
                out[k] = jsonable(v) if k == "extra" else v
        return out

    @classmethod
    def from_dict(cls, d: dict) -> LevelResult:
        """The inverse of :meth:`to_dict` (tensors back as float64; absent ones stay None)."""
        lv = from_dict_fields(cls, d)
        for name in ("pattern", "delta", "query", "residual"):
            if getattr(lv, name) is not None:
                setattr(lv, name, torch.tensor(getattr(lv, name), dtype=torch.float64))
        return lv


@dataclass
class NonuniqueResult:
    """Alternative patterns for one head at one query position, side by side.

    Attributes:
        sources: the key indices of the set mass is moved off (S).
        real_source_mass: ``A(S)``.
        null_dimension: ``(allowed keys - 1) - rank(centred values)``: the
            dimension of the patterns that give exactly ``o`` (before the
            simplex); 0 means only A gives it exactly.
        checks: exactness of the inputs: the real output rebuilt from A and the
            values against the captured z; the pattern rebuilt from the scores.
        levels: one :class:`LevelResult` per level (and per score bound).
        verdict: what the result says about a routing claim (a sentence).
        does_not_say: what it does not.
        component, region, model, input: the header of a search on one input
            (:func:`core.methods.nonunique.nonunique_of_input`; None otherwise): the
            head's name, the source set (``rule``, ``mask``, ``cover``, ``share``,
            ``visual_tokens``, ``keys``), the model and the input. The JSON puts them last.
    """

    block: int | None
    block_name: str | None
    head: int | None
    position: int | None
    space: str
    objective: str
    tol: float
    min_moved: float
    sources: list[int]
    real_source_mass: float
    real_entropy: float
    real_argmax: int
    n_keys: int
    n_allowed: int
    null_dimension: int
    checks: dict
    levels: list[LevelResult]
    verdict: str
    does_not_say: str
    cancelled: bool = False
    audit: AuditRecord = field(repr=False, default=None)
    component: str | None = None
    region: dict | None = None
    model: dict | None = None
    input: dict | None = None

    @property
    def region_rule(self) -> str | None:
        """How the source set was chosen (the header's ``region.rule``), None without a header."""
        return self.region["rule"] if self.region is not None else None

    def level(self, name: str) -> LevelResult:
        """The first level result called ``name`` ("a", "b", "c-query", "c-residual")."""
        for lv in self.levels:
            if lv.level == name:
                return lv
        raise KeyError(name)

    kind = "nonunique"  # the session's run kind (core.results.readout.Readout)

    def to_dict(self, tensors: bool = True) -> dict:
        """The ``nonunique`` JSON (schema version 1): this result's fields, each level's, the audit row."""
        out = {"schema_version": SCHEMA_VERSION, "kind": self.kind}
        out.update(jsonable({k: v for k, v in self.__dict__.items() if k not in ("levels", "audit", *HEADER)}))
        out["levels"] = [lv.to_dict(tensors) for lv in self.levels]
        out["audit"] = self.audit.to_dict() if self.audit is not None else None
        out.update(jsonable({k: getattr(self, k) for k in HEADER if getattr(self, k) is not None}))
        return out

    @classmethod
    def from_dict(cls, d: dict) -> NonuniqueResult:
        """The inverse of :meth:`to_dict` (a stored JSON may hold more keys: the CLI's header)."""
        res = from_dict_fields(cls, d)
        res.levels = [LevelResult.from_dict(lv) for lv in d["levels"]]
        res.audit = AuditRecord.from_dict(d["audit"]) if d.get("audit") is not None else None
        return res

    def summary(self) -> str:
        """One line: the real mass on the set, then per level the mass moved (* = an
        alternative) and, where proven, the least mass any pattern within tolerance keeps."""
        parts = []
        for lv in self.levels:
            name = f"b(B={lv.parameters['score_bound']:g})" if lv.level == "b" else lv.level
            if not lv.ran:
                parts.append(f"{name} not run")
                continue
            bound = "" if lv.certified_min_source_mass is None else f" (keeps >= {lv.certified_min_source_mass:.3f})"
            parts.append(f"{name} moves {lv.moved_mass:.3f}{'*' if lv.alternative else ''}{bound}")
        return (
            f"{self.block_name}.H{self.head} at position {self.position}: {self.real_source_mass:.3f} on "
            f"{len(self.sources)} keys, tolerance {self.tol:g}; " + "; ".join(parts)
        )

    def parameters(self) -> dict:
        """The head's block name, the audit row's parameters and, for a search on one input, how its
        source set was chosen (``region_rule``)."""
        rule = {} if self.region is None else {"region_rule": self.region_rule}
        return {"block_name": self.block_name, **(self.audit.parameters if self.audit is not None else {}), **rule}

    def audit_records(self) -> list[AuditRecord]:
        return [self.audit] if self.audit is not None else []


def needed_mass(real: float, min_moved: float) -> float:
    """The mass an alternative must move off the set: ``min_moved``, or half the
    set's mass when the set holds less than ``2 min_moved``."""
    return min(min_moved, 0.5 * real)


def fill_level(
    problem: HeadProblem, lv: LevelResult, P: torch.Tensor, target: torch.Tensor, tol: float, min_moved: float
) -> LevelResult:
    src = problem.sources
    real = float(problem.pattern[src].sum())
    lv.pattern = P.detach().clone()
    lv.output_error = problem.relative_error(P)
    lv.feasible = lv.output_error <= tol
    lv.source_mass = float(P[src].sum())
    lv.moved_mass = real - lv.source_mass
    lv.moved_fraction = lv.moved_mass / real if real > 0 else 0.0
    lv.total_variation = 0.5 * float((P - problem.pattern).abs().sum())
    lv.kl_new_to_real = kl_divergence(P, problem.pattern)
    lv.kl_real_to_new = kl_divergence(problem.pattern, P)
    lv.alternative = bool(lv.feasible and real > 0 and lv.moved_mass >= needed_mass(real, min_moved))
    if not torch.equal(target, src):
        lv.extra["target_set_mass_moved"] = float(problem.pattern[target].sum() - P[target].sum())
    return lv


def level_statement(lv: LevelResult, real: float, tol: float, min_moved: float) -> str:
    if not lv.ran:
        return f"not run: {lv.reason}"
    moved = f"{lv.moved_mass:.3f} of the {real:.3f} on the set ({lv.moved_fraction:.0%})"
    err = f"output error {lv.output_error:.2%}, tolerance {tol:.0%}"
    need = f"{needed_mass(real, min_moved):.3f}"
    if lv.level == "a":
        bound = lv.certified_min_source_mass
        proof = f"proven: every pattern within tolerance keeps at least {bound:.3f} on the set"
        if lv.alternative:
            return (
                f"(a) simplex and mask only: a distribution over the allowed keys moves {moved} and reproduces "
                f"the head's output ({err}); {proof}. The output alone does not pin this routing; this level "
                "says nothing about whether any query could produce that pattern."
            )
        return (
            f"(a) simplex and mask only: no pattern within tolerance moves {need} or more off the set ({proof}, "
            f"of {real:.3f}); at this tolerance the head's output pins the mass on the set."
        )
    if lv.level == "b":
        B = lv.parameters["score_bound"]
        cap = f"even ignoring the output, scores within +/-{B:g} keep at least {lv.certified_min_source_mass:.3f}"
        if lv.alternative:
            return (
                f"(b) scores within +/-{B:g} logits of the real ones: softmax(s + delta) moves {moved} ({err}); "
                f"found by a local search, so at least this much is possible at this level ({cap})."
            )
        return (
            f"(b) scores within +/-{B:g} logits: the local search found no perturbation moving {need} or more "
            f"within tolerance (best: {moved}); not a proof that none exists ({cap})."
        )
    reach = lv.extra.get("query_reachable")
    if lv.level == "c-residual":
        how = "a residual at this position, through the real norm, W_Q, b_Q and rotation,"
    elif reach:
        how = "a free query vector that some residual can produce (reachable),"
    elif reach is False:
        how = "a free query vector that no residual can produce (outside the norm's reach),"
    else:
        how = "a free query vector (reachability not mapped for this family),"
    if lv.alternative:
        return (
            f"(c) {how} with the keys as computed, moves {moved} ({err}); found by a local search, so at "
            "least this much is possible."
        )
    return (
        f"(c) {how} with the keys as computed: the local search found none moving {need} or more within "
        f"tolerance (best: {moved}); not a proof that none exists."
    )


def result_summary(levels: list[LevelResult], real: float, tol: float) -> str:
    def alt(name):
        return [lv for lv in levels if lv.level == name and lv.ran and lv.alternative]

    legal = alt("c-residual") + [lv for lv in alt("c-query") if lv.extra.get("query_reachable")]
    lv_a = [lv for lv in levels if lv.level == "a" and lv.ran]
    if legal:
        best = max(legal, key=lambda lv: lv.moved_mass)
        head = (
            "The head's output does not require this routing"
            if best.moved_fraction >= 0.5
            else "The head's output pins this routing only in part"
        )
        floor = (
            f" (and, proven at level a, no pattern within {tol:.0%} keeps less than "
            f"{lv_a[0].certified_min_source_mass:.3f} on it)"
            if lv_a
            else ""
        )
        return (
            f"{head}: a query the model could form (keys as computed) gives an output within {tol:.0%} that puts "
            f"{best.moved_mass:.3f} less mass on the set ({best.moved_fraction:.0%} of {real:.3f}){floor}. A "
            "claim resting on what the head writes cannot use the moved share of the mass as evidence that the "
            "set is needed; a claim about where the head routes on this input (the pattern's reality) is untouched."
        )
    if alt("c-query"):
        return (
            "A free query vector gives an equally good output with the mass elsewhere, but no residual could "
            "produce the queries found (outside the norm's reach), and the residual-level search found no legal "
            "one: only non-legal alternatives exist at level (c)."
        )
    if alt("b"):
        return (
            "Bounded score perturbations give an equally good output with less mass on the set, but no legal "
            "query was found that does (local search): the output does not pin the routing; the model's keys "
            "and reachable queries may."
        )
    if alt("a"):
        return (
            "Only level (a) alternatives exist: some distribution over the allowed keys reproduces the output "
            "with less mass on the set, but no bounded-score or legal-query alternative was found (local "
            "search). The output does not pin the pattern mathematically; the model's scores and keys constrain it."
        )
    if lv_a:
        bound = lv_a[0].certified_min_source_mass
        return (
            f"No alternative even at level (a): every pattern reproducing the head's output within {tol:.0%} "
            f"keeps at least {bound:.3f} of the {real:.3f} on the set (proven). Here the output implies the routing."
        )
    return "No alternative found at the levels run (local searches; level (a) was not run)."


DOES_NOT_SAY = (
    "It does not say which pattern the model 'should' use, that the source set causes the output or the "
    "answer, or what later components need: A is still the pattern the model computed on this input, and "
    "whether the routing matters is a question for ablation or patching of the head or the edge."
)


def nonunique_audit(
    problem: HeadProblem,
    *,
    tol: float,
    bounds: Sequence[float],
    objective: str,
    min_moved: float,
    seed: int,
    levels: Sequence[str],
) -> AuditRecord:
    """The audit row of one search: its controls, what it ran with, its caveats."""
    p = problem
    return AuditRecord.for_method(
        "non-unique attention",
        controls=[
            "simplex and the model's mask (level a)",
            f"scores bounded by +/-{', '.join(f'{b:g}' for b in bounds)} logits around the real ones (level b)",
            "legal query: keys as computed; free query with a reachability check, and queries reachable from a "
            "residual through the real norm, W_Q, b_Q and rotation (level c)",
            f"output error in the {'head-write (W_O z)' if p.space == 'write' else p.space} space, relative to the "
            "head's full output (b_V included)",
        ],
        parameters={
            "block": p.block,
            "head": p.head,
            "position": p.position,
            "sources": p.sources.nonzero().flatten().tolist(),
            "tol": tol,
            "score_bounds": list(bounds),
            "objective": objective,
            "min_moved": min_moved,
            "seed": seed,
            "levels": list(levels),
        },
        notes=[
            "level a is convex (its bound is proven); levels b and c are local searches: an alternative found "
            "is real, a missing one is not proof that none exists",
            "A is still the pattern the model computed; an equally good alternative says the output does not pin "
            "the routing, not that the routing is unused",
        ]
        + list(p.notes),
    )
