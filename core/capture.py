"""One no-grad forward that records what the read-outs need: a :class:`Trace`.

Hooks are scoped: registered inside :func:`hooks` and removed in its
``finally``, so none outlives a run. Attention patterns need eager attention
(under sdpa transformers returns no weights), so the language model is
switched to eager for the run and switched back afterwards.

Each head's output is kept as the output projection's input ``z``
``(batch, pos, heads, d_head)`` (a view, no copy); ``W_O^h z^h`` is
materialised only for the positions a method asks for.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from core.images import load_image


@dataclass
class Trace:
    """What one forward computed.

    Attributes:
        input_ids: ``(batch, pos)``.
        answer_positions: ``(batch,)`` the position whose next token is the answer.
        visual_positions: ``(batch, n_visual)`` sequence positions of the visual tokens.
        resid_pre: per layer ``(batch, pos, d_model)``: the residual entering block l.
        z: per layer ``(batch, pos, heads, d_head)``: each head's output before W_O.
        attn_out: per layer ``(batch, pos, d_model)``: the attention block's output (W_O z + b_O).
        mlp_out: per layer ``(batch, pos, d_model)``.
        patterns: per kept layer ``(batch, heads, n_query, pos)``: attention weights
            of the kept query positions.
        query_positions: ``(n_query,)`` the kept query positions (same for every batch row).
        final_resid: ``(batch, pos, d_model)`` x_L, before the final norm.
        logits: ``(batch, pos, vocab)``.
    """

    input_ids: torch.Tensor
    answer_positions: torch.Tensor
    visual_positions: torch.Tensor
    resid_pre: list[torch.Tensor] = field(default_factory=list)
    z: list[torch.Tensor] = field(default_factory=list)
    attn_out: list[torch.Tensor] = field(default_factory=list)
    mlp_out: list[torch.Tensor] = field(default_factory=list)
    patterns: dict[int, torch.Tensor] = field(default_factory=dict)
    query_positions: torch.Tensor | None = None
    final_resid: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    @property
    def n_layers(self) -> int:
        return len(self.resid_pre)

    def head_output(self, adapter, layer: int, positions: torch.Tensor | int, batch: int = 0) -> torch.Tensor:
        """``W_O^h z^h`` for the given positions: ``(n_pos, heads, d_model)``."""
        z = self.z[layer][batch, positions]  # (n_pos, heads, d_head) or (heads, d_head)
        return torch.einsum("...hd,hdm->...hm", z, adapter.W_O(layer).to(z.dtype))


@contextmanager
def hooks(registrations: Sequence[tuple[torch.nn.Module, str, object]]) -> Iterator[None]:
    """Register ``(module, kind, fn)`` hooks (kind: "pre", "pre_kw", "fwd") and
    remove every one on exit, whatever happens inside."""
    handles = []
    try:
        for module, kind, fn in registrations:
            if kind == "pre":
                handles.append(module.register_forward_pre_hook(fn))
            elif kind == "pre_kw":
                handles.append(module.register_forward_pre_hook(fn, with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(fn))
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def eager_attention(model) -> Iterator[None]:
    """Run ``model`` with eager attention (weights returned), then restore."""
    before = getattr(model.config, "_attn_implementation", None)
    if before == "eager" or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@torch.no_grad()
def capture(
    loaded,
    image,
    question: str,
    *,
    pattern_layers: Sequence[int] | None = None,
    query_positions: Sequence[int] | None = None,
) -> Trace:
    """Run the model once on (image, question) and record a :class:`Trace`.

    Args:
        pattern_layers: layers whose attention patterns are kept (default all).
        query_positions: query positions whose patterns are kept (default:
            the answer position only, which is what fits for a 7B model).
    """
    adapter = loaded.adapter
    inputs = adapter.prepare([load_image(image)], [question])
    n = adapter.n_layers
    keep = set(range(n) if pattern_layers is None else pattern_layers)
    qpos = torch.as_tensor(
        list(query_positions) if query_positions is not None else [int(inputs.answer_positions[0])],
        dtype=torch.long,
    )
    trace = Trace(
        inputs.input_ids,
        inputs.answer_positions,
        adapter.visual_positions(inputs),
        resid_pre=[None] * n,
        z=[None] * n,
        attn_out=[None] * n,
        mlp_out=[None] * n,
        query_positions=qpos,
    )
    regs = []
    for layer in range(n):
        regs += adapter.capture_hooks(layer, trace, keep_pattern=layer in keep)
    regs += adapter.final_hooks(trace)
    with eager_attention(loaded.model), hooks(regs):
        trace.logits = adapter.forward_logits(inputs)
    return trace
