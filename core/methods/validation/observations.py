"""What the steps measure on the model, per sample: one capture of every
visual-reading head (:func:`observe_heads`), the (edited) runs of the ablation
steps (:func:`run_edited`, :func:`head_edit`, :func:`mean_ablation_value`), and
each head's attention before and after an attribute swap (:func:`observe_swaps`;
the swap is drawn by the function it is given, for the shape scenes
:func:`core.zoo.label_scenes.swap_attribute`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from core.forward.capture import capture
from core.forward.edits import Edit
from core.forward.geometry import region_tokens
from core.methods.contributions import source_contributions
from core.methods.patterns import entropy
from core.methods.validation.setting import REGION_MIN_COVER, HeadRef, RouteRef, Subject, visual_heads


def _image(sample):
    from PIL import Image

    return Image.fromarray(sample.image)


def _tokens(loaded, size, positions):
    return loaded.adapter.visual_tokens(size, positions)


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
    """The :class:`core.forward.edits.Edit` that zeroes (``value=None``) or replaces
    ``(d_head,)`` the head's z at ``position``."""

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
    n_unreadable: int = 0  # swaps whose new answer or foil is no single token of the model (left out)
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
        n_unreadable=unreadable,
    )
