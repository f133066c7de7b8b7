"""The seven steps of docs/METHODS.md §4.11 on one candidate head or route
(:func:`step1_pattern` ... :func:`step7_side_effects`, :data:`STEP_FUNCTIONS`),
and :func:`run_chain`, which runs them into a :class:`ValidationChain`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from core.methods.patterns import Distribution
from core.methods.validation.chain import Baseline, ChainStep, ValidationChain
from core.methods.validation.context import ChainContext, _audit, _baselines, _group_values
from core.methods.validation.observations import ChainCancelled
from core.methods.validation.setting import (
    REGION_MIN_COVER,
    HeadRef,
    RouteRef,
    Subject,
    _members,
)
from core.methods.validation.spec import KEY_WORDS, QUERY_WORDS, SOURCE_WORDS, metric_words
from core.methods.validation.stats import _lower, _pearson, _spearman, _stats, fisher_lower, poisson_binomial_tail


def content_values(ctx: ChainContext) -> np.ndarray:
    """``(n, columns)`` step 2's per-sample metric on the evaluation split: the sources'
    DLA (answer and copy claims), or :meth:`HeadObservations.quiet` (a quiet sink)."""
    obs = ctx.eval_obs
    return obs.quiet() if ctx.spec.content == "quiet" else obs.region_sum(obs.dla, obs.sources)


def effect_values(ctx: ChainContext, subject: Subject) -> np.ndarray:
    """``(n,)`` step 5's per-sample metric: the mean-ablation drop in S, or the rise in the
    subject's z norm when its edges to the sources are cut."""
    return ctx.unparked(subject) if ctx.spec.effect == "unparks" else ctx.drop([subject], "mean")


def key_name(ctx: ChainContext, slot: int) -> str:
    return f"visual token {slot}" if ctx.spec.on_image else f"position {slot}"


def fixed_position(ctx: ChainContext, plan) -> np.ndarray | None:
    """``(n,)`` 1 where the plan's fixed key is a source; None where it is one in every
    sample (a head that always attends there *is* the relation, not a baseline of it)."""
    fixed = np.array([float(plan.fixed_patch in t) for t in ctx.eval_obs.sources])
    return None if fixed.all() else fixed


