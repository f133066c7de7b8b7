"""AuditRecord: what a result can and cannot support (METHODS.md, 4.13).

Every method returns one with its numbers. The fixed columns come from the
chapter's audit table; ``controls`` and ``parameters`` say what this call
actually did.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# The chapter's audit table (4.13), one row per method family.
METHOD_TABLE: dict[str, dict[str, str]] = {
    "pattern analysis": {
        "question": "where a head routes",
        "operation": "observe A; mass / entropy / relation hit",
        "controls": "padding, position, matched heads",
        "supports": "conditional routing regularities",
        "cannot_support": "value content, cause of output",
    },
    "qk/ov circuit": {
        "question": "what a head can select (QK) and write (OV)",
        "operation": "W_Q^T R_p^T R_j W_K bilinear form; W_O W_V SVD; copying through E, OV, W_U",
        "controls": "position scheme, biases, weight level vs activation level",
        "supports": "potential selection and copying; why a realized pattern arose",
        "cannot_support": "use on natural data, effect on the output",
    },
    "source contribution": {
        "question": "what is written after routing",
        "operation": "A W_O W_V r; norm; u^T J_Norm(x_L) c",
        "controls": "final-norm convention, signed effect",
        "supports": "local first-order linear write",
        "cannot_support": "later full effect",
    },
    "rollout / flow": {
        "question": "how position links accumulate across layers",
        "operation": "product of attention matrices",
        "controls": "residual weight, compare with ablation",
        "supports": "reachability in a simplified graph",
        "cannot_support": "full-model information flow",
    },
    "residual DLA": {
        "question": "which addends align directly with the output",
        "operation": "additive split and u^T J_Norm(x_L) c",
        "controls": "linearization point, competing token",
        "supports": "local first-order direct readout",
        "cannot_support": "indirect causal credit",
    },
    "logit lens": {
        "question": "can the final head read an intermediate layer",
        "operation": "final norm + unembedding",
        "controls": "success/failure samples, layer distribution shift",
        "supports": "readability in final coordinates",
        "cannot_support": "downstream use",
    },
    "tuned lens": {
        "question": "can a simple translator predict the final state",
        "operation": "train T_l; KL / accuracy",
        "controls": "capacity, data, identity baseline",
        "supports": "decodability by a given reader",
        "cannot_support": "that the model already holds explicit logits",
    },
}


@dataclass
class AuditRecord:
    """One row of the audit table for one call.

    Attributes:
        method: a key of :data:`METHOD_TABLE`.
        controls: the controls this call applied (not the ones it could have).
        parameters: what the call was run with (layers, positions, tokens...).
        notes: caveats specific to this call.
    """

    method: str
    question: str
    operation: str
    controls: list[str]
    supports: str
    cannot_support: str
    parameters: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def for_method(cls, method: str, *, controls: list[str], parameters: dict, notes: list[str] | None = None):
        row = METHOD_TABLE[method]
        return cls(
            method,
            row["question"],
            row["operation"],
            list(controls),
            row["supports"],
            row["cannot_support"],
            dict(parameters),
            list(notes or []),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AuditRecord:
        return cls(**d)
