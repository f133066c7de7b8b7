"""An independent eager reference for attention knockout: the model run with eager
attention (CoCa: its replay), the scores of the cut edges set to minus infinity
just before each softmax of the cut blocks, by wrapping the softmax itself (not
the attention mask the engine edits). A row whose every key is cut weighs
nothing (its weights are 0, not the NaN of a softmax over no key)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from core.forward.capture import capture, eager_attention, hooks


@contextmanager
def cut_scores(adapter, cuts: dict[int, tuple[list[int], list[int]]], heads=None):
    """While open, each softmax inside block ``b`` of ``cuts`` (``{block: (queries, keys)}``)
    gets ``-inf`` at scores ``[:, heads, queries, keys]`` (``heads`` None: every head)."""
    current = {"block": None}
    real = {"F": torch.nn.functional.softmax, "torch": torch.softmax, "Tensor": torch.Tensor.softmax}

    def cut(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        block = current["block"]
        if block not in cuts or x.ndim != 4:
            return x, None
        queries, keys = cuts[block]
        select = torch.zeros(x.shape[1:], dtype=torch.bool, device=x.device)
        h = slice(None) if heads is None else list(heads)
        q = torch.tensor(queries)[:, None]
        k = torch.tensor(keys)[None, :]
        if heads is None:
            select[:, q, k] = True
        else:
            select[h, q, k] = True
        x = x.masked_fill(select, float("-inf"))
        empty = torch.isinf(x).all(-1, keepdim=True) & (x < 0).all(-1, keepdim=True)
        return x, empty

    def wrapped(which):
        def softmax(x, *args, **kwargs):
            x, empty = cut(x)
            out = real[which](x, *args, **kwargs)
            return out if empty is None else out.masked_fill(empty, 0.0)

        return softmax

    def set_block(b):
        def pre(module, args):
            current["block"] = b

        return pre

    def clear(module, args, out):
        current["block"] = None

    regs = []
    original_norm = adapter.attn_norm
    if adapter.replays_edits:  # the replay calls attn_norm(block) first in every block

        def attn_norm(block):
            current["block"] = block
            return original_norm(block)

        adapter.attn_norm = attn_norm
        # the replay is compared with open_clip's forward, which knows no cut: not here
        adapter._check_replay = lambda inputs, trace: None
    else:
        for b, (_, kind) in enumerate(adapter.blocks):
            if kind not in ("self", "cross"):  # a layer without attention has no softmax to cut
                continue
            module = adapter.attention_module(b)
            regs += [(module, "pre", set_block(b)), (module, "fwd", clear)]
    torch.nn.functional.softmax = wrapped("F")
    torch.softmax = wrapped("torch")
    torch.Tensor.softmax = lambda self, *a, **k: wrapped("Tensor")(self, *a, **k)
    try:
        with hooks(regs):
            yield
    finally:
        torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax = real["F"], real["torch"], real["Tensor"]
        if adapter.replays_edits:
            del adapter.attn_norm, adapter._check_replay


@torch.no_grad()
def reference_logits(loaded, inputs, cuts, heads=None) -> torch.Tensor:
    """``(batch, pos, vocab)`` logits of eager attention with the ``cuts`` made on the scores
    (a family whose forward the engine replays, CoCa: the replay, unedited)."""
    adapter = loaded.adapter
    if adapter.replays_edits:
        with cut_scores(adapter, cuts, heads):
            return capture(loaded, None, "", pattern_layers=[], inputs=inputs).logits
    with eager_attention(adapter.model), cut_scores(adapter, cuts, heads):
        return adapter.forward_logits(inputs)