def step1_pattern(ctx: ChainContext, cand: Subject) -> ChainStep:
    """The query row's argmax over the relation's keys on its sources, against chance, on the
    evaluation split (for the target object's tokens, the estimator of
    :func:`core.methods.patterns.pattern_statistics`, which is run beside it as a check)."""

    obs, plan = ctx.eval_obs, ctx.plan(cand)
    c = obs.col(cand)
    hits, chance_i = obs.hits(), obs.chance()
    n = obs.n
    k, rate, chance = float(hits[:, c].sum()), float(hits[:, c].mean()), float(chance_i.mean())
    # hits are a sum of Bernoulli(p_i) under a uniform head: mean sum p_i, variance sum p_i (1 - p_i)
    z = (k - chance_i.sum()) / math.sqrt(max(float((chance_i * (1 - chance_i)).sum()), 1e-12))
    p_value = poisson_binomial_tail(int(round(k)), chance_i)
    passed = rate >= ctx.spec.hit_ratio * chance and p_value <= ctx.spec.hit_p
    groups = _group_values(ctx, plan, lambda h: hits[:, obs.col(h)])
    groups.append(("position: uniform", [f"uniform over {KEY_WORDS[ctx.spec.on_image]}"], chance_i))
    fixed = fixed_position(ctx, plan)
    if fixed is not None:
        groups.append(("position: fixed patch", [key_name(ctx, plan.fixed_patch)], fixed))
    mass = obs.region_sum(obs.attn, obs.sources)[:, c]
    numbers = {
        "hit_rate": rate,
        "chance_hit_rate": chance,
        "ratio_to_chance": rate / chance if chance else None,
        "z_vs_chance": z,
        "p_value_vs_chance": p_value,
        "target_mass": Distribution.of(mass, value_range=(0.0, 1.0)).to_dict(),
        "entropy": Distribution.of(obs.entropy[:, c]).to_dict(),
        "search_split": ctx.search_condition.split,
        "per_sample": {"sample": ctx.eval_ids(), "hit": hits[:, c], "target_mass": mass, "chance": chance_i},
    }
    notes = ["a hit rate above chance is a routing regularity on this distribution, not evidence the head is used"]
    if fixed is None:
        notes.append(f"no fixed-position baseline: {key_name(ctx, plan.fixed_patch)} is a source in every sample")
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
            (
                "argmax over patch tokens only (sink, delimiters, text excluded)"
                if ctx.spec.on_image
                else "argmax over every key up to the query (the causal row)"
            ),
            (
                f"target tokens: box covered >= {REGION_MIN_COVER:g} by the ground-truth mask"
                if ctx.spec.on_image
                else f"sources: {SOURCE_WORDS[ctx.spec.sources]}, read from the token ids"
            ),
            "chance = a uniform head's hit probability, per sample",
            "evaluation split held out from the search split",
            "matched random / same-layer / entropy-matched heads and fixed-patch position baseline",
        ],
        {
            "n": n,
            "split": obs.split,
            "search_split": ctx.search_condition.split,
            "head": cand.name,
            "query": ctx.spec.query,
            "sources": ctx.spec.sources,
        },
        notes[:1],
    )
    why = (
        f"hit rate {rate:.3f} vs chance {chance:.3f} (x{rate / chance if chance else float('nan'):.1f}, z={z:.1f}, "
        f"exact p={p_value:.2g})"
    )
    return ChainStep(
        1,
        ctx.criteria[1],
        "passed" if passed else "failed",
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
    """The content claim: frozen-scale DLA (S's answer minus foil) from the sources versus the
    strongest distractor; for a quiet sink, the sources' write per unit of attention against
    the other keys'."""
    if ctx.spec.content == "quiet":
        return _step2_quiet(ctx, cand)
    obs, plan = ctx.eval_obs, ctx.plan(cand)
    target = content_values(ctx)
    dmax = obs.distractor_max(obs.dla)
    c = obs.col(cand)
    t_st, diff_st = _stats(target[:, c]), _stats(target[:, c] - dmax[:, c])
    contrasted = diff_st["n"] > 0
    passed = _lower(t_st) > 0 and (_lower(diff_st) > 0 if contrasted else True)
    groups = _group_values(ctx, plan, lambda h: target[:, obs.col(h)])
    bg = obs.region_sum(obs.dla, obs.background)
    scale = np.array([len(t) / len(b) if b else np.nan for t, b in zip(obs.sources, obs.background)])
    groups.append(("position: background tokens", ["the other keys, scaled to the sources' count"], bg[:, c] * scale))
    mass = obs.region_sum(obs.attn, obs.sources)[:, c]
    toward = "answer minus foil" if ctx.spec.content == "answer" else "the source token minus a foil word"
    audit = _audit(
        "source contribution",
        [
            "value path as computed (biases included)",
            f"{ctx.loaded.adapter.frozen_convention} (dla_frozen)",
            f"signed, toward {toward}",
            (
                "target versus the strongest distractor region, per sample"
                if ctx.spec.on_image
                else "sources versus the strongest other single key, per sample"
            ),
            "background-token position baseline",
        ],
        {"n": obs.n, "split": obs.split, "region_min_cover": REGION_MIN_COVER, "head": cand.name},
        [
            "a positive direct write from the target does not show later layers keep it (see steps 3 and 5)",
            "a source is the stream at that token as the head's block reads it: in a self-attention model, "
            "earlier layers may already have mixed other positions into it",
        ],
    )
    why = f"sources' DLA {t_st['mean']:.3g} (95% lower {_lower(t_st):.3g}); " + (
        f"minus the strongest distractor {diff_st['mean']:.3g} (95% lower {_lower(diff_st):.3g})"
        if contrasted
        else "no distractor to contrast with"
    )
    return ChainStep(
        2,
        ctx.criteria[2],
        "passed" if passed else "failed",
        "target DLA" if ctx.spec.on_image else "source DLA",
        t_st["mean"],
        t_st["n"],
        obs.split,
        {
            "target_dla": t_st,
            "strongest_distractor_dla": _stats(dmax[:, c]),
            "target_minus_distractor": diff_st,
            "target_dla_per_token": _stats(target[:, c] / np.maximum([len(t) for t in obs.sources], 1)),
            "target_attention_mass": _stats(mass),
            "share_of_head_dla_from_target": _stats(
                target[:, c] / np.where(obs.head_dla[:, c] == 0, np.nan, obs.head_dla[:, c])
            ),
        },
        _baselines(groups, obs.n),
        audit,
        [] if contrasted else ["no sample had a distractor: the contrast with one was not made"],
        why=why,
    )


def _step2_quiet(ctx: ChainContext, cand: Subject) -> ChainStep:
    obs, plan = ctx.eval_obs, ctx.plan(cand)
    quiet = content_values(ctx)
    c = obs.col(cand)
    st = _stats(quiet[:, c])
    passed = _lower(st) > 0
    groups = _group_values(ctx, plan, lambda h: quiet[:, obs.col(h)])
    audit = _audit(
        "source contribution",
        [
            "write = the norm of each key's value through W_O, times its attention (value path as computed)",
            "per unit of attention: summed write over summed attention, sources against every other key",
            "log ratio per sample; samples with no attention on either side left out",
        ],
        {"n": obs.n, "split": obs.split, "head": cand.name, "sources": ctx.spec.sources},
        ["a quiet sink writes little per unit of attention; it does not show the attention there is unused"],
    )
    mass = obs.region_sum(obs.attn, obs.sources)[:, c]
    why = f"log(other keys' write / sources' write) per unit attention {st['mean']:.3g} (95% lower {_lower(st):.3g})"
    return ChainStep(
        2,
        ctx.criteria[2],
        "passed" if passed else "failed",
        "log write ratio",
        st["mean"],
        st["n"],
        obs.split,
        {"log_write_ratio": st, "source_attention_mass": _stats(mass), "n_undefined": int(obs.n - st["n"])},
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
    r_lower = fisher_lower(r, obs.n)
    same_sign = np.sign(x.mean()) == np.sign(y.mean())
    passed = bool(np.isfinite(r) and r >= ctx.spec.prediction_r and r_lower > 0 and same_sign)
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
            "actual re-run: the head's z zeroed at the query, later layers recomputed",
            metric_words(ctx.spec),
            "per-sample correlation on the evaluation split",
        ],
        {"n": obs.n, "split": obs.split, "head": cand.name, "edited_positions": QUERY_WORDS[ctx.spec.query]},
        ["zero ablation moves activations off their distribution; the re-run is one intervention"],
    )
    why = (
        f"r={r:.2f} (Fisher 95% lower {r_lower:.2f}; rho={rho:.2f}); mean DLA {x.mean():.3g} vs mean re-run drop "
        f"{y.mean():.3g}"
    )
    return ChainStep(
        3,
        ctx.criteria[3],
        "passed" if passed else "failed",
        "Pearson r",
        r,
        obs.n,
        obs.split,
        {
            "pearson_r": r,
            "pearson_r_lower95": r_lower,
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


SWAP_CONTROLS = {
    "attribute_swap": [
        "paired scenes: same question, geometry and other objects; only the asked attribute moved",
        "mass on the union of the old and redrawn ink at each location",
        "tokens touching both locations left out",
    ],
    "shift": [
        "paired inputs: one seeded word (absent from the input) inserted before the sources' anchor",
        "the longer question must tokenize as the same tokens plus one (else left out, counted)",
        "a = the sources' position before, b = after the insertion",
    ],
    "other_image": [
        "paired inputs: the same question under a seeded other input's image",
        "the sources relocated in the new input (the image's token count may differ)",
        "metric: mass kept on the sources minus a uniform head's share",
    ],
}


def step4_swap(ctx: ChainContext, cand: Subject) -> ChainStep:
    """Step 4's counterfactual: does the attention follow the sources when they move (the
    attribute swapped onto another object, a word inserted before them), or stay on them
    when what surrounds them changes (another image)?"""
    if ctx.spec.counterfactual == "attribute_swap" and ctx.swap is None:
        return ChainStep(
            4, ctx.criteria[4], "not tested", notes=["the context was built without a swap (ChainContext(swap=...))"]
        )
    sw, plan = ctx.swap_obs, ctx.plan(cand)
    m = len(sw.rows)
    if m == 0:
        why = "; ".join(f"{k}: {v}" for k, v in sw.unreadable_reasons.items())
        return ChainStep(
            4,
            ctx.criteria[4],
            "not tested",
            notes=["no evaluation sample admitted a counterfactual" + (f" ({why})" if why else "")],
        )
    c = sw.col(cand)
    moved, follows = sw.moved(), sw.follows()
    st = _stats(moved[:, c])
    rate = float(follows[:, c].mean())
    passed = _lower(st) > 0 and rate >= ctx.spec.follow_rate
    groups = _group_values(ctx, plan, lambda h: moved[:, sw.col(h)])
    notes = []
    if not sw.stays:
        groups.append(("position: fixed patch", [key_name(ctx, plan.fixed_patch)], np.zeros(m)))
        notes.append("the fixed-position baseline cannot move: its shift is 0 by construction")
    audit = _audit(
        "pattern analysis",
        SWAP_CONTROLS[ctx.spec.counterfactual],
        {
            "n_swapped": m,
            "n_tried": sw.n_tried,
            "split": ctx.eval_condition.split,
            "head": cand.name,
            "counterfactual": ctx.spec.counterfactual,
        },
        ["a pattern that follows the sources is routing sensitivity, not the counterfactual's effect on the answer"],
    )
    what = "stay rate" if sw.stays else "follow rate"
    why = f"{what} {rate:.2f}; mean {'kept mass' if sw.stays else 'mass shift'} {st['mean']:.3g} (95% lower {_lower(st):.3g})"
    return ChainStep(
        4,
        ctx.criteria[4],
        "passed" if passed else "failed",
        what,
        rate,
        m,
        ctx.eval_condition.split,
        {
            "follow_rate": rate,
            "mass_shift" if not sw.stays else "kept_mass_over_uniform": st,
            "mass_target_location_before": _stats(sw.mass_a_orig[:, c]),
            "mass_target_location_after": _stats(sw.mass_a_swap[:, c]),
            "mass_partner_location_before": _stats(sw.mass_b_orig[:, c]),
            "mass_partner_location_after": _stats(sw.mass_b_swap[:, c]),
            "model_follows_swap_accuracy": None if sw.stays else float(sw.swap_correct.mean()),
            "model_swap_logit_diff": _stats(sw.swap_logit_diff),
            "n_tried": sw.n_tried,
            "n_unreadable": sw.n_unreadable,
            "pairs": [
                {
                    "sample": ctx.eval_ids()[i],
                    "mass_target_before": float(sw.mass_a_orig[r, c]),
                    "mass_target_after": float(sw.mass_a_swap[r, c]),
                    "mass_partner_before": float(sw.mass_b_orig[r, c]),
                    "mass_partner_after": float(sw.mass_b_swap[r, c]),
                    "follows": bool(follows[r, c]),
                }
                for r, i in enumerate(sw.rows)
            ],
        },
        _baselines(groups, m),
        audit,
        notes,
        why=why,
    )


def step5_ablation(ctx: ChainContext, cand: Subject) -> ChainStep:
    """The predicted effect: zero and mean ablation of the subject at the query (or, for a
    parked head, its z norm when its edges to the sources are cut)."""
    if ctx.spec.effect == "unparks":
        return _step5_unparks(ctx, cand)
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
            f"edited at the {QUERY_WORDS[ctx.spec.query]} only",
            metric_words(ctx.spec),
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
        ctx.criteria[5],
        "passed" if passed else "failed",
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
            "per_sample": {"sample": ctx.eval_ids(), "drop_mean": mean_drop, "drop_zero": zero_drop},
        },
        _baselines(groups, n),
        audit,
        why=why,
    )


