"""What the steps measure on the model, per sample: one capture of every
head of the relation's pool at each input's query (:func:`observe_heads`), the
(edited) runs of the ablation steps (:func:`run_edited`, :func:`head_edit`,
:func:`mean_ablation_value`, :func:`z_norms`), and each head's attention before
and after step 4's counterfactual (:func:`observe_swaps`: the attribute swap
drawn by the function it is given, for the shape scenes
:func:`core.zoo.label_scenes.swap_attribute`; :func:`observe_counterfactuals`:
the relations whose sources are the sequence's own tokens).

Where each input is read (its query, keys, sources and the tokens of S) is its
:class:`core.methods.validation.relations.Row`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from core.forward.capture import capture
from core.forward.edits import Edit
from core.forward.geometry import region_tokens
from core.methods.contributions import source_contributions
from core.methods.patterns import entropy
from core.methods.validation.relations import Counterfactual, Row, _image
from core.methods.validation.setting import REGION_MIN_COVER, HeadRef, RouteRef, Subject, visual_heads


def _tokens(loaded, size, positions):
    return loaded.adapter.visual_tokens(size, positions)


def _groups(rows: Sequence[Row], batch_size: int) -> list[list[int]]:
    """Sample indices grouped by prompt length and query position (no padding inside a
    group, so one edit position serves every row), in chunks of ``batch_size``."""
    by_key: dict[tuple[int, int], list[int]] = {}
    for i, r in enumerate(rows):
        by_key.setdefault((r.length, r.query), []).append(i)
    groups = []
    for _, idx in sorted(by_key.items()):
        groups += [idx[k : k + batch_size] for k in range(0, len(idx), batch_size)]
    return groups


def _prepare(loaded, batch):
    return loaded.adapter.prepare([_image(s) for s in batch], [s.question for s in batch])


class ChainCancelled(Exception):
    """Raised inside the context's computations when ``cancel()`` returns True;
    :func:`run_chain` catches it and returns the chain with the steps done so far."""


@dataclass
class HeadObservations:
    """Per-sample read-outs of every head of the pool (one capture per sample, at its query).

    A sample's keys are its :class:`Row`'s slots; arrays over slots are padded with zeros
    to the longest sample's (the padding is in no sample's ``scored`` slots).

    Attributes:
        heads: the heads, in column order.
        attn: ``(n, heads, slots)`` the query row's attention on each slot.
        dla: ``(n, heads, slots)`` frozen-scale DLA (S's answer minus foil) of each slot's
            source contribution.
        write: ``(n, heads, slots)`` the norm of each slot's source contribution (the head's
            write from it: attention times the norm of its value through W_O).
        head_dla: ``(n, heads)`` the head's whole frozen-scale DLA at the query
            (every source; equals the residual component's ``dla_frozen``).
        entropy: ``(n, heads)`` entropy (nats) of the full query row.
        z: ``(n, heads, d_head)`` the head's z at the query.
        logit_diff, correct: ``(n,)`` S and whether the top token is S's answer token.
        sources, distractors, background, scored: per sample, slot index lists.
        routes: the :class:`RouteRef` columns after the heads' (added by :meth:`col` on first use).
    """

    split: str
    heads: list[HeadRef]
    attn: np.ndarray
    dla: np.ndarray
    write: np.ndarray
    head_dla: np.ndarray
    entropy: np.ndarray
    z: torch.Tensor
    logit_diff: np.ndarray
    correct: np.ndarray
    sources: list[list[int]]
    distractors: list[list[list[int]]]
    background: list[list[int]]
    scored: list[list[int]]
    routes: list[RouteRef] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.sources)

    def col(self, subject: Subject) -> int:
        """The column of a head, or of a route (derived from its heads' columns on first use)."""
        if isinstance(subject, HeadRef):
            return self.heads.index(subject)
        if subject not in self.routes:
            cols = [self.heads.index(m) for m in subject.members]

            def add(values, how):
                return np.concatenate([values, how(values[:, cols], 1)[:, None]], 1)

            self.attn = add(self.attn, np.mean)
            self.dla = add(self.dla, np.sum)
            self.write = add(self.write, np.sum)
            self.head_dla = add(self.head_dla, np.sum)
            self.entropy = add(self.entropy, np.mean)
            # a route has no single z: its ablation uses each head's own (ChainContext.ablated)
            self.z = torch.cat([self.z, torch.full_like(self.z[:, :1], float("nan"))], 1)
            self.routes.append(subject)
        return len(self.heads) + self.routes.index(subject)

    def argmax_slot(self) -> np.ndarray:
        """``(n, heads)`` the scored slot each head's query row puts its argmax on."""
        out = np.zeros(self.attn.shape[:2], dtype=np.int64)
        for i in range(self.n):
            p = np.asarray(self.scored[i])
            out[i] = p[self.attn[i][:, p].argmax(-1)]
        return out

    def hits(self) -> np.ndarray:
        """``(n, heads)`` 1 where the argmax over the scored slots is a source."""
        best = self.argmax_slot()
        return np.stack([np.isin(best[i], self.sources[i]) for i in range(self.n)]).astype(float)

    def chance(self) -> np.ndarray:
        """``(n,)`` share of the scored slots that are sources: a uniform head's hit probability."""
        return np.array([len(t) / len(p) for t, p in zip(self.sources, self.scored)])

    def region_sum(self, values: np.ndarray, regions: list[list[int]]) -> np.ndarray:
        """``values (n, heads, slots)`` summed over each sample's region -> ``(n, heads)``."""
        return np.stack([values[i][:, r].sum(-1) if r else np.zeros(values.shape[1]) for i, r in enumerate(regions)])

    def distractor_max(self, values: np.ndarray) -> np.ndarray:
        """``(n, heads)`` the largest per-distractor region sum (NaN without distractors)."""
        out = np.full(values.shape[:2], np.nan)
        for i, ds in enumerate(self.distractors):
            sums = [values[i][:, d].sum(-1) for d in ds if d]
            if sums:
                out[i] = np.max(np.stack(sums), axis=0)
        return out

    def quiet(self) -> np.ndarray:
        """``(n, heads)`` log(the other keys' write per unit of attention / the sources'):
        positive where the sources write less per unit of attention (a quiet sink)."""
        out = np.full(self.attn.shape[:2], np.nan)
        with np.errstate(divide="ignore", invalid="ignore"):
            for i in range(self.n):
                src = self.sources[i]
                rest = [k for k in self.scored[i] if k not in set(src)]
                per_src = self.write[i][:, src].sum(-1) / self.attn[i][:, src].sum(-1)
                per_rest = self.write[i][:, rest].sum(-1) / self.attn[i][:, rest].sum(-1)
                out[i] = np.log(per_rest / per_src)
        out[~np.isfinite(out)] = np.nan  # no mass on either side: undefined, left out of the means
        return out


def observe_heads(
    loaded,
    samples,
    rows: Sequence[Row],
    heads: list[HeadRef] | None = None,
    *,
    split: str = "",
    batch_size: int = 32,
    progress=None,
    cancel=None,
) -> HeadObservations:
    """One capture per sample (batched by prompt length and query): the query row's
    attention, source DLA and write norm, entropy and z of every head in ``heads``
    (default :func:`visual_heads`), over each sample's :class:`Row` slots."""

    a = loaded.adapter
    heads = heads or visual_heads(loaded)
    n = len(samples)
    width = max(r.n_slots for r in rows)
    attn, dla, write = (np.zeros((n, len(heads), width)) for _ in range(3))
    hd, ent = np.zeros((n, len(heads))), np.zeros((n, len(heads)))
    z = torch.zeros(n, len(heads), a.d_head, dtype=torch.float64)
    ld, ok = np.zeros(n), np.zeros(n, dtype=bool)
    done = 0
    for group in _groups(rows, batch_size):
        if cancel is not None and cancel():
            raise ChainCancelled()
        batch = [samples[i] for i in group]
        q = rows[group[0]].query
        tr = capture(loaded, None, "", inputs=_prepare(loaded, batch), query_positions=[q])
        for b, i in enumerate(group):
            row = rows[i]
            sc = source_contributions(a, tr, row.answer_id, row.foil_id, position=q, batch=b)
            for c, hr in enumerate(heads):
                keys = torch.as_tensor(row.key_positions(tr.block_kinds[hr.block]))
                pat = tr.patterns[hr.block][b, hr.head, 0].double()
                k = len(keys)
                attn[i, c, :k] = pat[keys].cpu().numpy()
                ent[i, c] = float(entropy(pat))
                d = sc.dla_frozen[hr.block][hr.head].double()
                dla[i, c, :k] = d[keys].cpu().numpy()
                write[i, c, :k] = sc.norm[hr.block][hr.head].double()[keys].cpu().numpy()
                hd[i, c] = float(d.sum())
                z[i, c] = tr.z[hr.block][b, q, hr.head].double().cpu()
            logits = tr.logits[b, q].double()
            ld[i] = float(logits[row.answer_id] - logits[row.foil_id])
            ok[i] = int(logits.argmax()) == row.answer_id
        done += len(group)
        if progress:
            progress(done, n, f"observing heads ({split})")
    return HeadObservations(
        split,
        list(heads),
        attn,
        dla,
        write,
        hd,
        ent,
        z,
        ld,
        ok,
        [list(r.sources) for r in rows],
        [list(r.distractors) for r in rows],
        [list(r.background) for r in rows],
        [list(r.scored) for r in rows],
    )


@torch.no_grad()
def mean_ablation_value(loaded, reference_samples, rows: Sequence[Row], head: HeadRef, *, batch_size: int = 32):
    """``(d_head,)`` the mean of the head's z at each reference sample's query: what mean
    ablation writes in place of the head's own z."""

    total = torch.zeros(loaded.adapter.d_head, dtype=torch.float64)
    for group, tr in _edited_runs(loaded, reference_samples, rows, lambda row: [], batch_size, None):
        total += tr.z[head.block][:, rows[group[0]].query, head.head].double().sum(0).cpu()
    return total / len(reference_samples)


def head_edit(head: HeadRef, position: int, value: torch.Tensor | None = None):
    """The :class:`core.forward.edits.Edit` that zeroes (``value=None``) or replaces
    ``(d_head,)`` the head's z at ``position``."""

    return Edit(head.block, head.head, (int(position),), None if value is None else value.reshape(1, -1))


def _edited_runs(loaded, samples, rows: Sequence[Row], make_edits: Callable[[Row], list], batch_size: int, cancel):
    """``(group, trace)`` of each batch of inputs sharing a length and query, run under
    ``make_edits(row)`` of its first row (the edits are stated at that query)."""
    for group in _groups(rows, batch_size):
        if cancel is not None and cancel():
            raise ChainCancelled()
        batch = [samples[i] for i in group]
        edits = make_edits(rows[group[0]])
        yield group, capture(loaded, None, "", inputs=_prepare(loaded, batch), pattern_layers=[], edits=edits)


@dataclass
class RunNumbers:
    """``(n,)`` S and top-token correctness of one (edited) run."""

    logit_diff: np.ndarray
    correct: np.ndarray


@torch.no_grad()
def run_edited(
    loaded, samples, rows: Sequence[Row], make_edits: Callable[[Row], list], *, batch_size: int = 32, cancel=None
) -> RunNumbers:
    """S and correctness of every sample under the edits ``make_edits(row)`` (rows of one
    batch share their length and query; an empty list: the model as is)."""

    ld = np.zeros(len(samples))
    ok = np.zeros(len(samples), dtype=bool)
    for group, tr in _edited_runs(loaded, samples, rows, make_edits, batch_size, cancel):
        logits = tr.logits[:, rows[group[0]].query].double()
        for b, i in enumerate(group):
            ld[i] = float(logits[b, rows[i].answer_id] - logits[b, rows[i].foil_id])
            ok[i] = int(logits[b].argmax()) == rows[i].answer_id
    return RunNumbers(ld, ok)


@torch.no_grad()
def z_norms(
    loaded,
    samples,
    rows: Sequence[Row],
    heads: Sequence[HeadRef],
    make_edits: Callable[[Row], list],
    *,
    batch_size: int = 32,
    cancel=None,
) -> np.ndarray:
    """``(n,)`` the summed norm of ``heads``' z at each sample's query under ``make_edits(row)``."""

    out = np.zeros(len(samples))
    for group, tr in _edited_runs(loaded, samples, rows, make_edits, batch_size, cancel):
        for b, i in enumerate(group):
            out[i] = sum(float(tr.z[h.block][b, rows[i].query, h.head].double().norm()) for h in heads)
    return out


@dataclass
class SwapObservations:
    """The query row's attention of every head before and after step 4's counterfactual.

    Attributes:
        rows: indices into the evaluation samples that admitted a counterfactual.
        mass_a_orig, mass_b_orig, mass_a_swap, mass_b_swap: ``(m, heads)`` mass on
            the sources' place before (a) and after (b), in the original and in the
            counterfactual.
        swap_logit_diff, swap_correct: ``(m,)`` the model on the counterfactual (S of its
            own answer and foil; whether the top token is its answer); NaN where the
            counterfactual states no answer.
        stays: the sources stay (another image): the pattern should stay, not move.
        attn_orig, attn_swap: for the staying relations, each pair's query rows ``(heads,
            keys up to the query)`` (where a head's argmax is); ``a_slots`` / ``b_slots`` the
            sources in each; ``chance_swap`` a uniform head's mass on them after.
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
    n_unreadable: int = 0  # counterfactuals the model cannot read as stated (left out)
    routes: list[RouteRef] = field(default_factory=list)
    stays: bool = False
    attn_orig: list[np.ndarray] = field(default_factory=list)
    attn_swap: list[np.ndarray] = field(default_factory=list)
    chance_swap: np.ndarray | None = None
    a_slots: list[list[int]] = field(default_factory=list)
    b_slots: list[list[int]] = field(default_factory=list)
    unreadable_reasons: dict[str, int] = field(default_factory=dict)  # why counterfactuals were left out: how many

    @classmethod
    def collected(cls, out: dict, n_tried: int, heads, unreadable: int, **extra) -> SwapObservations:
        """From the per-pair lists an observer collected: ``rows``, the masses ``ao``, ``bo``,
        ``as``, ``bs`` (each ``(heads,)``), and the model's ``ld`` and ``ok`` on the counterfactual."""

        def arr(k):
            return np.stack(out[k]) if out[k] else np.zeros((0, len(heads)))

        return cls(
            out["rows"],
            arr("ao"),
            arr("bo"),
            arr("as"),
            arr("bs"),
            np.array(out["ld"]),
            np.array(out["ok"]),
            n_tried,
            list(heads),
            n_unreadable=unreadable,
            **extra,
        )

    def col(self, subject: Subject) -> int:
        """The column of a head, or of a route (its heads' mean mass and rows, added on first use)."""
        if isinstance(subject, HeadRef):
            return self.heads.index(subject)
        if subject not in self.routes:
            cols = [self.heads.index(m) for m in subject.members]
            for key in ("mass_a_orig", "mass_b_orig", "mass_a_swap", "mass_b_swap"):
                v = getattr(self, key)
                setattr(self, key, np.concatenate([v, v[:, cols].mean(1, keepdims=True)], 1))
            for key in ("attn_orig", "attn_swap"):
                setattr(self, key, [np.concatenate([r, r[cols].mean(0, keepdims=True)]) for r in getattr(self, key)])
            self.routes.append(subject)
        return len(self.heads) + self.routes.index(subject)

    def shift(self) -> np.ndarray:
        """``(m, heads)``: mass gained at b plus mass lost at a, halved."""
        return 0.5 * ((self.mass_b_swap - self.mass_b_orig) + (self.mass_a_orig - self.mass_a_swap))

    def follows(self) -> np.ndarray:
        """``(m, heads)`` 1 where the head prefers a before and b after the counterfactual
        (staying relations: where its argmax is on the sources in both)."""
        if self.stays:
            return np.stack(
                [
                    np.isin(o.argmax(-1), a) & np.isin(w.argmax(-1), b)
                    for o, w, a, b in zip(self.attn_orig, self.attn_swap, self.a_slots, self.b_slots)
                ]
            ).astype(float)
        return ((self.mass_a_orig > self.mass_b_orig) & (self.mass_b_swap > self.mass_a_swap)).astype(float)

    def moved(self) -> np.ndarray:
        """``(m, heads)`` step 4's per-pair metric: the mass shift (:meth:`shift`), or for a
        staying relation the mass kept on the sources beyond a uniform head's share."""
        if self.stays:
            return self.mass_b_swap - self.chance_swap[:, None]
        return self.shift()


@torch.no_grad()
def observe_counterfactuals(
    loaded,
    samples,
    rows: Sequence[Row],
    heads: list[HeadRef],
    make: Callable[[int], Counterfactual],
    *,
    stays: bool,
    cancel=None,
) -> SwapObservations:
    """Capture every sample at its query and its counterfactual ``make(i)`` (a
    :class:`Counterfactual`; :class:`core.methods.validation.relations.Unreadable`
    leaves the sample out, counted) at its own, and measure each head's mass on the
    sources' place before (a) and after (b). For a staying relation each head's two
    query rows are kept (where its argmax is)."""
    from core.methods.validation.relations import Unreadable, prepared

    a = loaded.adapter
    out = {k: [] for k in ("rows", "ao", "bo", "as", "bs", "ld", "ok", "ro", "rs", "ch", "cf")}
    unreadable, reasons = 0, {}
    for i, s in enumerate(samples):
        if cancel is not None and cancel():
            raise ChainCancelled()
        try:
            cf = make(i)
        except Unreadable as e:
            unreadable += 1
            reasons[str(e)] = reasons.get(str(e), 0) + 1
            continue
        row = rows[i]
        from PIL import Image

        orig = capture(loaded, None, "", inputs=prepared(a, s), query_positions=[row.query])
        swapped = a.prepare([Image.fromarray(cf.image)], [cf.question])
        tr = capture(loaded, None, "", inputs=swapped, query_positions=[cf.query])
        m = np.zeros((4, len(heads)))
        ro, rs = [], []
        for c, hr in enumerate(heads):
            before = orig.patterns[hr.block][0, hr.head, 0].double().cpu().numpy()
            after = tr.patterns[hr.block][0, hr.head, 0].double().cpu().numpy()
            m[:, c] = before[cf.a].sum(), before[cf.b].sum(), after[cf.a].sum(), after[cf.b].sum()
            if stays:
                ro.append(before[: row.query + 1])
                rs.append(after[cf.scored])
        logits = tr.logits[0, cf.query].double()
        out["rows"].append(i)
        for key, value in zip(("ao", "bo", "as", "bs"), m):
            out[key].append(value)
        out["ld"].append(float("nan") if stays else float(logits[row.answer_id] - logits[row.foil_id]))
        out["ok"].append(bool(not stays and int(logits.argmax()) == row.answer_id))
        if stays:
            out["ro"].append(np.stack(ro))
            out["rs"].append(np.stack(rs))
        out["ch"].append(len(cf.b) / len(cf.scored))
        out["cf"].append(cf)
    return SwapObservations.collected(
        out,
        len(samples),
        heads,
        unreadable,
        stays=stays,
        attn_orig=out["ro"],
        attn_swap=out["rs"],
        chance_swap=np.array(out["ch"]),
        a_slots=[list(c.a) for c in out["cf"]],
        b_slots=[list(c.b) for c in out["cf"]],
        unreadable_reasons=reasons,
    )


@torch.no_grad()
def observe_swaps(
    loaded, samples, heads: list[HeadRef], *, swap: Callable, seed: int = 0, cancel=None
) -> SwapObservations:
    """Capture every sample and its counterfactual ``swap(sample, seed)`` (for
    the shape scenes :func:`core.zoo.label_scenes.swap_attribute`: an object
    with ``image``, ``mask_a``, ``mask_b``, ``answer`` and ``foil``, or None
    when the sample admits no swap) and measure each head's answer-row mass
    on the two swapped locations. A swap whose new answer or foil is not one
    token of the model is left out (counted in ``n_unreadable``)."""
    from core.errors import QuestionError

    a = loaded.adapter
    out = {k: [] for k in ("rows", "ao", "bo", "as", "bs", "ld", "ok")}
    unreadable = 0
    for i, s in enumerate(samples):
        if cancel is not None and cancel():
            raise ChainCancelled()
        sw = swap(s, seed)
        if sw is None:
            continue
        try:
            aid, fid = a.token_id(sw.answer), a.token_id(sw.foil)
        except QuestionError:
            unreadable += 1
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
        logits = tr.logits[1, pos].double()
        out["rows"].append(i)
        out["ao"].append(masses[0][0])
        out["bo"].append(masses[0][1])
        out["as"].append(masses[1][0])
        out["bs"].append(masses[1][1])
        out["ld"].append(float(logits[aid] - logits[fid]))
        out["ok"].append(int(logits.argmax()) == aid)
    return SwapObservations.collected(out, len(samples), heads, unreadable)
