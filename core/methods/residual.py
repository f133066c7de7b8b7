"""Residual decomposition and direct logit attribution (docs/METHODS.md §4.4, §4.7).

    x_L = x_0 + sum_l sum_h W_O^h z^h_l + sum_l b_O,l + sum_l m_l

Each component ``c`` is reported under every convention, side by side:

* ``norm``: ||c||_2 (ignores direction);
* ``projection``: u^T c, no norm at all;
* ``dla_frozen``: u^T (gain * center(c) / sigma(x_L)), the final norm's
  scale frozen at x_L. Additive: it sums to u^T (Norm_f(x_L) - bias_f);
* ``dla_jacobian``: u^T J_Norm_f(x_L) c, a first-order sensitivity. For a
  scale-invariant norm it sums to about 0, so it is not an additive split.

``u`` is W_U[:, answer] - W_U[:, foil] with a foil, else W_U[:, answer].

Every product and sum runs in the accumulation dtype of the captured tensors
(:func:`core.shell.precision.accumulating`): float32 for a bfloat16 or float16
model, the model's own dtype for float32 and float64 (docs/METHODS.md, "Precision").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.forward.capture import ATTENTION_KINDS, capture
from core.forward.edits import Edit
from core.methods.stats import spearman
from core.results.audit import AuditRecord
from core.shell.precision import accumulating, dtype_name, unit_roundoff


@dataclass
class Component:
    name: str
    norm: float
    projection: float
    dla_frozen: float
    dla_jacobian: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class ResidualDecomposition:
    """Components of x_L at one position, under each norm convention.

    Attributes:
        reconstruction_max_abs_err: max |sum of components - x_L|.
        reconstruction_rel_err: ||sum of components - x_L||_2 / ||x_L||_2.
        reconstruction_bound: what rounding alone allows ``reconstruction_rel_err``
            to reach in the model's dtype (:func:`reconstruction_bound`).
        reconstruction_ok: ``reconstruction_rel_err <= reconstruction_bound``: the
            split is exact to the model's rounding; False says a component is
            missing or wrong, not that the model runs in half precision.
        dtype: the dtype the model ran in (the captured tensors'), e.g. "bfloat16".
        target_logit: u^T (W_U^T Norm_f(x_L)) + u^T b_U, the model's own logit
            (difference) at this position (recomputed in the accumulation dtype).
        frozen_sum_expected: what ``dla_frozen`` must sum to:
            target_logit - u^T b_U - u^T bias_f.
    """

    position: int
    answer_id: int
    foil_id: int | None
    components: list[Component]
    reconstruction_max_abs_err: float
    target_logit: float
    frozen_sum_expected: float
    reconstruction_rel_err: float = 0.0
    reconstruction_bound: float = 0.0
    dtype: str = "float32"
    audit: AuditRecord = field(repr=False, default=None)

    @property
    def reconstruction_ok(self) -> bool:
        return self.reconstruction_rel_err <= self.reconstruction_bound

    def to_dict(self) -> dict:
        return {
            "position": self.position,
            "answer_id": self.answer_id,
            "foil_id": self.foil_id,
            "reconstruction_max_abs_err": self.reconstruction_max_abs_err,
            "reconstruction_rel_err": self.reconstruction_rel_err,
            "reconstruction_bound": self.reconstruction_bound,
            "reconstruction_ok": self.reconstruction_ok,
            "dtype": self.dtype,
            "target_logit": self.target_logit,
            "frozen_sum_expected": self.frozen_sum_expected,
            "components": [c.to_dict() for c in self.components],
            "audit": self.audit.to_dict() if self.audit else None,
        }


def reconstruction_bound(
    C: torch.Tensor, x_L: torch.Tensor, n_blocks: int, model_dtype: torch.dtype, n_writes: int = 0
) -> float:
    """How far ``||sum C - x_L|| / ||x_L||`` may be from 0 by rounding alone.

    The model builds x_L by adding each block's writes to the stream in its own
    dtype: per block the attention output is rounded once (one ``o_proj`` product,
    which the stack splits into per-head writes) and the attention and MLP writes
    are each added with one rounding, and each of the family's ``n_writes`` other
    stream writes (:meth:`Adapter.stream_writes`) with one more: about
    ``3 n_blocks + n_writes`` roundings, each at
    most ``u |s_k|`` elementwise (``u``: the model dtype's unit roundoff, 2^-8 for
    bfloat16, 2^-11 for float16), ``s_k`` the partial sum the add produced; in the
    2-norm ``||e_k|| <= u ||s_k||``. Both the model's products (``d_model`` terms)
    and the read-out's sum of the ``n`` components accumulate in the accumulation
    dtype (unit roundoff ``u_acc``), adding at most ``(d_model + n) u_acc`` of the
    same sizes. So

        ||sum C - x_L|| <= ((3 n_blocks + n_writes) u + (d_model + n) u_acc) max_k ||s_k||

    with the partial sums ``s_k`` read as the running sums of the stack (stream
    order; ``C`` in the accumulation dtype). A bfloat16 run therefore reaches an
    error of order ``n_layers u_bf16 |x_L|`` by construction, while a float32 run
    whose stack lost or doubled a component fails by orders of magnitude.
    Returned relative to ``||x_L||``."""
    u_model = unit_roundoff(model_dtype)
    u_acc = unit_roundoff(C.dtype)
    largest_partial = float(C.cumsum(0).norm(dim=-1).max())
    roundings = (3 * n_blocks + n_writes) * u_model + (C.shape[-1] + C.shape[0]) * u_acc
    return roundings * largest_partial / max(float(x_L.norm()), torch.finfo(C.dtype).tiny)


def target_direction(adapter, answer_id: int, foil_id: int | None) -> torch.Tensor:
    """``u (d_model,)``: the answer's unembedding column minus the foil's."""
    W_U = adapter.W_U
    u = W_U[:, answer_id]
    return u - W_U[:, foil_id] if foil_id is not None else u


def component_stack(adapter, trace, position: int, batch: int = 0) -> tuple[list[str], torch.Tensor]:
    """Names and ``(n_components, d_model)`` vectors that sum to x_L at
    ``position``: the family's own split of its residual graph
    (:meth:`core.models.adapter.Adapter.component_stack`)."""
    return adapter.component_stack(trace, position, batch)


@torch.no_grad()
def decompose(
    adapter, trace, answer_id: int, foil_id: int | None = None, position: int | None = None, batch: int = 0
) -> ResidualDecomposition:
    """Split x_L at ``position`` (default: the answer position) into components."""
    pos = int(trace.answer_positions[batch]) if position is None else int(position)
    names, C = component_stack(adapter, trace, pos, batch)
    model_dtype = trace.final_resid.dtype
    # half-precision captures are summed in float32 (exact upcast); float32 / float64 as they are
    C = accumulating(C)
    x_L = accumulating(trace.final_resid[batch, pos])
    norm_f = adapter.final_norm_layer()
    u = target_direction(adapter, answer_id, foil_id).to(C.device, C.dtype)
    b_U = adapter.b_U.to(C.device, C.dtype)
    u_bias = b_U[answer_id] - (b_U[foil_id] if foil_id is not None else 0)
    bias_f = norm_f.frozen_bias(x_L)  # a head transform's (BLIP) depends on x_L under the frozen convention
    norm_bias = (
        bias_f.to(C.device, C.dtype) @ u if bias_f is not None else torch.zeros((), dtype=C.dtype, device=C.device)
    )
    target = norm_f(x_L) @ u + u_bias
    proj = C @ u
    frozen = norm_f.frozen(x_L, C) @ u
    jac = C @ norm_f.vjp(x_L, u)
    norms = C.norm(dim=-1)
    comps = [
        Component(n, float(a), float(b), float(c), float(d)) for n, a, b, c, d in zip(names, norms, proj, frozen, jac)
    ]
    residue = C.sum(0) - x_L
    err = float(residue.abs().max())
    rel_err = float(residue.norm()) / max(float(x_L.norm()), torch.finfo(C.dtype).tiny)
    bound = reconstruction_bound(C, x_L, trace.n_blocks, model_dtype, len(adapter.stream_writes(trace)))
    audit = AuditRecord.for_method(
        "residual DLA",
        controls=[
            "reconstruction checked",
            f"{adapter.frozen_convention} (dla_frozen)",
            "linearised at x_L (dla_jacobian)",
        ]
        + (["competing token (foil)"] if foil_id is not None else []),
        parameters={"position": pos, "answer_id": answer_id, "foil_id": foil_id, "n_components": len(names)},
        notes=[
            "dla_frozen is additive: it sums to the logit (difference) minus the unembedding and final-norm biases",
            "dla_jacobian is a first-order sensitivity at x_L; it does not sum to the logit",
            "an addend's direct projection says nothing of its indirect effect through later layers",
        ]
        + ([] if rel_err <= bound else [reconstruction_failure(dtype_name(model_dtype))]),
    )
    return ResidualDecomposition(
        pos,
        answer_id,
        foil_id,
        comps,
        err,
        float(target),
        float(target - u_bias - norm_bias),
        rel_err,
        bound,
        dtype_name(model_dtype),
        audit,
    )


def reconstruction_failure(dtype: str) -> str:
    """The audit note of a decomposition whose error exceeds its dtype's bound."""
    return f"reconstruction error exceeds the {dtype} bound: the decomposition is not exact"


def component_edit(trace, name: str, positions: tuple[int, ...] | None):
    """The :class:`core.forward.edits.Edit` that removes component ``name`` ("L3.H1",
    "L2.xattn.H0", "L1.mlp") at ``positions``; None for "embed" and biases,
    which no forward can drop."""

    block_name, _, part = name.rpartition(".")
    if block_name not in trace.block_names:
        return None
    block = trace.block_names.index(block_name)
    if part == "mlp":
        return Edit(block, None, positions)
    if part.startswith("H") and part[1:].isdigit():
        return Edit(block, int(part[1:]), positions)
    if part.startswith("E") and part[1:].isdigit():  # a routed expert's write
        return Edit(block, None, positions, site="expert", expert=int(part[1:]))
    if trace.block_kinds[block] not in ATTENTION_KINDS and not part.endswith("residue"):  # the mixer's write
        return Edit(block, None, positions, site="mixer")
    return None


@dataclass
class RerunRow:
    """One component under the linear conventions and under actual re-runs.

    Attributes:
        direct_removal: T(x_L) - T(x_L - c): the final norm recomputed without
            the component, everything upstream unchanged (exact direct effect).
        total_removal: T(model) - T(model with the component's write zeroed at
            the edited positions, every later layer recomputed): the actual
            re-run, direct plus indirect effects.
    """

    name: str
    dla_frozen: float
    dla_jacobian: float
    direct_removal: float
    total_removal: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RerunComparison:
    position: int
    answer_id: int
    foil_id: int | None
    edited_positions: str  # "target" or "all"
    rows: list[RerunRow]
    rank_correlation: dict[str, float]  # Spearman of each linear estimate against total_removal
    audit: AuditRecord = field(repr=False, default=None)

    def to_dict(self) -> dict:
        return {
            "position": self.position,
            "answer_id": self.answer_id,
            "foil_id": self.foil_id,
            "edited_positions": self.edited_positions,
            "rows": [r.to_dict() for r in self.rows],
            "rank_correlation": self.rank_correlation,
            "audit": self.audit.to_dict() if self.audit else None,
        }


def _spearman(a: list[float], b: list[float]) -> float:
    """:func:`core.methods.stats.spearman` (ties given their mean rank), NaN where undefined."""
    rho = spearman(a, b)
    return float("nan") if rho is None else rho


@torch.no_grad()
def compare_with_rerun(
    loaded,
    trace,
    answer_id: int,
    foil_id: int | None = None,
    *,
    names: list[str] | None = None,
    top: int = 10,
    positions: str = "target",
    inputs=None,
    progress=None,
) -> RerunComparison:
    """Frozen-scale and Jacobian DLA next to what removing the component does.

    One forward per component: pass ``names`` or let the ``top`` components by
    |dla_frozen| be chosen. ``positions="target"`` zeroes the component's write
    at the target position only (the write DLA describes); ``"all"`` at every
    position (adds its effect through other positions' keys and values).
    ``trace`` must be an unedited capture of ``inputs``.
    """

    if trace.edits:
        raise ValueError("compare against an unedited trace")
    adapter = loaded.adapter
    r = decompose(adapter, trace, answer_id, foil_id)
    pos = r.position
    if inputs is None:
        raise ValueError("pass the prepared inputs the trace was captured from")
    where = (pos,) if positions == "target" else None
    comps = {c.name: c for c in r.components}
    if names is None:
        removable = [c for c in r.components if component_edit(trace, c.name, where) is not None]
        names = [c.name for c in sorted(removable, key=lambda c: -abs(c.dla_frozen))[:top]]
    all_names, C = component_stack(adapter, trace, pos)
    C = accumulating(C)
    x_L = accumulating(trace.final_resid[0, pos])
    norm_f = adapter.final_norm_layer()
    u = target_direction(adapter, answer_id, foil_id).to(x_L.device, x_L.dtype)

    def readout(logits_row: torch.Tensor) -> float:
        logits_row = accumulating(logits_row)  # a half-precision difference would round again
        return float(logits_row[answer_id] - (logits_row[foil_id] if foil_id is not None else 0))

    base = readout(trace.logits[0, pos])
    rows = []
    for i, name in enumerate(names):
        edit = component_edit(trace, name, where)
        if edit is None:
            raise ValueError(f"{name!r} cannot be removed by a re-run (embedding or bias)")
        c = C[all_names.index(name)]
        direct = float((norm_f(x_L) - norm_f(x_L - c)) @ u)
        edited = capture(loaded, None, "", pattern_layers=[], edits=[edit], inputs=inputs)
        total = base - readout(edited.logits[0, pos])
        rows.append(RerunRow(name, comps[name].dla_frozen, comps[name].dla_jacobian, direct, total))
        if progress:
            progress(i + 1, len(names), name)
    totals = [x.total_removal for x in rows]
    corr = {
        "dla_frozen": _spearman([x.dla_frozen for x in rows], totals),
        "dla_jacobian": _spearman([x.dla_jacobian for x in rows], totals),
        "direct_removal": _spearman([x.direct_removal for x in rows], totals),
    }
    audit = AuditRecord.for_method(
        "residual DLA",
        controls=[
            f"{adapter.frozen_convention} (dla_frozen)",
            "linearised at x_L (dla_jacobian)",
            "actual re-run: component zeroed, later layers recomputed (total_removal)",
            f"edited positions: {positions}",
        ]
        + (["competing token (foil)"] if foil_id is not None else []),
        parameters={"position": pos, "answer_id": answer_id, "foil_id": foil_id, "components": names},
        notes=[
            "zero ablation moves activations off their distribution; the re-run is one intervention, not the "
            "component's true credit",
            "direct_removal - dla_frozen is the final norm's non-linearity; total_removal - direct_removal is "
            "the indirect effect through later layers",
        ],
    )
    return RerunComparison(pos, answer_id, foil_id, positions, rows, corr, audit)