def _step5_unparks(ctx: ChainContext, cand: Subject) -> ChainStep:
    plan = ctx.plan(cand)
    rise = effect_values(ctx, cand)
    n = len(rise)
    st = _stats(rise)
    passed = _lower(st) > 0
    groups = _group_values(ctx, plan, lambda h: effect_values(ctx, h))
    audit = _audit(
        "functional label",
        [
            "the subject's edges from the query to the sources knocked out before the softmax (renormalised "
            "over the other keys), its heads alone",
            "metric: the norm of the subject's z at the query (a route: its heads' summed), cut minus as is",
        ],
        {"n": n, "split": ctx.eval_condition.split, "head": cand.name, "sources": ctx.spec.sources},
        ["a head that writes more once its sink is cut was parked there; it does not say what it would write"],
    )
    why = f"z norm rise when the edges to the sources are cut {st['mean']:.3g} (95% lower {_lower(st):.3g})"
    return ChainStep(
        5,
        ctx.criteria[5],
        "passed" if passed else "failed",
        "z norm rise",
        st["mean"],
        n,
        ctx.eval_condition.split,
        {
            "z_norm_rise": st,
            "mean_ablation_drop": _stats(ctx.drop([cand], "mean")),
            "per_sample": {"sample": ctx.eval_ids(), "z_norm_rise": rise},
        },
        _baselines(groups, n),
        audit,
        why=why,
    )


