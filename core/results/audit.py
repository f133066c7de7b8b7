"""AuditRecord: what a result can and cannot support (docs/METHODS.md §4.13).

Every method returns one with its numbers. The fixed columns come from the
chapter's audit table; ``controls`` and ``parameters`` say what this call
actually did. :func:`audit_csv` and :func:`audit_markdown` are the one pair of
table writers (the session export's audit table, the dataset audit's
``audit.csv`` / ``audit.md`` and its per-sample tables), with one cell
escaping (:func:`cell`, :func:`markdown_cell`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# The chapter's audit table (docs/METHODS.md §4.13), one row per method family.
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
    "region counterfactual": {
        "question": "does the answer depend on an image region's pixels",
        "operation": "fill the region (mean / constant / blur / noise / inpaint / paste), re-run processor and "
        "model; change in answer logit, logit difference, probability, argmax",
        "controls": "several fills, matched-area control region, original and edited values side by side",
        "supports": "the answer's dependence on the region under this replacement",
        "cannot_support": "which internal route carries it; that the object itself (not the fill's artefact) "
        "is the cause",
    },
    "model output": {
        "question": "what the model answers at the answer position",
        "operation": "softmax of the logits at the answer position; top token vs the labelled answer; "
        "answer-minus-foil logit difference",
        "controls": "labelled answer and foil, one-token answers, question kinds reported apart",
        "supports": "behaviour on this sample set (accuracy, margins)",
        "cannot_support": "which internal route produced the answer",
    },
    "non-unique attention": {
        "question": "whether the observed pattern is the only one that gives this head output",
        "operation": "search alternative A' with sum_j A'_j v_j within a relative tolerance of the real output, "
        "moving mass off a source set, at three constraint levels",
        "controls": "simplex and mask; bounded score perturbation; legal query (keys as computed, query through "
        "the real norm / W_Q / rotation)",
        "supports": "whether a routing claim needs the pattern's reality or only the head's output",
        "cannot_support": "which pattern the model 'should' use; that the routed sources cause the output",
    },
    "functional label": {
        "question": "does a head or route perform a stated function on a stated input distribution",
        "operation": "seven-step chain (4.11) on a held-out split: pattern relation vs chance, source content "
        "(DLA from the target), DLA vs re-run effect, feature swap, zero / mean ablation, baselines, side effects "
        "and alternative routes",
        "controls": "search split apart from the evaluation split, matched random head, other heads of the layer, "
        "entropy-matched heads, position baselines, mean (not only zero) ablation",
        "supports": "a behaviour summary on its input condition, at the strength of the steps that passed",
        "cannot_support": "an architectural type; the function outside its input condition; that no other head "
        "does it (redundancy)",
    },
    "visual-feature patching": {
        "question": "do the features of chosen visual tokens at a site carry what the answer reads",
        "operation": "copy a counterfactual image's features of the tokens (vision encoder output, projector "
        "output, residual at block l, or cross-attention key/value source) into the original run and the reverse; "
        "change in answer logit, logit difference, probability, argmax",
        "controls": "paired image differing in one attribute, reverse direction, self-patch null, all-token patch, "
        "site before / after the vision encoder's mixing",
        "supports": "that these tokens' features at this site suffice (forward) to move the answer on this pair",
        "cannot_support": "which head or route reads them; that tokens outside the set carry nothing (the vision "
        "encoder mixes patches); a pixel-level cause",
    },
    "ablation": {
        "question": "does the answer need a component's write on this input distribution",
        "operation": "replace a head's z (or an MLP output, a residual) at positions with zero, a reference-set "
        "mean, or its value on another input; re-run; answer effect",
        "controls": "ablation type (zero is off-distribution), reference set, edited positions, matched random head",
        "supports": "necessity of the write under that replacement",
        "cannot_support": "what the component computes; that a null effect means unused (redundant routes)",
    },
    "activation patching": {
        "question": "does an activation from a source run carry the source's behaviour into a target run",
        "operation": "copy a head's z, an MLP output or the residual at positions from a source trace into the "
        "target run, everything downstream recomputed; answer effect",
        "controls": "source / target pair differing in one factor, self-patch null, reverse direction, positions",
        "supports": "sufficiency of that activation (with what follows it) to move the answer on this pair",
        "cannot_support": "uniqueness of the route; behaviour away from this pair; a linear attribution",
    },
    "attention knockout": {
        "question": "does the answer need an attention edge (query -> key set)",
        "operation": "add -inf to the chosen pre-softmax scores at chosen layers and heads, so the remaining "
        "weights renormalise; answer effect",
        "controls": "renormalisation (mass moves to other keys), matched random key set, layers knocked out",
        "supports": "necessity of the direct edge under renormalised routing",
        "cannot_support": "what flows along the edge; indirect routes through other positions that read the keys",
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

    @classmethod
    def not_defined(cls, method: str, reason: str, parameters: dict | None = None):
        """The row of a read-out this architecture gives no meaning to: nothing was
        computed, and the note says why (``parameters["defined"]`` False)."""
        return cls.for_method(
            method, controls=[], parameters={"defined": False, **(parameters or {})}, notes=[f"not defined: {reason}"]
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AuditRecord:
        return cls(**d)
