"""What the steps share for one model (:class:`ChainContext`: the search and
evaluation samples, the observations of every visual-reading head and cached
edited runs, each computed on first use), and each candidate's controls
(:class:`BaselinePlan`; a route's baselines are routes of the same size).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from core.forward.edits import Edit
from core.methods.patterns import pattern_statistics
from core.methods.validation.chain import Baseline, InputCondition, LabelError, _finite
from core.methods.validation.observations import (
    ChainCancelled,
    HeadObservations,
    RunNumbers,
    SwapObservations,
    head_edit,
    mean_ablation_value,
    observe_counterfactuals,
    observe_heads,
    observe_swaps,
    run_edited,
    z_norms,
)
from core.methods.validation.relations import Row, Unreadable, answer_row, locate, other_image, prepared, shifted
from core.methods.validation.setting import REGION_MIN_COVER, HeadRef, RouteRef, Subject, _members, relation_heads
from core.methods.validation.spec import resolve
from core.methods.validation.stats import _stats
from core.results.audit import AuditRecord


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
        swap: ``swap(sample, seed)``, step 4's counterfactual of an evaluation
            sample (for the shape scenes :func:`core.zoo.label_scenes.swap_attribute`,
            which :func:`core.zoo.label_scenes.attribute_context` gives); without
            it step 4 is not run.
        progress: ``progress(done, total, message)``; cancel: returns True to stop.
        spec: the claim's specification (:func:`core.methods.validation.spec.resolve`):
            where each input is read (:func:`core.methods.validation.relations.locate`)
            and each step's variant and threshold.
        words: the words a relation may draw a foil word or an inserted word from (each
            must be one token of the model to be used).
        located: rows already located for some of the inputs, by ``id(input)`` (as
            :class:`core.validate.Reading` keeps them): not located again.
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
        swap: Callable | None = None,
        seed: int = 0,
        batch_size: int = 32,
        progress=None,
        cancel=None,
        spec=None,
        words: Sequence[str] = (),
        located: dict | None = None,
    ):
        if search_condition.split == eval_condition.split:
            raise LabelError("the evaluation split must differ from the search split (held-out inputs)")
        self.loaded = loaded
        self.search_samples, self.search_condition = list(search_samples), search_condition
        self.eval_samples, self.eval_condition = list(eval_samples), eval_condition
        self.side_samples = dict(side_samples or {})
        self.side_reference = dict(side_reference or {})
        self.swap = swap
        self.seed = seed
        self.batch_size = batch_size
        self.progress = progress
        self.cancel = cancel
        self.spec = resolve(spec)  # the claim specification: the relation and each step's thresholds
        self.criteria = self.spec.criteria()
        self.words = list(words)
        self._located = dict(located or {})  # rows already located, by input object (id)
        self.pool = relation_heads(loaded, self.spec)
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
                self.rows("search"),
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
                self.rows("eval"),
                self.pool,
                split=self.eval_condition.split,
                batch_size=self.batch_size,
                progress=self.progress,
                cancel=self.cancel,
            ),
        )

    def rows(self, which: str) -> list[Row]:
        """Where each input of ``which`` ("search", "eval", a side kind, or ``"reference:"``
        and a side kind) is read: the relation's rows for the claim's own inputs, the
        answer position (S: the line's answer minus its foil) for the other kinds."""

        def make():
            samples = self.samples(which)
            if which not in ("search", "eval"):
                return [answer_row(self.loaded.adapter, s, prepared(self.loaded.adapter, s)) for s in samples]
            out = []
            for s in samples:
                try:
                    out.append(self.locate(s))
                except Unreadable as e:
                    raise LabelError(f"{which} input {getattr(s, 'index', '?')}: {e} (leave it out first)") from None
            return out

        return self._get(("rows", which), make)

    def locate(self, sample) -> Row:
        """Where the specification is read on ``sample`` (:func:`core.methods.validation.relations.locate`)."""
        if id(sample) in self._located:  # located when the data was read: the same row
            return self._located[id(sample)]
        a = self.loaded.adapter
        return locate(a, self.spec, sample, prepared(a, sample), seed=self.seed, words=self.words)

    @property
    def swap_obs(self) -> SwapObservations:
        """Step 4's observations: the attribute swap (``swap``), or for a relation of the
        sequence's own tokens its inserted word or another input's image."""
        if self.spec.counterfactual != "attribute_swap":
            return self._get("swap_obs", self._counterfactual_obs)
        if self.swap is None:
            raise LabelError("this context has no swap (ChainContext(swap=...)): step 4 cannot be observed")
        return self._get(
            "swap_obs",
            lambda: observe_swaps(
                self.loaded, self.eval_samples, self.pool, swap=self.swap, seed=self.seed, cancel=self.cancel
            ),
        )

    def _counterfactual_obs(self) -> SwapObservations:
        a, samples, rows = self.loaded.adapter, self.eval_samples, self.rows("eval")
        if self.spec.counterfactual == "shift":

            def make(i):
                return shifted(a, self.spec, samples[i], rows[i], seed=self.seed, words=self.words)

        else:
            # the partner: a seeded other input whose image differs
            order = np.random.default_rng([self.seed, len(samples), 5]).permutation(len(samples))

            def make(i):
                for j in order:
                    partner = samples[int(j)]
                    if not np.array_equal(np.asarray(partner.image), np.asarray(samples[i].image)):
                        return other_image(a, self.spec, samples[i], rows[i], partner)
                raise Unreadable("every input has the same image")

        return observe_counterfactuals(
            self.loaded,
            samples,
            rows,
            self.pool,
            make,
            stays=self.spec.counterfactual == "other_image",
            cancel=self.cancel,
        )

    @property
    def pattern_stats(self):
        """:func:`core.methods.patterns.pattern_statistics` on the evaluation
        split with region = the target mask: an independent recomputation of
        step 1's estimator (one unbatched capture per sample). Returns the
        result, or the error's one-line text when it cannot run on this model."""

        def make():
            if not self.spec.on_image:
                return "its estimator reads an image region; this relation's sources are the sequence's own tokens"
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
            lambda: mean_ablation_value(
                self.loaded,
                self.side_reference[kind],
                self.rows(f"reference:{kind}"),
                head,
                batch_size=self.batch_size,
            ),
        )

    def eval_ids(self) -> list[int]:
        """Each evaluation sample's index in its source (scene index, or the dataset line): the per-sample evidence's key."""
        return [int(getattr(s, "index", i)) for i, s in enumerate(self.eval_samples)]

    def samples(self, which: str):
        if which in ("eval", "search"):
            return self.eval_samples if which == "eval" else self.search_samples
        if which.startswith("reference:"):
            return self.side_reference[which.partition(":")[2]]
        return self.side_samples[which]

    def base(self, which: str = "eval") -> RunNumbers:
        return self._get(
            ("base", which),
            lambda: run_edited(
                self.loaded,
                self.samples(which),
                self.rows(which),
                lambda row: [],
                batch_size=self.batch_size,
                cancel=self.cancel,
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
                self.rows(which),
                lambda row: [head_edit(h, row.query, values[h]) for h in heads],
                batch_size=self.batch_size,
                cancel=self.cancel,
            )

        return self._get(("ablated", heads, mode, which), make)

    def drop(self, heads: Sequence[Subject], mode: str, which: str = "eval") -> np.ndarray:
        """``(n,)`` S(model) - S(ablated): positive when the ablation lowers the answer's margin."""
        return self.base(which).logit_diff - self.ablated(heads, mode, which).logit_diff

    def unparked(self, subject: Subject) -> np.ndarray:
        """``(n,)`` the rise in the norm of the subject's z (a route: its heads' summed) at each
        evaluation query when its edges from the query to the sources are cut before the softmax."""
        heads = tuple(_members(subject))
        rows, obs = self.rows("eval"), self.eval_obs

        def cut(row: Row) -> list[Edit]:
            keys = tuple(row.keys[k] for k in row.sources)
            return [Edit(h.block, h.head, (row.query,), site="knockout", keys=keys) for h in heads]

        after = self._get(
            ("z_norm_cut", heads),
            lambda: z_norms(
                self.loaded, self.eval_samples, rows, heads, cut, batch_size=self.batch_size, cancel=self.cancel
            ),
        )
        before = sum(obs.z[:, obs.col(h)].norm(dim=-1).numpy() for h in heads)  # the observed run's own z
        return after - before

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
            counts = np.bincount(obs.argmax_slot()[:, cols[cand]], minlength=obs.attn.shape[2])
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
