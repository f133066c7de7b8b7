"""The search: every requested level over one :class:`HeadProblem`, side by side
(:func:`solve`), and :func:`nonunique_attention`, a trace's head straight to its
result."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from core.errors import InterventionError
from core.methods.nonunique.level_a import run_level_a
from core.methods.nonunique.level_b import run_level_b
from core.methods.nonunique.level_c import run_c_query, run_c_residual
from core.methods.nonunique.local_search import SearchSettings
from core.methods.nonunique.problem import HeadProblem, head_problem
from core.methods.nonunique.results import (
    DOES_NOT_SAY,
    LEVEL_NAMES,
    LevelResult,
    NonuniqueResult,
    fill_level,
    level_statement,
    nonunique_audit,
    result_summary,
)


def target_sets(problem: HeadProblem, objective: str) -> list[torch.Tensor]:
    """The ``(keys,)`` bool sets whose mass each level minimises: the source set
    ("mass"), or ("tv") the top-k keys of A for k = 1, 2, 4, 8 below the number
    of allowed keys, and the source set unless it is one of those."""
    p = problem
    if objective != "tv":
        return [p.sources]
    n_allowed = int(p.allowed.sum())
    order = p.pattern.masked_fill(~p.allowed, -1.0).argsort(descending=True)
    targets = []
    for k in (1, 2, 4, 8):
        if k < n_allowed:
            m = torch.zeros_like(p.allowed)
            m[order[:k]] = True
            targets.append(m)
    if not any(torch.equal(t, p.sources) for t in targets):
        targets.append(p.sources.clone())
    return targets


@torch.no_grad()
def solve(
    problem: HeadProblem,
    *,
    tol: float = 0.05,
    score_bounds: float | Sequence[float] = (1.0, 2.0),
    levels: Sequence[str] = ("a", "b", "c-query", "c-residual"),
    objective: str = "mass",
    min_moved: float = 0.05,
    seed: int = 0,
    steps: int = 150,
    gap: float = 1e-7,
    progress: Callable[[int, int, str], None] | None = None,
    cancel: Callable[[], bool] | None = None,
) -> NonuniqueResult:
    """Search alternative patterns at each level (see the package docstring).

    Args:
        tol: relative output error an alternative may have.
        score_bounds: level b's bound(s) B on ``|delta|`` in logit units; one row per bound.
        levels: which of "a", "b", "c-query", "c-residual" to run.
        objective: "mass" (least mass on the source set) or "tv" (the largest
            total variation from A: the least mass on each top-k set of A,
            k = 1, 2, 4, 8, and on the source set; the largest TV kept).
        min_moved: the mass an alternative must move off the set to count as
            one (half the set's mass when the set holds less than twice this).
        seed: seeds the extra random start of levels b and c.
        steps: optimiser steps per penalty stage (4 stages per start, 2-3 starts).
        gap: level a's target duality gap (mass units) between the achieved
            ``A'(S)`` and its proven lower bound.
        progress: ``progress(done, total, message)`` after each level.
        cancel: returns True to stop; levels done so far are kept.
    """
    if objective not in ("mass", "tv"):
        raise InterventionError(f"objective must be 'mass' or 'tv', not {objective!r}")
    if not tol > 0:
        raise InterventionError("the tolerance must be positive")
    unknown = [lv for lv in levels if lv not in LEVEL_NAMES]
    if unknown:
        raise InterventionError(f"unknown levels {unknown}; choose from {list(LEVEL_NAMES)}")
    bounds = [float(score_bounds)] if isinstance(score_bounds, (int, float)) else [float(b) for b in score_bounds]
    if any(not b >= 0 for b in bounds):
        raise InterventionError("score bounds must be non-negative")
    p = problem
    if float(p.output.norm()) == 0:
        raise InterventionError("the head's output is zero here: a relative output error is undefined")
    idx = p.allowed.nonzero().flatten()
    n_allowed = len(idx)
    real = float(p.pattern[p.sources].sum())
    targets = target_sets(p, objective)
    plan = []
    for name in LEVEL_NAMES:  # c-query runs before c-residual: its query (pulled into reach) seeds the legal search
        if name in levels:
            plan += [("b", b) for b in bounds] if name == "b" else [(name, None)]
    results: dict[tuple, LevelResult] = {}
    free_queries: dict[int, torch.Tensor] = {}
    cancelled = False
    for done, (name, B) in enumerate(plan):
        if cancel is not None and cancel():
            cancelled = True
            break
        runs = []
        for ti, target in enumerate(targets):
            generator = torch.Generator().manual_seed(int(seed))  # the same starts for every target set
            lv = LevelResult(name, LEVEL_NAMES[name], {"score_bound": B} if name == "b" else {})
            lv.extra["target_set"] = target.nonzero().flatten().tolist()
            settings = SearchSettings(tol, steps, generator, cancel)
            if name == "a":
                P = run_level_a(p, lv, target, tol=tol, gap=gap, cancel=cancel)
            elif name == "b":
                P = run_level_b(p, lv, target, settings, bound=B)
            elif name == "c-query":
                P = run_c_query(p, lv, target, settings)
                free_queries[ti] = lv.query
            else:
                P = run_c_residual(p, lv, target, settings, free_query=free_queries.get(ti))
                if P is None:  # not mapped for this family: reported as not run
                    runs.append(lv)
                    continue
            if lv.query is not None:
                lv.extra["query_norm_ratio"] = float(lv.query.norm() / p.query.norm().clamp_min(1e-300))
            runs.append(fill_level(p, lv, P, target, tol, min_moved))
        ran = [r for r in runs if r.ran]
        if objective == "tv" and ran:
            lv = max((r for r in ran if r.feasible), key=lambda r: r.total_variation, default=ran[0])
            on_src = runs[[torch.equal(t, p.sources) for t in targets].index(True)]
            lv.certified_min_source_mass = on_src.certified_min_source_mass  # proven for every pattern
        else:
            lv = runs[0]
        lv.statement = level_statement(lv, real, tol, min_moved)
        results[(name, B)] = lv
        if progress is not None:
            progress(done + 1, len(plan), f"level {name}" + (f" (B={B:g})" if B is not None else ""))
    plan_out = [item for item in plan if item in results]
    plan_out.sort(key=lambda item: (list(levels).index(item[0]), bounds.index(item[1]) if item[0] == "b" else 0))
    out = [results[item] for item in plan_out]
    V = p.values[idx]
    rank = int(torch.linalg.matrix_rank(V - V.mean(0, keepdim=True), rtol=1e-10)) if n_allowed > 1 else 0
    A_allowed = p.pattern[idx]
    pos_a = A_allowed[A_allowed > 0]
    audit = nonunique_audit(
        p, tol=tol, bounds=bounds, objective=objective, min_moved=min_moved, seed=seed, levels=levels
    )
    return NonuniqueResult(
        p.block,
        p.block_name,
        p.head,
        p.position,
        p.space,
        objective,
        tol,
        min_moved,
        p.sources.nonzero().flatten().tolist(),
        real,
        float(-(pos_a * pos_a.log()).sum()),
        int(idx[A_allowed.argmax()]) if n_allowed else -1,
        int(p.pattern.shape[0]),
        n_allowed,
        max(n_allowed - 1 - rank, 0),
        dict(p.checks),
        out,
        result_summary(out, real, tol),
        DOES_NOT_SAY,
        cancelled,
        audit,
    )


# head_problem's keywords; every other keyword of nonunique_attention goes to solve
PROBLEM_KEYWORDS = ("position", "sources", "space", "batch")


def nonunique_attention(adapter, trace, block: int, head: int, *position_and_sources, **options) -> NonuniqueResult:
    """:func:`head_problem` then :func:`solve`: ``position``, ``sources``
    (positionally after ``head``, or by name), ``space`` and ``batch`` are
    head_problem's; every other keyword goes to :func:`solve`.

    Example::

        tr = capture(loaded, image, question)               # every block, the answer position
        keys = visual_token_keys(tr, block, region_tokens(tokens, mask))
        res = nonunique_attention(loaded.adapter, tr, block, head, sources=keys)
        for lv in res.levels: print(lv.level, lv.feasible, lv.moved_mass, lv.statement)
    """
    problem_options = {k: options.pop(k) for k in PROBLEM_KEYWORDS if k in options}
    problem = head_problem(adapter, trace, block, head, *position_and_sources, **problem_options)
    return solve(problem, **options)
