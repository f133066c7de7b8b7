"""The counterfactual and its read-outs: the answer numbers of an image
(a :class:`core.results.readout.Target`) and the effect of an edit on them
(:class:`core.results.readout.AnswerEffect`), the routing read-outs of a region from one capture
of the original (:class:`TokenRouting`, :class:`RegionRouting`), one region
filled (:func:`region_counterfactual`), and many regions set against their
routing (:func:`region_agreement`, with :func:`core.methods.stats.pearson` and
:func:`core.methods.stats.spearman`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from core.errors import QuestionError, UndefinedReadoutError, oom_guard
from core.files.images import load_image
from core.forward.capture import ATTENTION_KINDS, capture, no_pattern_note
from core.methods.contributions import source_contributions
from core.methods.counterfactual.fills import Fill, as_fill
from core.methods.counterfactual.regions import RegionError, check_mask
from core.methods.patterns import FULL_PATTERN_LIMIT, RolloutStream, rollout_audit
from core.methods.stats import pearson, ranks, spearman
from core.results.audit import AuditRecord
from core.results.readout import AnswerEffect, Target, change_line, from_dict_fields

SCHEMA_VERSION = 1
TOKEN_WEIGHT = "area(token box & mask) / area(token box), in original-image pixels"
DLA_CONVENTION = (
    "frozen-scale DLA (source_contributions.dla_frozen) summed over blocks, heads and region tokens, "
    "each token weighted by its overlap fraction"
)

Progress = Callable[[int, int, str], None] | None
Cancel = Callable[[], bool] | None
# What the command line writes after a fill run's JSON (the model; the image, mask and paste files)
HEADER = ("model", "input")


def header_of(result) -> dict:
    """The :data:`HEADER` fields ``result`` holds (a result read back from the command's JSON)."""
    return {k: getattr(result, k) for k in HEADER if getattr(result, k) is not None}


# ---------------------------------------------------------------- answer numbers


def answer_numbers(adapter, logits: torch.Tensor, answer_id: int, foil_id: int | None) -> Target:
    """The :class:`Target` of the answer position's logits ``(vocab,)`` (float64 arithmetic)."""
    return Target.from_logits(adapter, logits, answer_id, foil_id)


def answer_effect(original: Target, edited: Target) -> AnswerEffect:
    """``edited`` minus ``original`` (:meth:`core.results.readout.AnswerEffect.between`)."""
    return AnswerEffect.between(original, edited)


def resolve_tokens(adapter, answer: str | int | None, foil: str | int | None, logits: torch.Tensor):
    """Answer id (default: the model's top token on ``logits (vocab,)``) and foil id (or None)."""
    answer_id = int(logits.argmax()) if answer is None else adapter.as_token_id(answer)
    foil_id = None if foil is None else adapter.as_token_id(foil)
    if foil_id is not None and foil_id == answer_id:
        raise QuestionError("the foil must differ from the answer")
    return answer_id, foil_id


@torch.no_grad()
def answer_logits(
    loaded,
    images: Sequence,
    question: str,
    *,
    batch_size: int = 16,
    progress: Progress = None,
    cancel: Cancel = None,
    answer_prefix: Sequence[int] = (),
) -> torch.Tensor:
    """Answer-position logits ``(n_images, vocab)`` of ``question`` (followed by
    the answer tokens ``answer_prefix``: teacher forcing) on each image, through
    ``adapter.prepare`` + ``adapter.next_token_logits``, ``batch_size`` at a time."""
    adapter = loaded.adapter
    out = []
    for start in range(0, len(images), batch_size):
        if cancel is not None and cancel():
            break
        chunk = list(images[start : start + batch_size])
        with oom_guard(f"running a batch of {len(chunk)} edited images"):
            inputs = adapter.prepare(chunk, [question] * len(chunk), answer_prefix=answer_prefix)
            out.append(adapter.next_token_logits(inputs).detach().cpu())
        if progress is not None:
            progress(min(start + batch_size, len(images)), len(images), "edited forwards")
    return torch.cat(out) if out else torch.zeros(0)


# ---------------------------------------------------------------- routing


def overlap_weights(tokens, mask) -> np.ndarray:
    """``(n_tokens,)``: for each visual token, ``area(box & mask) / area(box)``
    with the box in original-image pixels (fractional boxes handled exactly:
    each mask pixel is the unit square it covers). Tokens without a patch
    (``col < 0``) weigh 0. A box reaching past the image counts its outside
    part as not in the region."""
    m = np.asarray(mask, dtype=np.float64)
    h, w = m.shape
    out = np.zeros(len(tokens))
    xs, ys = np.arange(w, dtype=np.float64), np.arange(h, dtype=np.float64)
    for i, t in enumerate(tokens):
        if t.col < 0:
            continue
        x0, y0, x1, y1 = (float(v) for v in t.box)
        area = (x1 - x0) * (y1 - y0)
        if area <= 0:
            continue
        xa, xb = max(0, int(math.floor(x0))), min(w, int(math.ceil(x1)))
        ya, yb = max(0, int(math.floor(y0))), min(h, int(math.ceil(y1)))
        if xb <= xa or yb <= ya:
            continue
        # each pixel's overlap with the box along x and y (1 inside, a fraction on a fractional edge)
        wx = np.clip(np.minimum(xs[xa:xb] + 1, x1) - np.maximum(xs[xa:xb], x0), 0, None)
        wy = np.clip(np.minimum(ys[ya:yb] + 1, y1) - np.maximum(ys[ya:yb], y0), 0, None)
        out[i] = float(wy @ m[ya:yb, xa:xb] @ wx) / area
    return out


@dataclass
class TokenRouting:
    """Per-visual-token routing read-outs of the answer position from one
    capture of the original image; a region's numbers are weighted sums.

    Attributes:
        tokens: the :class:`core.forward.geometry.VisualToken` list.
        heads: ``[(block, block_name, head)]`` rows of ``attention``.
        attention: ``(n_heads_with_visual_keys, n_tokens)`` the answer row's
            weight on each visual token.
        rollout: ``(n_tokens,)`` rollout mass of the answer position on each
            visual token (None when the prompt was too long for full patterns).
        dla: ``(n_blocks, n_tokens)`` frozen-scale DLA through each visual
            token, summed over the block's heads (rows of blocks without
            visual keys are 0); None where the architecture has no linear value
            path to split (Gemma 3n: its audit row says why).
    """

    tokens: list
    heads: list[tuple[int, str, int]]
    attention: np.ndarray
    rollout: np.ndarray | None
    dla: np.ndarray | None
    rollout_alpha: float
    answer_id: int
    foil_id: int | None
    position: int
    audit: list[AuditRecord] = field(default_factory=list, repr=False)

    def for_region(self, mask) -> RegionRouting:
        w = overlap_weights(self.tokens, mask)
        mass = self.attention @ w
        return RegionRouting(
            [HeadMass(b, name, h, float(v)) for (b, name, h), v in zip(self.heads, mass)],
            float(self.rollout @ w) if self.rollout is not None else None,
            float(self.dla.sum(0) @ w) if self.dla is not None else None,
            [{"block": b, "dla": float(v)} for b, v in enumerate(self.dla @ w) if self.dla[b].any()]
            if self.dla is not None
            else [],
            [{"index": int(i), "weight": float(w[i])} for i in np.nonzero(w)[0]],
            self.rollout_alpha,
        )


@dataclass(frozen=True)
class HeadMass:
    """One head's attention mass on a region: ``sum_t A[answer, t] * weight_t`` over
    the visual tokens (``layer``: the block's index, ``block`` its name)."""

    layer: int
    block: str
    head: int
    mass: float

    @property
    def name(self) -> str:
        """``L1.H2``: the head as the tables name it."""
        return f"L{self.layer}.H{self.head}"

    def to_dict(self) -> dict:
        return {"layer": self.layer, "block": self.block, "head": self.head, "mass": self.mass}

    @classmethod
    def from_dict(cls, d: dict) -> HeadMass:
        return from_dict_fields(cls, d)


@dataclass
class RegionRouting:
    """Routing read-outs for one region (what attention shows; not the effect).

    Attributes:
        attention_mass: per head with visual keys, its :class:`HeadMass`.
        rollout_mass: ``sum_t R[answer, t] * weight_t`` (None: no full patterns).
        dla_through_region: frozen-scale DLA through the region's tokens
            (:data:`DLA_CONVENTION`; None: not defined for this architecture).
        dla_by_block: the same per block (blocks with visual keys).
        token_weights: ``{"index", "weight"}`` of every token the region touches.
    """

    attention_mass: list[HeadMass]
    rollout_mass: float | None
    dla_through_region: float | None
    dla_by_block: list[dict]
    token_weights: list[dict]
    rollout_alpha: float

    @property
    def mean_attention_mass(self) -> float:
        """The region's attention mass averaged over every head with visual keys."""
        return float(np.mean([r.mass for r in self.attention_mass])) if self.attention_mass else float("nan")

    def top_heads(self, k: int) -> list[HeadMass]:
        """The ``k`` heads with the most mass on the region, most first."""
        return sorted(self.attention_mass, key=lambda h: -h.mass)[:k]

    def to_dict(self) -> dict:
        return {
            "attention_mass": [h.to_dict() for h in self.attention_mass],
            "rollout_mass": self.rollout_mass,
            "rollout_alpha": self.rollout_alpha,
            "dla_through_region": self.dla_through_region,
            "dla_convention": DLA_CONVENTION,
            "dla_by_block": self.dla_by_block,
            "token_weight": TOKEN_WEIGHT,
            "token_weights": self.token_weights,
        }

    @classmethod
    def from_dict(cls, d: dict) -> RegionRouting:
        """The inverse of :meth:`to_dict` (its convention texts are this version's)."""
        return cls(
            [HeadMass.from_dict(h) for h in d["attention_mass"]],
            d["rollout_mass"],
            d["dla_through_region"],
            list(d["dla_by_block"]),
            list(d["token_weights"]),
            d["rollout_alpha"],
        )


@torch.no_grad()
def token_routing(
    loaded,
    image,
    question: str,
    answer_id: int,
    foil_id: int | None = None,
    *,
    rollout_alpha: float = 0.5,
    inputs=None,
    answer_prefix: Sequence[int] = (),
) -> TokenRouting:
    """One capture of the ORIGINAL image: the answer row at every block (and
    the rollout, fed block by block, when the prompt has at most
    ``core.methods.patterns.FULL_PATTERN_LIMIT`` tokens), then per visual token its
    attention weight per head, rollout mass and frozen-scale DLA."""

    adapter = loaded.adapter
    img = load_image(image)
    if inputs is None:
        inputs = adapter.prepare([img], [question], answer_prefix=answer_prefix)
    n = inputs.input_ids.shape[1]
    every_block_attends = all(kind in ATTENTION_KINDS for _, kind in adapter.blocks)  # rollout multiplies them all
    stream = RolloutStream(rollout_alpha) if n <= FULL_PATTERN_LIMIT and every_block_attends else None
    pos = int(inputs.answer_positions[0])
    trace = capture(loaded, img, question, inputs=inputs, pattern_streams=[stream] if stream is not None else [])
    undefined = no_pattern_note(adapter, trace)  # a hybrid decoder's layers without pattern or heads
    qi = 0
    tokens = adapter.visual_tokens(img.size, trace.visual_positions[0].tolist())
    vis_pos = trace.visual_positions[0]
    heads, rows = [], []
    for block in trace.attention_blocks:
        pat = trace.patterns[block][0, :, qi].double().cpu()  # (heads, keys)
        if trace.block_kinds[block] == "cross":
            vis = pat[:, : len(tokens)]
        elif vis_pos.numel():
            vis = pat[:, vis_pos.cpu()]
        else:  # a text-only block (CoCa's text tower): no visual key
            continue
        for h in range(vis.shape[0]):
            heads.append((block, trace.block_names[block], h))
            rows.append(vis[h].numpy())
    attention = np.stack(rows) if rows else np.zeros((0, len(tokens)))
    roll = None
    audits = []
    if stream is not None:
        r = stream.answer_row(trace).double().cpu()
        vis_nodes = vis_pos.cpu() if vis_pos.numel() else torch.arange(n, r.shape[0])
        roll = r[vis_nodes].numpy()
    try:
        sc = source_contributions(adapter, trace, answer_id, foil_id, position=pos)
    except UndefinedReadoutError as e:  # no linear value path (Gemma 3n): the effect is measured all the same
        sc, dla = None, None
        refused = AuditRecord.not_defined("source contribution", str(e))
    else:
        dla = np.zeros((trace.n_blocks, len(tokens)))
    for block, d in enumerate(sc.dla_frozen if sc is not None else []):
        if d is None:  # a block without heads: no source of its write is read off a pattern
            continue
        d = d.double().cpu().sum(0)  # (sources,) summed over heads
        if trace.block_kinds[block] == "cross":
            dla[block] = d[: len(tokens)].numpy()
        elif vis_pos.numel():
            dla[block] = d[vis_pos.cpu()].numpy()
    audits.append(
        AuditRecord.for_method(
            "pattern analysis",
            controls=[
                "answer row of one capture of the original image",
                f"token weight = {TOKEN_WEIGHT}",
                "sink / text mass excluded (visual keys only)",
                "patch-granular",
            ],
            parameters={"position": pos, "n_heads": len(heads), "n_visual_tokens": len(tokens)},
            notes=["attention on the region shows routing co-occurrence only; compare with the answer effect"]
            + ([undefined] if undefined else []),
        )
    )
    if stream is not None:
        audits.append(rollout_audit(rollout_alpha, "mean"))
    elif undefined:
        audits.append(
            AuditRecord.not_defined("rollout / flow", f"rollout multiplies every layer's pattern; {undefined}")
        )
    if sc is None:
        audits.append(refused)
        return TokenRouting(tokens, heads, attention, roll, dla, rollout_alpha, answer_id, foil_id, pos, audits)
    audits.append(sc.audit)
    if undefined:
        sc.audit.notes.append(
            f"DLA through region sums the attention heads' writes only; {undefined}: their writes are not split by source"
        )
    audits[-1].notes.append(
        "DLA through region tokens reads the direct write from those tokens' residuals (self-attention: "
        "positions that earlier layers already mixed) or the vision tower's outputs (cross-attention: "
        "already mixed across patches by the vision tower); it is not the region's pixel information"
    )
    return TokenRouting(tokens, heads, attention, roll, dla, rollout_alpha, answer_id, foil_id, pos, audits)


# ---------------------------------------------------------------- one region


def counterfactual_audit(fill: Fill, parameters: dict, notes: Sequence[str] = ()) -> AuditRecord:
    return AuditRecord.for_method(
        "region counterfactual",
        controls=[
            f"fill: {fill.kind}",
            "edited image through the model's own processor",
            "pixels outside the region bit-identical",
            "original and edited numbers reported side by side",
        ],
        parameters={"fill": fill.kind, **fill.parameters(), **parameters},
        notes=[
            "a fill is itself new evidence (a mean patch, a blur, an inpainted surface): the effect is of "
            "this replacement, not of 'the object being absent'; compare fills and a matched-area control region",
            *notes,
        ],
    )


def fill_run_parameters(original: Target, fill: Fill, answer_prefix: Sequence[int] = ()) -> dict:
    """What a fill run was called with (its session parameters): the answer and foil
    tokens, the answer tokens before the one read out, the fill."""
    return {
        "answer": original.answer,
        "foil": original.foil,
        "answer_prefix_ids": list(answer_prefix),
        "fill": fill.kind,
        "fill_parameters": fill.parameters(),
    }


@dataclass
class RegionCounterfactual:
    """One region, one fill: the answer effect with the routing read-outs beside it.

    ``model`` and ``input``: the header ``vlm-readout counterfactual`` writes after the
    result (the model, the image and mask files), kept when a stored JSON has it (:data:`HEADER`).
    """

    fill: Fill
    mask_area_px: int
    original: Target
    edited: Target
    effect: AnswerEffect
    routing: RegionRouting | None
    audit: list[AuditRecord] = field(default_factory=list, repr=False)
    edited_image: np.ndarray | None = field(default=None, repr=False)
    answer_prefix: tuple[int, ...] = ()
    model: dict | None = None
    input: dict | None = None

    kind = "counterfactual"  # the session's run kind (core.results.readout.Readout)

    def summary(self) -> str:
        return self.summary_of(self.to_dict())

    @staticmethod
    def summary_of(doc: Mapping) -> str:
        """The one line of a ``counterfactual`` JSON: this result's, or a stored
        run's (the session's v2 migration backfills v1 runs with it)."""
        flipped = bool(doc["effect"].get("flipped"))
        return f"fill {doc.get('fill')}: {change_line(doc['original'], doc['edited'], flipped)}"

    def parameters(self) -> dict:
        return {
            **fill_run_parameters(self.original, self.fill, self.answer_prefix),
            "mask_area_px": self.mask_area_px,
        }

    def audit_records(self) -> list[AuditRecord]:
        return list(self.audit)

    def to_dict(self) -> dict:
        """The ``counterfactual`` JSON of docs/ARCHITECTURE.md (schema version 1)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "fill": self.fill.kind,
            "fill_parameters": self.fill.parameters(),
            "mask_area_px": self.mask_area_px,
            "answer_prefix_ids": list(self.answer_prefix),
            "original": self.original.to_dict(),
            "edited": self.edited.to_dict(),
            "effect": self.effect.to_dict(),
            "routing": self.routing.to_dict() if self.routing is not None else None,
            "audit": [a.to_dict() for a in self.audit],
            **header_of(self),
        }

    @classmethod
    def from_dict(cls, d: dict) -> RegionCounterfactual:
        """The result a ``counterfactual`` JSON (:meth:`to_dict`, a stored run's) describes;
        the edited image is not in it (None)."""
        return cls(
            Fill.recorded(d["fill"], d["fill_parameters"]),
            int(d["mask_area_px"]),
            Target.from_dict(d["original"]),
            Target.from_dict(d["edited"]),
            AnswerEffect.from_dict(d["effect"]),
            RegionRouting.from_dict(d["routing"]) if d.get("routing") is not None else None,
            [AuditRecord.from_dict(a) for a in d.get("audit") or []],
            None,
            tuple(int(t) for t in d.get("answer_prefix_ids") or ()),
            d.get("model"),
            d.get("input"),
        )


@torch.no_grad()
def region_counterfactual(
    loaded,
    image,
    question: str,
    mask,
    fill: Fill | str = "mean",
    *,
    answer: str | int | None = None,
    foil: str | int | None = None,
    routing: bool = True,
    rollout_alpha: float = 0.5,
    answer_prefix: Sequence[int] = (),
    **fill_options,
) -> RegionCounterfactual:
    """Fill ``mask`` ``(H, W)`` bool (original-image pixels) and re-run the model.

    Args:
        answer: the answer token (default: the model's top token on the original).
        answer_prefix: answer tokens after the prompt (teacher forcing: the read-out
            is at the answer token after them, :mod:`core.answer_text`).
        foil: a competing token; the logit difference is answer minus foil.
        routing: also read the routing for the region from one capture of the original.
        fill_options: ``color``, ``radius``, ``seed``, ``paste_from`` (see :class:`Fill`).
    """

    adapter = loaded.adapter
    img = load_image(image)
    m = check_mask(mask, img.size)
    f = as_fill(fill, **fill_options)
    edited_img = f.apply(img, m)
    logits = answer_logits(loaded, [img, edited_img], question, batch_size=2, answer_prefix=answer_prefix)
    answer_id, foil_id = resolve_tokens(adapter, answer, foil, logits[0])
    original = answer_numbers(adapter, logits[0], answer_id, foil_id)
    edited = answer_numbers(adapter, logits[1], answer_id, foil_id)
    audits = [
        counterfactual_audit(
            f,
            {
                "mask_area_px": int(m.sum()),
                "answer_id": answer_id,
                "foil_id": foil_id,
                "answer_prefix_ids": list(answer_prefix),
            },
            ["original and edited run in one batch of two"],
        )
    ]
    reg = None
    if routing:
        tr = token_routing(
            loaded, img, question, answer_id, foil_id, rollout_alpha=rollout_alpha, answer_prefix=answer_prefix
        )
        reg = tr.for_region(m)
        audits += tr.audit
    return RegionCounterfactual(
        f,
        int(m.sum()),
        original,
        edited,
        answer_effect(original, edited),
        reg,
        audits,
        edited_img,
        tuple(int(t) for t in answer_prefix),
    )


# ---------------------------------------------------------------- many regions: does attention predict the effect?


@dataclass
class RegionRow:
    name: str
    mask_area_px: int
    attention_mass: float  # mean over heads with visual keys
    max_head_mass: float
    rollout_mass: float | None
    dla_through_region: float
    effect: AnswerEffect
    drop: float  # original minus edited target score (positive: the edit hurt the answer)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["effect"] = self.effect.to_dict()
        return d


@dataclass
class RegionAgreement:
    """Across the regions of one image: do the routing read-outs rank the
    regions as the causal drop does?

    Attributes:
        correlations: ``{readout: {"spearman", "pearson"}}`` of each read-out
            (attention_mass, rollout_mass, dla_through_region) against ``drop``.
        disagreements: the regions whose attention rank and drop rank differ
            most (``rank_gap``: attention rank minus drop rank, as a share of n - 1).
    """

    original: Target
    fill: Fill
    rows: list[RegionRow]
    correlations: dict[str, dict[str, float | None]]
    disagreements: list[dict]
    audit: list[AuditRecord] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "fill": self.fill.kind,
            "fill_parameters": self.fill.parameters(),
            "original": self.original.to_dict(),
            "drop": "original minus edited logit difference (answer logit without a foil); positive = hurt",
            "regions": [r.to_dict() for r in self.rows],
            "correlations": self.correlations,
            "correlation_reading": "each read-out against drop across these regions: positive = more routing "
            "on a region goes with a larger causal drop (they agree); near 0 or negative = they disagree",
            "disagreements": self.disagreements,
            "audit": [a.to_dict() for a in self.audit],
        }


@torch.no_grad()
def region_agreement(
    loaded,
    image,
    question: str,
    regions: Mapping[str, Any] | Sequence,
    fill: Fill | str = "mean",
    *,
    answer: str | int | None = None,
    foil: str | int | None = None,
    batch_size: int = 16,
    n_disagreements: int = 3,
    rollout_alpha: float = 0.5,
    progress: Progress = None,
    cancel: Cancel = None,
    answer_prefix: Sequence[int] = (),
    **fill_options,
) -> RegionAgreement:
    """Fill each region in turn (batched) and set each region's routing
    read-outs (one capture of the original) against its causal drop.

    Args:
        regions: ``{name: mask}`` or a list of masks (named "0", "1", ...),
            each ``(H, W)`` bool on the original image.
    """

    adapter = loaded.adapter
    img = load_image(image)
    named = list(regions.items()) if isinstance(regions, Mapping) else [(str(i), r) for i, r in enumerate(regions)]
    if not named:
        raise RegionError("no regions given")
    masks = [(name, check_mask(m, img.size)) for name, m in named]
    f = as_fill(fill, **fill_options)
    fill_one = f.bind(img)
    base = answer_logits(loaded, [img], question, answer_prefix=answer_prefix)[0]
    answer_id, foil_id = resolve_tokens(adapter, answer, foil, base)
    original = answer_numbers(adapter, base, answer_id, foil_id)
    routing = token_routing(
        loaded, img, question, answer_id, foil_id, rollout_alpha=rollout_alpha, answer_prefix=answer_prefix
    )
    rows: list[RegionRow] = []
    for start in range(0, len(masks), batch_size):
        if cancel is not None and cancel():
            break
        chunk = masks[start : start + batch_size]
        edited = [fill_one(m) for _, m in chunk]
        logits = answer_logits(loaded, edited, question, batch_size=batch_size, answer_prefix=answer_prefix)
        for (name, m), z in zip(chunk, logits):
            eff = answer_effect(original, answer_numbers(adapter, z, answer_id, foil_id))
            r = routing.for_region(m)
            rows.append(
                RegionRow(
                    name,
                    int(m.sum()),
                    r.mean_attention_mass,
                    max((x.mass for x in r.attention_mass), default=float("nan")),
                    r.rollout_mass,
                    r.dla_through_region,
                    eff,
                    eff.drop,
                )
            )
        if progress is not None:
            progress(len(rows), len(masks), "region counterfactuals")
    drop = np.array([r.drop for r in rows])
    corr = {}
    for key in ("attention_mass", "rollout_mass", "dla_through_region"):
        vals = [getattr(r, key) for r in rows]
        if any(v is None for v in vals):
            corr[key] = {"spearman": None, "pearson": None}
            continue
        corr[key] = {"spearman": spearman(vals, drop), "pearson": pearson(vals, drop)}
    disagreements = []
    if len(rows) >= 2:
        scale = len(rows) - 1
        gap = (ranks(np.array([r.attention_mass for r in rows])) - ranks(drop)) / scale
        for i in np.argsort(-np.abs(gap), kind="mergesort")[:n_disagreements]:
            disagreements.append(
                {
                    "name": rows[i].name,
                    "rank_gap": float(gap[i]),
                    "attention_mass": rows[i].attention_mass,
                    "drop": rows[i].drop,
                    "reading": "attention ranks it higher than its effect"
                    if gap[i] > 0
                    else "its effect ranks higher than its attention",
                }
            )
    audits = [
        counterfactual_audit(
            f,
            {"n_regions": len(rows), "answer_id": answer_id, "foil_id": foil_id, "batch_size": batch_size},
            [
                "correlations are across the regions of one image and one question; a high correlation here "
                "does not make attention a causal map elsewhere",
            ],
        ),
        *routing.audit,
    ]
    return RegionAgreement(original, f, rows, corr, disagreements, audits)
