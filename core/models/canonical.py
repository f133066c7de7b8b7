"""The canonical names a family's adapter may map (TransformerLens's: W_Q,
W_K, W_V, W_O, W_U, ...), by capability, and the one refusal of a name a family
does not map. :class:`core.models.adapter.Adapter` answers from this table:
the base class defines none of the names, ``Adapter.capabilities`` lists what a
family defines, and any other is refused with :class:`NotMapped`."""

from __future__ import annotations


class NotMapped(NotImplementedError):
    """A canonical name this family's adapter does not map. A
    NotImplementedError, so callers that catch that keep working."""


# Capability -> {canonical name: what it returns}.
CANONICAL: dict[str, dict[str, str]] = {
    "weights": {
        "W_Q": "(heads, d_model, d_head): q = Norm(r) @ W_Q[h] + b_Q[h] (before the position scheme)",
        "b_Q": "(heads, d_head)",
        "W_K": "(heads, d_model, d_head): each query head's key map (groups expanded)",
        "b_K": "(heads, d_head)",
        "W_V": "(heads, d_model, d_head): each query head's value map (groups expanded)",
        "b_V": "(heads, d_head)",
        "W_O": "(heads, d_head, d_model): head output = z[h] @ W_O[h]",
        "b_O": "(d_model,) the output projection's bias (zeros if none)",
    },
    "norms": {
        "attn_norm": "the core.models.norms.Norm in front of layer l's attention",
        "final_norm_layer": "the core.models.norms.Norm in front of the unembedding",
    },
    "unembedding": {"W_U": "(d_model, vocab)", "b_U": "(vocab,) (zeros if the unembedding has no bias)"},
    "capture": {
        "capture_hooks": "[(module, kind, fn)] filling the trace for block l: resid_pre, z (batch, pos, heads, "
        "d_head), mlp_out, attn_out if trace.keep_attn_out and, under eager attention, the weights handed to "
        "core.forward.capture.record_pattern (core.forward.capture.hooks)",
        "final_hooks": "hooks that record trace.final_resid (the final norm's input)",
    },
    "positions": {
        "rotate": "the position scheme applied to queries or keys (pos, heads, d_head) at positions in the "
        "scheme's own format: (pos,) for RoPE, (3, pos) (temporal, height, width) for M-RoPE",
    },
    "geometry": {"visual_tokens": "core.forward.geometry.VisualToken per visual token, boxes in the original image"},
    "modules": {
        "attention_module": "block l's attention module (its eager call is where q / k are recorded)",
        "z_module": "the output projection whose input is z (batch, pos, heads * d_head)",
        "mlp_module": "block l's MLP (its output is mlp_out)",
        "layer_module": "block l's layer, whose first input is the residual entering it (resid_pre)",
    },
}
CANONICAL_NAMES: dict[str, str] = {name: group for group, names in CANONICAL.items() for name in names}
