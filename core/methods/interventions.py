"""Interventions (docs/METHODS.md §4.11 step 5, §4.12): visual-feature patching,
ablation and activation patching of heads, MLPs and the residual stream, and
attention-edge knockout.

Every intervention is a list of :class:`core.forward.edits.Edit` s run through
:func:`core.forward.capture.capture`, so each edited run is a full :class:`Trace` that
says in ``trace.edits`` how it was made. The functions here build the edits
(from a counterfactual run, a reference set, another input) and report the
answer effect at the answer position:

* ``logit``: the answer token's logit; ``logit_diff``: answer minus foil;
  ``prob``: the answer's softmax probability; ``predicted``: the argmax;
* ``effect``: edited minus original for each, and ``flipped`` (the argmax changed).

Conventions. Visual tokens are named by their 0-based index among the visual
tokens (``core.forward.geometry.VisualToken.index``). Sites (see :mod:`core.forward.edits`):
``vision_out`` (the vision encoder's output as the language side reads it),
``projector_out``, ``resid`` at block ``l`` (the residual entering block ``l``
at the visual tokens' sequence positions, self-attention models) and
``kv_source`` (what cross-attention keys and values read, cross-attention
models). "Forward" patching copies the source (counterfactual) run's features
into the original run; "reverse" copies the original's into the source run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.errors import InterventionError
from core.files.images import image_sha256, load_image
from core.forward.capture import Trace, capture, hooks
from core.forward.edits import Edit
from core.results.audit import AuditRecord
from core.results.readout import AnswerEffect, Target, change_line

# ---------------------------------------------------------------- answer read-outs


def answer_values(adapter, trace: Trace, answer_id: int, foil_id: int | None = None, batch: int = 0) -> Target:
    """The :class:`Target` of ``trace`` at its answer position (row ``batch``; float64 arithmetic)."""
    pos = int(trace.answer_positions[batch])
    return Target.from_logits(adapter, trace.logits[batch, pos], answer_id, foil_id, position=pos)


@dataclass
class InterventionEffect:
    """One edited run against the run it edits.

    Attributes:
        label: what was edited ("L1.H2 zero", a token set's name, ...).
        edits: each :class:`Edit` as ``Edit.to_dict()``.
        original, edited: the answer numbers without and with the edits.
        effect: edited minus original (:class:`core.results.readout.AnswerEffect`).
    """

    label: str
    edits: list[dict]
    original: Target
    edited: Target
    effect: AnswerEffect

    def line(self, label: str | None = None) -> str:
        """``label: 'blue' logit diff +3.210 -> +0.500, p 0.912 -> 0.300; predicted 'blue' -> 'red' (flipped)``."""
        return f"{label or self.label}: {change_line(self.original, self.edited, self.effect.flipped)}"

    def to_dict(self) -> dict:
        return {
            "label": self.label,
            "edits": self.edits,
            "original": self.original.to_dict(),
            "edited": self.edited.to_dict(),
            "effect": self.effect.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> InterventionEffect:
        return cls(
            str(d["label"]),
            list(d["edits"]),
            Target.from_dict(d["original"]),
            Target.from_dict(d["edited"]),
            AnswerEffect.from_dict(d["effect"]),
        )


def effect_of(label: str, edits: Sequence[Edit], original: Target, edited: Target) -> InterventionEffect:
    return InterventionEffect(
        label, [e.to_dict() for e in edits], original, edited, AnswerEffect.between(original, edited)
    )


# ---------------------------------------------------------------- audit rows


def _audit(method: str, controls: list[str], parameters: dict, notes: list[str]) -> AuditRecord:
    return AuditRecord.for_method(method, controls=controls, parameters=parameters, notes=notes)


_OFF_DISTRIBUTION = (
    "an edited run is one intervention on this input, not the component's credit: zero ablation moves "
    "activations off their distribution; mean and resample ablation depend on the reference set"
)
_REDUNDANCY = "no effect does not mean unused: another head or route can carry the same information (4.5, 4.11)"


# ---------------------------------------------------------------- running edit sets


def component_name(edit: Edit, block_names: Sequence[str]) -> str:
    """The residual component an edit changes, as the DLA names it: ``L1.H2``
    (a head's z, or its attention edges), ``L1.mlp``, ``resid entering L1``,
    ``L0.xattn (kv_source)``, ``projector_out``."""
    block = block_names[edit.block] if edit.block is not None else None
    if edit.site in ("z", "knockout"):
        return f"{block}.H{edit.head}" if edit.head is not None else f"{block} (every head)"
    if edit.site == "mlp":
        return f"{block}.mlp"
    if edit.site == "resid":
        return f"resid entering {block}"
    if edit.site == "kv_source":
        return f"{block or 'every cross block'} (kv_source)"
    return edit.site


def edit_specification(edit: Edit, block_names: Sequence[str]) -> dict:
    """What one edit did, enough to run it again: the component
    (:func:`component_name`) and :meth:`Edit.to_dict` (site, block, head, edited
    positions (None: every position), knocked-out keys, kind: zero, replace,
    knockout, the replacing value's shape, a description)."""
    return {"component": component_name(edit, block_names), **edit.to_dict()}


@dataclass
class InterventionResult:
    """Several edit sets, each run once against the same original run.

    Attributes:
        method: the audit method ("ablation", "activation patching", "attention knockout").
        position: the answer position the numbers are read at.
        original: the unedited run's numbers.
        rows: one :class:`InterventionEffect` per edit set.
        edit_sets: ``{label: [edit_specification(edit), ...]}`` for every set
            asked for (also the ones a cancel left unrun).
        call_parameters: what the caller added (``ablation``: "mean" or
            "resample" for an ablation by replacement, the reference set, ...).
    """

    method: str
    position: int
    original: Target
    rows: list[InterventionEffect]
    audit: AuditRecord = field(repr=False, default=None)
    edit_sets: dict[str, list[dict]] = field(default_factory=dict)
    call_parameters: dict = field(default_factory=dict)

    kind = "intervention"  # the session's run kind (core.results.readout.Readout)

    def summary(self) -> str:
        """``ablation at position 12: L1.H2 zero: 'blue' logit diff +3.210 -> +0.500; predicted ...``."""
        rows = "; ".join(r.line() for r in self.rows) or "no edit set ran"
        return f"{self.method} at position {self.position}: {rows}"

    @property
    def ablation(self) -> str | None:
        """An ablation's kind: the caller's ``ablation`` parameter (mean, resample),
        else "zero" when every edit zeroes, else "replace"; None for other methods."""
        if self.method != "ablation":
            return None
        if self.call_parameters.get("ablation"):
            return str(self.call_parameters["ablation"])
        kinds = {e["kind"] for edits in self.edit_sets.values() for e in edits}
        return "zero" if kinds <= {"zero"} else "replace"

    def parameters(self) -> dict:
        """The full specification: method (and ablation kind), the answer
        position the numbers are read at, answer and foil, the components
        edited, and per edit set (by its label) every edit's site, block, head,
        positions and kind (:func:`edit_specification`)."""
        components = list(dict.fromkeys(e["component"] for edits in self.edit_sets.values() for e in edits))
        own = {
            "method": self.method,
            **({"ablation": self.ablation} if self.method == "ablation" else {}),
            "position": self.position,
            "answer": self.original.answer,
            "foil": self.original.foil,
            "components": components,
            "edits": self.edit_sets,
        }
        return {**own, **{k: v for k, v in self.call_parameters.items() if k not in own}}

    def audit_records(self) -> list[AuditRecord]:
        return [self.audit] if self.audit else []

    def effect_rows(self) -> list[tuple[str, InterventionEffect]]:
        """``(label, effect)`` of every edited run: one per edit set."""
        return [(r.label, r) for r in self.rows]

    def first_effect(self) -> tuple[str, InterventionEffect] | None:
        """``(label, effect)`` of the first edit set (None when none ran): what a run list shows of it."""
        return (self.rows[0].label, self.rows[0]) if self.rows else None

    def ablated_head(self) -> tuple[int, int] | None:
        """``(block, head)`` when the first edit set edits one head's output (``z``), as an
        ablation of one head does; else None."""
        edits = self.rows[0].edits if self.rows else []
        heads = {(e.get("block"), e.get("head")) for e in edits if e.get("site") == "z" and e.get("head") is not None}
        if len(heads) != 1:
            return None
        block, head = heads.pop()
        return int(block), int(head)

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "position": self.position,
            "original": self.original.to_dict(),
            "rows": [r.to_dict() for r in self.rows],
            "audit": self.audit.to_dict() if self.audit else None,
            "ablation": self.ablation,
            "edit_sets": self.edit_sets,
        }

    @classmethod
    def from_dict(cls, d: dict) -> InterventionResult:
        """The result an intervention JSON (:meth:`to_dict`, a stored run's) describes; of
        the caller's parameters only the ablation kind is in it."""
        ablation = d.get("ablation")
        return cls(
            str(d["method"]),
            int(d["position"]),
            Target.from_dict(d["original"]),
            [InterventionEffect.from_dict(r) for r in d["rows"]],
            AuditRecord.from_dict(d["audit"]) if d.get("audit") else None,
            dict(d["edit_sets"]),
            {"ablation": ablation} if ablation is not None else {},
        )


_METHOD_NOTES = {
    "ablation": [_OFF_DISTRIBUTION, _REDUNDANCY],
    "activation patching": [
        "the patched activation is copied with everything downstream recomputed: the effect is total "
        "(direct plus indirect), on this source/target pair only",
        _REDUNDANCY,
    ],
    "attention knockout": [
        "the knocked-out weights are set to 0 before the softmax normalises, so the remaining keys gain "
        "their mass: the effect mixes losing the edge with re-routing to the others",
        "information can still reach the query through other positions that read the knocked-out keys "
        "(indirect routes), unless those edges are knocked out too",
    ],
}


@torch.no_grad()
def run_interventions(
    loaded,
    inputs,
    edit_sets: Mapping[str, Sequence[Edit]],
    answer_id: int,
    foil_id: int | None = None,
    *,
    method: str = "ablation",
    base: Trace | None = None,
    controls: Sequence[str] = (),
    parameters: Mapping | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    cancel: Callable[[], bool] | None = None,
) -> InterventionResult:
    """Run each named edit set on ``inputs`` and report its answer effect.

    Args:
        inputs: the prepared batch (one row) every run uses.
        edit_sets: ``{label: [Edit, ...]}``; each set is one edited forward.
        method: "ablation", "activation patching" or "attention knockout" (the audit row).
        base: the unedited capture of ``inputs`` (run here when None).
        controls: controls the caller applied (added to the audit row).
        parameters: added to the audit row and the result's parameters (e.g.
            ``{"ablation": "mean", "reference": ...}`` for an ablation by replacement).
        progress: ``progress(done, total, message)`` after each run.
        cancel: polled before each run; True stops with the rows so far.
    """
    if method not in _METHOD_NOTES:
        raise InterventionError(f"unknown intervention method {method!r}; expected one of {', '.join(_METHOD_NOTES)}")
    adapter = loaded.adapter
    if base is None:
        base = capture(loaded, None, "", pattern_layers=[], inputs=inputs)
    if base.edits:
        raise InterventionError("the original run must be unedited")
    original = answer_values(adapter, base, answer_id, foil_id)
    rows = []
    for i, (label, edits) in enumerate(edit_sets.items()):
        if cancel is not None and cancel():
            break
        edited = capture(loaded, None, "", pattern_layers=[], edits=list(edits), inputs=inputs)
        rows.append(effect_of(label, edits, original, answer_values(adapter, edited, answer_id, foil_id)))
        if progress is not None:
            progress(i + 1, len(edit_sets), label)
    audit = _audit(
        method,
        controls=["unedited run of the same input", *controls]
        + (["competing token (foil)"] if foil_id is not None else []),
        parameters={
            "position": int(base.answer_positions[0]),
            "answer_id": int(answer_id),
            "foil_id": foil_id,
            "edit_sets": {label: [e.describe() for e in edits] for label, edits in edit_sets.items()},
            **dict(parameters or {}),
        },
        notes=_METHOD_NOTES[method],
    )
    specs = {label: [edit_specification(e, base.block_names) for e in edits] for label, edits in edit_sets.items()}
    return InterventionResult(
        method, int(base.answer_positions[0]), original, rows, audit, specs, dict(parameters or {})
    )


# ---------------------------------------------------------------- component edits


def _component(trace: Trace, site: str, block: int, head: int | None, batch: int = 0) -> torch.Tensor:
    """``(pos, width)``: a head's z (``d_head``), an MLP output or the residual
    entering ``block`` (``d_model``), every sequence position of row ``batch``."""
    if site == "z":
        if head is None:
            raise InterventionError("a head's z needs a head")
        return trace.z[block][batch, :, head]
    if head is not None:
        raise InterventionError(f"a {site!r} activation has no head")
    if site == "mlp":
        return trace.mlp_out[block][batch]
    if site == "resid":
        return trace.resid_pre[block][batch]
    if site == "mixer":
        return trace.mixer_out[block][batch]
    raise InterventionError(f"activation patching copies 'z', 'mlp', 'resid' or 'mixer', not {site!r}")


def _positions_tuple(positions) -> tuple[int, ...]:
    if isinstance(positions, torch.Tensor):
        positions = positions.flatten().tolist()
    return tuple(int(p) for p in ([positions] if isinstance(positions, int) else positions))


def zero_ablation(block: int, head: int | None = None, positions=None, site: str | None = None) -> Edit:
    """Zero a head's ``z`` (``head`` given) or a block's MLP output at ``positions``
    (None: every position); ``site="resid"`` zeroes the residual entering ``block``."""
    return Edit(block, head, None if positions is None else _positions_tuple(positions), site=site)


def activation_patch(
    source: Trace,
    site: str,
    block: int,
    head: int | None = None,
    positions=None,
    *,
    source_positions=None,
    target: Trace | None = None,
) -> Edit:
    """The edit that copies ``source``'s activation into another run: a head's
    ``z`` (``site="z"``), an MLP output (``"mlp"``) or the residual entering
    ``block`` (``"resid"``), at target ``positions`` (None: every position of
    ``target``, or of ``source``), read at ``source_positions`` (default the same).

    Resample ablation is this with ``source`` another input from the task
    distribution (:func:`resample_ablation`)."""
    if positions is None:
        positions = range((target if target is not None else source).input_ids.shape[1])
    positions = _positions_tuple(positions)
    src = positions if source_positions is None else _positions_tuple(source_positions)
    if len(src) != len(positions):
        raise InterventionError(f"{len(src)} source positions for {len(positions)} target positions")
    values = _component(source, site, block, head)  # (pos, width)
    if max(src) >= values.shape[0]:
        raise InterventionError(f"source position {max(src)} is past the source run's {values.shape[0]} positions")
    if target is not None and max(positions) >= target.input_ids.shape[1]:
        raise InterventionError(f"position {max(positions)} is past the target run's {target.input_ids.shape[1]}")
    return Edit(block, head, positions, values[list(src)].clone(), site=site)


def resample_ablation(source: Trace, block: int, head: int | None, positions=None, *, source_positions=None) -> Edit:
    """Replace a head's ``z`` (or, ``head=None``, the MLP output) at ``positions``
    with its value on another input (``source``, a capture of a different
    image or question from the task distribution)."""
    return activation_patch(
        source, "z" if head is not None else "mlp", block, head, positions, source_positions=source_positions
    )


ROLE_ANSWER = "answer"


def position_roles(adapter, trace: Trace, batch: int = 0) -> list[str]:
    """:meth:`Adapter.token_roles` with the answer position given its own role, "answer"."""
    roles = list(adapter.token_roles(trace, batch))
    roles[int(trace.answer_positions[batch])] = ROLE_ANSWER
    return roles


@dataclass
class ReferenceMean:
    """The mean of one component's activation over a reference set.

    ``by="position"``: ``mean`` is ``(max_pos, width)``, one row per absolute
    sequence position, averaged over the reference runs in which that position
    is a real (non-padding) token; ``count (max_pos,)`` says how many. ``by="role"``:
    ``by_role`` maps each role of :func:`position_roles` (sink, visual, text,
    special, visual_delimiter, answer) to its ``(width,)`` mean over every
    position of that role in every reference run, ``role_count`` how many rows.
    """

    site: str
    block: int
    head: int | None
    by: str
    n_references: int
    mean: torch.Tensor | None = None
    count: torch.Tensor | None = None
    by_role: dict[str, torch.Tensor] = field(default_factory=dict)
    role_count: dict[str, int] = field(default_factory=dict)


def reference_mean(
    adapter,
    references: Sequence[Trace],
    block: int,
    head: int | None = None,
    *,
    by: str = "position",
    site: str | None = None,
) -> ReferenceMean:
    """Mean of a head's ``z`` (``head`` given), an MLP output or (``site="resid"``)
    the residual entering ``block``, over unedited reference captures."""
    site = site or ("z" if head is not None else "mlp")
    if by not in ("position", "role"):
        raise InterventionError(f"mean ablation averages by 'position' or 'role', not {by!r}")
    if not references:
        raise InterventionError("mean ablation needs at least one reference run")
    if any(t.edits for t in references):
        raise InterventionError("reference runs must be unedited")
    out = ReferenceMean(site, block, head, by, len(references))
    if by == "position":
        n = max(t.input_ids.shape[1] for t in references)
        total, count = None, torch.zeros(n, dtype=torch.long)
        for t in references:
            x = _component(t, site, block, head)  # (pos, width)
            dtype = x.dtype
            x = x.double().cpu()
            real = torch.tensor([r != "padding" for r in adapter.token_roles(t)])
            if total is None:
                total = torch.zeros(n, x.shape[-1], dtype=torch.float64)
            total[: x.shape[0]][real] += x[real]
            count[: x.shape[0]] += real.long()
        out.mean = (total / count.clamp_min(1)[:, None]).to(dtype)
        out.count = count
        return out
    sums: dict[str, torch.Tensor] = {}
    for t in references:
        x = _component(t, site, block, head).double().cpu()
        for i, role in enumerate(position_roles(adapter, t)):
            if role == "padding":
                continue
            sums[role] = sums.get(role, 0) + x[i]
            out.role_count[role] = out.role_count.get(role, 0) + 1
    dtype = _component(references[0], site, block, head).dtype
    out.by_role = {r: (s / out.role_count[r]).to(dtype) for r, s in sums.items()}
    return out


def mean_ablation(adapter, target: Trace, mean: ReferenceMean, positions=None) -> Edit:
    """Replace the component's activation at ``positions`` of ``target`` (None:
    every real position) with the reference mean: the same absolute position's
    mean (``by="position"``) or the mean of the position's role (``by="role"``)."""
    roles = position_roles(adapter, target)
    if positions is None:
        positions = [i for i, r in enumerate(roles) if r != "padding"]
    positions = _positions_tuple(positions)
    device = _component(target, mean.site, mean.block, mean.head).device
    if mean.by == "position":
        n = mean.mean.shape[0]
        missing = [p for p in positions if p >= n or int(mean.count[p]) == 0]
        if missing:
            raise InterventionError(f"no reference run has a real token at positions {missing}: average by role")
        value = mean.mean[list(positions)]
    else:
        missing = sorted({roles[p] for p in positions if roles[p] not in mean.by_role})
        if missing:
            raise InterventionError(f"the reference set has no position with role {', '.join(missing)}")
        value = torch.stack([mean.by_role[roles[p]] for p in positions])
    return Edit(mean.block, mean.head, positions, value.to(device), site=mean.site)


def visual_keys(trace: Trace, block: int, tokens: Sequence[int], batch: int = 0) -> tuple[int, ...]:
    """The key indices of visual tokens ``tokens`` in block ``block``: their
    sequence positions for self-attention, the token indices themselves for
    cross-attention (the keys are the visual tokens)."""
    tokens = [int(t) for t in tokens]
    if trace.block_kinds[block] == "cross":
        return tuple(tokens)
    positions = trace.visual_positions[batch]
    if tokens and max(tokens) >= positions.shape[0]:
        raise InterventionError(f"visual token {max(tokens)} out of range ({positions.shape[0]} visual tokens)")
    return tuple(int(positions[t]) for t in tokens)


def knockout(block: int, keys: Sequence[int], positions=None, head: int | None = None) -> Edit:
    """Remove the attention edges from query ``positions`` (None: every query)
    to ``keys`` in block ``block`` (``head``: one head, None: every head) before
    the softmax; use :func:`visual_keys` for a set of visual tokens."""
    return Edit(
        block, head, None if positions is None else _positions_tuple(positions), site="knockout", keys=tuple(keys)
    )


def region_knockout(
    trace: Trace, blocks: Sequence[int], tokens: Sequence[int], positions=None, head: int | None = None
) -> list[Edit]:
    """Knock out the edges from query ``positions`` (None: the answer position)
    to the visual tokens ``tokens`` (e.g. ``core.forward.geometry.region_tokens`` of a
    region) in each of ``blocks``, mapping the tokens to each block's keys."""
    if positions is None:
        positions = [int(trace.answer_positions[0])]
    return [knockout(b, visual_keys(trace, b, tokens), positions, head) for b in blocks]


# ---------------------------------------------------------------- visual-feature patching


def visual_site_features(loaded, inputs, site: str, layer: int | None = None) -> tuple[Trace, torch.Tensor]:
    """One unedited capture of ``inputs`` and the features of every visual
    token at ``site``: ``(n_visual, width)`` for batch row 0.

    ``vision_out`` / ``projector_out`` are recorded with hooks the adapter
    supplies; ``resid`` is ``trace.resid_pre[layer]`` at the visual positions;
    ``kv_source`` is ``trace.kv_source`` of cross block ``layer`` (None: the
    first cross block; every cross block reads the same tokens)."""
    adapter = loaded.adapter
    store: dict = {}
    regs = adapter.site_record_hooks(site, store) if site in ("vision_out", "projector_out") else []
    with hooks(regs):
        trace = capture(loaded, None, "", pattern_layers=[], inputs=inputs)
    if site in ("vision_out", "projector_out"):
        if site not in store:
            raise InterventionError(f"{adapter.family}: the {site!r} site did not run")
        return trace, store[site][0]
    if site == "resid":
        if layer is None or not 0 <= layer < trace.n_blocks:
            raise InterventionError(f"the 'resid' site needs a block index (0..{trace.n_blocks - 1})")
        if trace.visual_positions.shape[1] == 0:
            raise InterventionError(
                f"{adapter.family}: the visual tokens are not in the sequence (cross-attention): patch 'kv_source'"
            )
        return trace, trace.resid_pre[layer][0, trace.visual_positions[0]]
    if site == "kv_source":
        cross = [b for b, k in enumerate(trace.block_kinds) if k == "cross"]
        if not cross:
            raise InterventionError(f"{adapter.family}: no cross-attention blocks, so no 'kv_source' site")
        block = cross[0] if layer is None else layer
        if block not in cross:
            raise InterventionError(f"block {block} is not a cross-attention block")
        return trace, trace.kv_source[block][0]
    raise InterventionError(f"unknown visual site {site!r}; expected vision_out, projector_out, resid or kv_source")


def visual_patch_edit(
    site: str, tokens: Sequence[int], features: torch.Tensor, trace: Trace, layer: int | None = None
) -> Edit:
    """The edit writing ``features[tokens]`` (``features (n_visual, width)``, from
    :func:`visual_site_features` of the source run) into the run ``trace`` describes."""
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise InterventionError("an empty token set patches nothing")
    if max(tokens) >= features.shape[0]:
        raise InterventionError(f"visual token {max(tokens)} out of range ({features.shape[0]} visual tokens)")
    value = features[tokens].clone()
    if site in ("vision_out", "projector_out"):
        return Edit(None, None, tuple(tokens), value, site=site)
    if site == "kv_source":
        return Edit(layer, None, tuple(tokens), value, site="kv_source")
    if site == "resid":
        return Edit(layer, None, visual_keys(trace, layer, tokens), value, site="resid")
    raise InterventionError(f"unknown visual site {site!r}")


@dataclass
class VisualPatchRow:
    """One token set patched in both directions.

    Attributes:
        name, tokens: the set's name and visual-token indices.
        forward: the source run's features written into the original run.
        reverse: the original run's features written into the source run (None when not run).
        forward_matches_source: the forward-patched argmax equals the source run's.
        reverse_matches_original: the reverse-patched argmax equals the original run's.
    """

    name: str
    tokens: list[int]
    forward: InterventionEffect
    reverse: InterventionEffect | None
    forward_matches_source: bool
    reverse_matches_original: bool | None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "tokens": self.tokens,
            "forward": self.forward.to_dict(),
            "reverse": None if self.reverse is None else self.reverse.to_dict(),
            "forward_matches_source": self.forward_matches_source,
            "reverse_matches_original": self.reverse_matches_original,
        }

    @classmethod
    def from_dict(cls, d: dict) -> VisualPatchRow:
        return cls(
            str(d["name"]),
            [int(t) for t in d["tokens"]],
            InterventionEffect.from_dict(d["forward"]),
            InterventionEffect.from_dict(d["reverse"]) if d.get("reverse") is not None else None,
            bool(d["forward_matches_source"]),
            d.get("reverse_matches_original"),
        )


@dataclass
class VisualPatchResult:
    """Visual-feature patching at one site between an original and a source
    (counterfactual) image, for several token sets. ``original`` and
    ``source`` are the unpatched runs read with the same answer and foil;
    ``source_image_sha256`` (:func:`core.files.images.image_sha256`) and
    ``source_image_path`` (None for an image given without one) name the
    source image; ``reverse``: the reverse direction ran too; ``answer_prefix``:
    the answer tokens both runs had after the prompt (teacher forcing)."""

    site: str
    layer: int | None
    original: Target
    source: Target
    rows: list[VisualPatchRow]
    audit: AuditRecord = field(repr=False, default=None)
    source_image_sha256: str | None = None
    source_image_path: str | None = None
    reverse: bool = True
    answer_prefix: tuple[int, ...] = ()

    kind = "intervention"  # the session's run kind, as the app records it (core.results.readout.Readout)

    def summary(self) -> str:
        """``visual-feature patching at projector_out: painted region forward: 'blue' logit diff ...``."""
        where = self.site if self.layer is None else f"{self.site} block {self.layer}"
        rows = [effect.line(label) for label, effect in self.effect_rows()]
        return f"visual-feature patching at {where}: " + ("; ".join(rows) or "no token set ran")

    def parameters(self) -> dict:
        """The full specification: the site and layer, answer and foil, each
        token set's visual-token indices, both directions or forward only, and
        the source image (its path when known, its SHA-256)."""
        return {
            "method": "visual-feature patching",
            "site": self.site,
            "layer": self.layer,
            "answer": self.original.answer,
            "foil": self.original.foil,
            "token_sets": {r.name: r.tokens for r in self.rows},
            "reverse": self.reverse,
            "source_image": self.source_image_path,
            "source_image_sha256": self.source_image_sha256,
            "answer_prefix_ids": list(self.answer_prefix),
        }

    def audit_records(self) -> list[AuditRecord]:
        return [self.audit] if self.audit else []

    def effect_rows(self) -> list[tuple[str, InterventionEffect]]:
        """``(label, effect)`` of every patched run: each token set forward, then reverse when it
        ran (a reverse row starts from the source image's run)."""
        rows = []
        for r in self.rows:
            rows.append((f"{r.name} forward", r.forward))
            if r.reverse is not None:
                rows.append((f"{r.name} reverse", r.reverse))
        return rows

    def first_effect(self) -> tuple[str, InterventionEffect] | None:
        """``(label, effect)`` of the first token set's forward patch (None when none ran)."""
        return (f"{self.rows[0].name} patched at {self.site}", self.rows[0].forward) if self.rows else None

    def ablated_head(self) -> None:
        """No head is ablated by a patch (see :meth:`InterventionResult.ablated_head`)."""
        return None

    def to_dict(self) -> dict:
        return {
            "site": self.site,
            "layer": self.layer,
            "original": self.original.to_dict(),
            "source": self.source.to_dict(),
            "rows": [r.to_dict() for r in self.rows],
            "audit": self.audit.to_dict() if self.audit else None,
            "source_image": {"path": self.source_image_path, "sha256": self.source_image_sha256},
            "reverse": self.reverse,
            "answer_prefix_ids": list(self.answer_prefix),
        }

    @classmethod
    def from_dict(cls, d: dict) -> VisualPatchResult:
        """The result a visual-patch JSON (:meth:`to_dict`, a stored run's) describes."""
        source_image = d.get("source_image") or {}
        return cls(
            str(d["site"]),
            d.get("layer"),
            Target.from_dict(d["original"]),
            Target.from_dict(d["source"]),
            [VisualPatchRow.from_dict(r) for r in d["rows"]],
            AuditRecord.from_dict(d["audit"]) if d.get("audit") else None,
            source_image.get("sha256"),
            source_image.get("path"),
            bool(d["reverse"]),
            tuple(int(t) for t in d.get("answer_prefix_ids") or ()),
        )


_SITE_NOTES = {
    "vision_out": "the vision encoder mixes every patch through its own attention before this site: tokens outside "
    "the set already carry part of the source image's information, and patched tokens keep none of the original's",
    "projector_out": "the projector is per token, so this site equals the residual entering block 0 at the visual "
    "positions; the vision encoder has mixed patches before it",
    "resid": "the residual at block l > 0 already mixes text and visual positions: patching the visual positions "
    "leaves what later text positions read from them in earlier blocks unchanged",
    "kv_source": "every cross-attention block reads the patched tokens (block=None) or only the named block; the "
    "vision tower has mixed patches before this site",
}


def _token_sets(token_sets, n_visual: int) -> dict[str, list[int]]:
    if token_sets is None:
        return {"all": list(range(n_visual))}
    if isinstance(token_sets, Mapping):
        return {str(k): [int(t) for t in v] for k, v in token_sets.items()}
    return {f"set{i}": [int(t) for t in v] for i, v in enumerate(token_sets)}


@torch.no_grad()
def patch_visual_features(
    loaded,
    image,
    question: str,
    source_image,
    *,
    site: str,
    token_sets: Mapping[str, Sequence[int]] | Sequence[Sequence[int]] | None = None,
    layer: int | None = None,
    answer: str | int | None = None,
    foil: str | int | None = None,
    reverse: bool = True,
    source_image_path: str | Path | None = None,
    answer_prefix: Sequence[int] = (),
    progress: Callable[[int, int, str], None] | None = None,
    cancel: Callable[[], bool] | None = None,
) -> VisualPatchResult:
    """Patch the features of chosen visual tokens at ``site`` from a
    counterfactual image into the original run (forward) and back (reverse).

    Args:
        image, source_image: the original and the counterfactual image (paths,
            PIL images or uint8 arrays), asked the same ``question``.
        site: "vision_out", "projector_out", "resid" (with ``layer``, the block
            whose entering residual is patched) or "kv_source" (``layer``: one
            cross block, None: every cross block).
        token_sets: ``{name: [visual token index, ...]}`` or a list of index
            lists; None: one set with every visual token.
        answer, foil: tokens (strings or ids) read in every run; default: the
            original run's argmax and the source run's argmax (None if equal).
        source_image_path: where a PIL / array ``source_image`` was read from
            (a path ``source_image`` is its own); recorded with its SHA-256.
        answer_prefix: answer tokens after the prompt in both runs (teacher
            forcing: the numbers are the next answer token's, :mod:`core.answer_text`).
        progress: ``progress(done, total, message)`` after each patched run.
        cancel: polled before each token set; True stops with the rows so far.
    """
    adapter = loaded.adapter
    if isinstance(source_image, (str, Path)) and source_image_path is None:
        source_image_path = source_image
    source_image = load_image(source_image)  # once: its hash names it in the result, the same pixels are run
    inputs = adapter.prepare([image], [question], answer_prefix=answer_prefix)
    source_inputs = adapter.prepare([source_image], [question], answer_prefix=answer_prefix)
    base, feats = visual_site_features(loaded, inputs, site, layer)
    src, src_feats = visual_site_features(loaded, source_inputs, site, layer)
    if site == "resid" and not torch.equal(base.visual_positions, src.visual_positions):
        raise InterventionError("the two runs place their visual tokens at different positions")

    def token(t, fallback):
        if t is None:
            return fallback
        return adapter.as_token_id(t)

    base_pred = int(base.logits[0, int(base.answer_positions[0])].argmax())
    src_pred = int(src.logits[0, int(src.answer_positions[0])].argmax())
    answer_id = token(answer, base_pred)
    foil_id = token(foil, src_pred if src_pred != answer_id else None)
    if foil_id == answer_id:
        raise InterventionError("the foil must differ from the answer")
    original = answer_values(adapter, base, answer_id, foil_id)
    source = answer_values(adapter, src, answer_id, foil_id)
    sets = _token_sets(token_sets, feats.shape[0])
    total = len(sets) * (2 if reverse else 1)
    rows, done = [], 0
    for name, toks in sets.items():
        if cancel is not None and cancel():
            break
        fwd_edit = visual_patch_edit(site, toks, src_feats, base, layer)
        fwd_trace = capture(loaded, None, "", pattern_layers=[], edits=[fwd_edit], inputs=inputs)
        fwd = effect_of(name, [fwd_edit], original, answer_values(adapter, fwd_trace, answer_id, foil_id))
        done += 1
        if progress is not None:
            progress(done, total, f"{name}: forward")
        rev = None
        if reverse:
            rev_edit = visual_patch_edit(site, toks, feats, src, layer)
            rev_trace = capture(loaded, None, "", pattern_layers=[], edits=[rev_edit], inputs=source_inputs)
            rev = effect_of(name, [rev_edit], source, answer_values(adapter, rev_trace, answer_id, foil_id))
            done += 1
            if progress is not None:
                progress(done, total, f"{name}: reverse")
        rows.append(
            VisualPatchRow(
                name,
                toks,
                fwd,
                rev,
                fwd.edited.predicted_id == source.predicted_id,
                None if rev is None else rev.edited.predicted_id == original.predicted_id,
            )
        )
    audit = _audit(
        "visual-feature patching",
        controls=[
            "paired counterfactual image asked the same question",
            "unpatched runs of both images read with the same answer and foil",
            *(["reverse direction (original's features into the counterfactual run)"] if reverse else []),
        ],
        parameters={
            "site": site,
            "layer": layer,
            "answer_id": answer_id,
            "foil_id": foil_id,
            "token_sets": {k: v for k, v in sets.items()},
            "source_image": None if source_image_path is None else str(source_image_path),
            "source_image_sha256": image_sha256(source_image),
            "answer_prefix_ids": [int(t) for t in answer_prefix],
        },
        notes=[
            _SITE_NOTES[site],
            "a flip shows the patched features suffice, with everything downstream recomputed, to carry the "
            "difference between these two images to the answer; it does not name the head or route that reads them",
        ],
    )
    return VisualPatchResult(
        site,
        layer,
        original,
        source,
        rows,
        audit,
        audit.parameters["source_image_sha256"],
        audit.parameters["source_image"],
        reverse,
        tuple(int(t) for t in answer_prefix),
    )