def step6_baselines(ctx: ChainContext, cand: Subject, chain: ValidationChain | None = None) -> ChainStep:
    """Paired comparisons of the candidate with every baseline on the step 1, 2, 4, 5 metrics."""
    obs, plan = ctx.eval_obs, ctx.plan(cand)
    hits = obs.hits()
    content = content_values(ctx)
    positions_1 = {"position: uniform": obs.chance()}
    fixed = fixed_position(ctx, plan)
    if fixed is not None:
        positions_1["position: fixed patch"] = fixed
    positions_2 = {}
    if ctx.spec.content != "quiet":
        bg = obs.region_sum(obs.dla, obs.background)
        scale = np.array([len(t) / len(b) if b else np.nan for t, b in zip(obs.sources, obs.background)])
        positions_2["position: background tokens"] = bg[:, obs.col(cand)] * scale
    metrics: dict[int, tuple[str, Callable, dict]] = {
        1: ("hit", lambda h: hits[:, obs.col(h)], positions_1),
        2: (
            "log write ratio" if ctx.spec.content == "quiet" else ("target DLA" if ctx.spec.on_image else "source DLA"),
            lambda h: content[:, obs.col(h)],
            positions_2,
        ),
        5: (
            "z norm rise" if ctx.spec.effect == "unparks" else "mean-ablation drop",
            lambda h: effect_values(ctx, h),
            {},
        ),
    }
    ran = {k for k, s in chain.steps.items() if s.status != "not tested"} if chain is not None else {1, 2, 4, 5}
    has_swap = ctx.spec.counterfactual != "attribute_swap" or ctx.swap is not None
    if 4 in ran and has_swap and len(ctx.swap_obs.rows):
        sw = ctx.swap_obs
        metrics[4] = (
            "kept mass" if sw.stays else "mass shift",
            lambda h: sw.moved()[:, sw.col(h)],
            {} if sw.stays else {"position: fixed patch": np.zeros(len(sw.rows))},
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
        return ChainStep(6, ctx.criteria[6], "not tested", notes=["no step 1, 2, 4 or 5 evidence to compare"])
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
        ctx.criteria[6],
        "passed" if passed else "failed",
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
            notes.append(
                f"not specific: mean ablation also moves {kind} questions by {d:.3g} (the claim's S: {task:.3g})"
            )
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
        ctx.criteria[7],
        "passed" if done else "not tested",
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


def run_chain(
    ctx: ChainContext, cand: Subject, search: dict | None = None, *, steps: Sequence[int] = tuple(range(1, 8))
) -> ValidationChain:
    """Run the steps on one candidate head or route; a cancelled run keeps what
    was done (the rest stays not tested)."""
    chain = ValidationChain(
        cand.name,
        ctx.spec.relation,
        ctx.loaded.spec,
        ctx.eval_condition,
        subject_kind="route" if isinstance(cand, RouteRef) else "head",
        search={k: v for k, v in (search or {"split": ctx.search_condition.split}).items() if k != "table"},
        criteria=dict(ctx.criteria),
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
            "distribution": ctx.eval_condition.describe(),
            "relation": ctx.spec.relation,
            "specification": ctx.spec.name,
            "n": ctx.eval_condition.n_samples,
            "model": ctx.loaded.spec,
            "fingerprint": getattr(ctx.loaded, "fingerprint", ""),
        },
        [
            "the label holds on its input condition only; outside it, it is a hypothesis",
            f"tested: {ctx.spec.relation!r} on {ctx.eval_condition.describe()}; {chain.steps_passed()}",
        ],
    )
    return chain
