"""Attention patterns on the model's own fast attention path (docs/ARCHITECTURE.md,
"Capture on the sdpa path").

Under sdpa (or flash attention) transformers returns no attention weights.
Rather than switch the model to eager attention, which materialises every
layer's ``(heads, pos, pos)`` pattern, the capture wraps the attention
function the language model calls (transformers' ``AttentionInterface``
entries and each modeling module's ``eager_attention_forward``) and records
what one call received: the queries and keys after the position scheme and
any q/k norms, the mask, the scaling and the soft-cap. From that record
:class:`RecomputedRows` gives the pattern of just the query rows a read-out
asks for, computed as eager attention computes it::

    softmax(q_rows K^T * scaling [soft-capped] + mask, dim=-1)

in float32 (float64 for a float64 model), the precision sdpa weights the values with:
a half-precision call's queries and keys are upcast (exactly) before the product,
so the scores are float32 sums of the half-precision q and k, as sdpa's kernels
accumulate them (eager attention rounds its scores to the model's dtype first),

with the model's own mask: the tensor the call was given (causal, padding,
prefix-LM, sliding window), or, where sdpa / flash were given none, the
causal (and sliding-window) mask they apply themselves. The record lives only
for the call: nothing of size ``pos x pos`` per head outlives a layer.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from core.shell.precision import accumulation_dtype

# Rows recomputed at once: bounds the transient (batch, heads, rows, keys) scores.
# Rows are computed by aligned chunks of this many (the last padded with the last
# row), so a row always sits at the same place in the same product and its numbers
# never depend on which other rows were asked for: a matrix product's rows agree
# bitwise only across calls of one shape (and, on some kernels, one place in it).
ROW_CHUNK = 64


class WeightsRows:
    """The pattern rows of a pattern the model computed itself (eager
    attention's weights, a replay's softmax): ``(batch, heads, pos, keys)``."""

    def __init__(self, weights: torch.Tensor):
        self.weights = weights
        self.batch, _, self.n_rows, self.n_keys = weights.shape

    def rows(self, positions: torch.Tensor, n_keys: int | None = None) -> torch.Tensor:
        """``(batch, heads, len(positions), keys)`` (``n_keys``: only the first keys)."""
        return self.weights[:, :, positions.to(self.weights.device), :n_keys]

    def keys_read(self, last_row: int) -> int:
        """How many leading keys rows up to ``last_row`` may weight: all (the mask is the model's business)."""
        return self.n_keys


@dataclass
class AttentionCall:
    """What one attention call received.

    Attributes:
        query: ``(batch, heads, q_len, d_head)``, as the function got it.
        key: ``(batch, kv_heads, keys, d_head)`` (grouped heads not expanded).
        mask: the mask it was given: additive float or bool (True: may attend)
            ``(batch, 1 | heads, q_len, >= keys)``, a ``(batch, keys)`` padding
            mask (flash attention: 1 for real tokens), or None.
        scaling: the factor ``q . k`` is multiplied by.
        kind: "eager", "sdpa" or "flash": what a missing mask means (eager:
            no mask; sdpa and flash: causal when ``causal``).
        causal: whether the module is causal (``module.is_causal`` or the call's ``is_causal``).
        softcap: Gemma 2's soft-cap of the scaled scores (None: none).
        sliding_window: flash attention's window (sdpa and eager get it in the mask).
    """

    query: torch.Tensor
    key: torch.Tensor
    mask: torch.Tensor | None
    scaling: float
    kind: str
    causal: bool = True
    softcap: float | None = None
    sliding_window: int | None = None


class RecomputedRows:
    """The pattern rows of one recorded attention call, recomputed on demand
    the way eager attention computes the whole pattern (see the module docstring).

    Args:
        reuse: how many computed row chunks to keep for a later request in
            this call (a read-out's rows, then a stream walking every chunk,
            compute the chunks they share once); each is ``(batch, heads,
            ROW_CHUNK, keys)``. 0: none.
    """

    def __init__(self, call: AttentionCall, reuse: int = 0):
        self.call = call
        self.batch, self.n_rows, self.n_keys = call.query.shape[0], call.query.shape[2], call.key.shape[2]
        c = call
        # sdpa / flash applying causality themselves (no mask tensor): a row reads no key after it,
        # so the keys past a row chunk are not computed at all.
        self.causal_only = c.kind != "eager" and c.causal and self.n_rows > 1 and (c.mask is None or c.mask.ndim == 2)
        # the precision sdpa weights the values with (see rows)
        self.dtype = accumulation_dtype(c.query.dtype)
        self.reuse = reuse
        self._kept: dict[int, torch.Tensor] = {}

    def scores(self, positions: torch.Tensor, n_keys: int | None = None) -> torch.Tensor:
        """``(batch, heads, n, keys)``: the scaled (soft-capped) scores of the
        query rows ``positions`` with the mask applied, before the softmax;
        masked entries hold the dtype's lowest value, as eager's additive mask
        leaves them. ``n_keys``: only the first keys (all the rows may read)."""
        c = self.call
        positions = positions.to(c.query.device)
        q = c.query[:, :, positions].to(self.dtype)  # (batch, heads, n, d_head); half upcast exactly
        b, h, n, d = q.shape
        kv_heads = c.key.shape[1]
        n_keys = c.key.shape[2] if n_keys is None else n_keys
        group = h // kv_heads
        # Grouped heads read their key head without repeat_kv's copy: query head i reads key head i // group.
        keys = c.key[:, :, :n_keys].to(self.dtype).transpose(2, 3)
        scores = torch.matmul(q.reshape(b, kv_heads, group * n, d), keys).view(b, h, n, n_keys)
        scores.mul_(c.scaling)  # in place: the same operations as eager's, one buffer
        if c.softcap is not None:
            scores.div_(c.softcap).tanh_().mul_(c.softcap)
        return self._masked(scores, positions, n_keys)

    def _masked(self, scores: torch.Tensor, positions: torch.Tensor, n_keys: int) -> torch.Tensor:
        c = self.call
        floor = torch.finfo(scores.dtype).min
        mask = c.mask
        if mask is not None and mask.ndim == 4:
            rows = mask[:, :, positions] if mask.shape[2] > 1 else mask
            rows = rows[..., :n_keys].to(scores.device)
            if rows.dtype == torch.bool:
                return scores.masked_fill_(~rows, floor)
            return scores.add_(rows) if rows.dtype == scores.dtype else scores + rows  # eager's promotion
        if not self.causal_only:
            return scores  # eager given no mask: none
        keys = torch.arange(n_keys, device=scores.device)
        # Only keys at or after the first row can lie in a row's future: mask that band alone.
        first = int(positions.min()) if c.sliding_window is None and mask is None else 0
        allowed = keys[first:].view(1, -1) <= positions.view(-1, 1)
        if c.sliding_window is not None:
            allowed = allowed & (keys.view(1, -1) > positions.view(-1, 1) - c.sliding_window)
        allowed = allowed.view(1, 1, len(positions), n_keys - first)
        if mask is not None:  # (batch, keys) padding mask (flash attention)
            allowed = allowed & mask.bool().to(scores.device)[:, None, None, :n_keys]
        band = scores[..., first:]
        band.masked_fill_(~allowed, floor)
        return scores

    def keys_read(self, last_row: int) -> int:
        """How many leading keys rows up to ``last_row`` may weight: ``last_row + 1``
        on sdpa's causal path, else all (a mask tensor may open any key)."""
        return min(self.n_keys, last_row + 1) if self.causal_only else self.n_keys

    def chunk(self, index: int) -> torch.Tensor:
        """``(batch, heads, ROW_CHUNK, keys)``: the pattern of the aligned rows
        ``index * ROW_CHUNK ...`` (past the last row, the last row again); on
        sdpa's causal path only the keys its last row may read."""
        if index in self._kept:
            return self._kept[index]
        first = index * ROW_CHUNK
        rows = torch.arange(first, first + ROW_CHUNK).clamp_(max=self.n_rows - 1)
        limit = min(self.n_keys, first + ROW_CHUNK) if self.causal_only else self.n_keys
        weights = self.scores(rows, limit).softmax(dim=-1, dtype=self.dtype)
        if len(self._kept) < self.reuse:
            self._kept[index] = weights
        return weights

    def rows(self, positions: torch.Tensor, n_keys: int | None = None) -> torch.Tensor:
        """``(batch, heads, len(positions), keys)`` (``n_keys``: only the first
        keys, when the caller knows the rest unread), in float32, or float64 for
        a float64 model: the precision sdpa's kernels weight the values with
        (eager attention's weights are its float32 softmax cast to the model's
        dtype, so the two agree to that rounding).

        Every row comes from its aligned :meth:`chunk` (row ``p`` at index
        ``p % ROW_CHUNK`` of chunk ``p // ROW_CHUNK``), zeros past the keys
        the chunk reads: the same product whichever rows are asked for together."""
        positions = torch.as_tensor(positions, dtype=torch.long).flatten().cpu()
        if len(positions) and not (-self.n_rows <= int(positions.min()) and int(positions.max()) < self.n_rows):
            raise IndexError(f"query rows out of range: the attention had {self.n_rows} queries")
        positions = positions % max(self.n_rows, 1)
        n_keys = self.n_keys if n_keys is None else min(n_keys, self.n_keys)
        chunks = positions // ROW_CHUNK
        indices = chunks.unique().tolist()
        whole = len(positions) == ROW_CHUNK and bool((positions == positions[0] + torch.arange(ROW_CHUNK)).all())
        if whole and len(indices) == 1:  # one aligned chunk, in order: the chunk itself, no copy
            weights = self.chunk(indices[0])
            if weights.shape[-1] >= n_keys:
                return weights[..., :n_keys]
        q = self.call.query
        out = torch.zeros(self.batch, q.shape[1], len(positions), n_keys, dtype=self.dtype, device=q.device)
        for index in indices:
            where = (chunks == index).nonzero().flatten()
            weights = self.chunk(index)
            limit = min(weights.shape[-1], n_keys)
            out[:, :, where.to(out.device), :limit] = weights[:, :, positions[where] - index * ROW_CHUNK, :limit]
        return out


# ---- the wrappers: installed while any capture records, dispatching by module


class _Recording:
    """One capture's recording: which attention modules it watches and what it does with a call."""

    def __init__(self, modules: dict[int, int], on_call: Callable[[int, AttentionCall], None]):
        self.modules = modules  # id(attention module) -> block
        self.on_call = on_call
        self.seen: set[int] = set()


_LOCK = threading.Lock()
_ACTIVE: dict[int, _Recording] = {}  # id(attention module) -> its recording
_INSTALLED: dict[tuple[int, str], tuple] = {}  # (id(namespace), name) -> (namespace, name, original)
# transformers' attention functions by what a missing mask means to them.
_KINDS = {"sdpa": "sdpa", "flash_attention_2": "flash", "flash_attention_3": "flash", "flash_attention_4": "flash"}


def _wrap(original: Callable, kind: str | None, name: str) -> Callable:
    signature = inspect.signature(original)

    def attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
        recording = _ACTIVE.get(id(module))
        if recording is not None:
            if kind is None:
                raise NotImplementedError(
                    f"attention implementation {name!r}: its patterns cannot be recomputed "
                    "(capture with attention='eager', or load the model with sdpa)"
                )
            if kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None:
                raise NotImplementedError("attention with sinks or a position bias: capture with attention='eager'")
            bound = signature.bind_partial(module, query, key, value, attention_mask, *args, **kwargs).arguments
            scaling = bound.get("scaling")
            is_causal = kwargs.get("is_causal")
            call = AttentionCall(
                query,
                key,
                attention_mask,
                float(scaling) if scaling is not None else query.shape[-1] ** -0.5,
                kind,
                causal=bool(getattr(module, "is_causal", True) if is_causal is None else is_causal),
                softcap=kwargs.get("softcap"),
                sliding_window=kwargs.get("sliding_window") if kind == "flash" else None,
            )
            block = recording.modules[id(module)]
            recording.seen.add(block)
            recording.on_call(block, call)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    attention_forward.__wrapped__ = original
    return attention_forward


def _targets(modules) -> list[tuple[object, str, str | None]]:
    """``(namespace, name, kind)`` of every attention function these modules may call:
    transformers' registered ones and the ``eager_attention_forward`` of their modeling modules."""
    from transformers.modeling_utils import AttentionInterface

    out = [(AttentionInterface._global_mapping, key, _KINDS.get(key)) for key in AttentionInterface._global_mapping]
    for module in modules:
        namespace = sys.modules[type(module).__module__]
        if hasattr(namespace, "eager_attention_forward"):
            out.append((namespace, "eager_attention_forward", "eager"))
    return out


def _get(namespace, name):
    return namespace[name] if isinstance(namespace, dict) else getattr(namespace, name)


def _set(namespace, name, value) -> None:
    if isinstance(namespace, dict):
        namespace[name] = value
    else:
        setattr(namespace, name, value)


@contextmanager
def recording(modules: dict[int, torch.nn.Module], on_call: Callable[[int, AttentionCall], None]) -> Iterator[set[int]]:
    """Call ``on_call(block, call)`` for every attention call of ``modules``
    (block -> attention module) for the duration; yields the set of blocks
    whose call was seen. Other modules' calls (the vision tower's, another
    model's) pass through untouched. Wrappers are installed while any
    recording is active and removed, originals restored, when the last ends.

    Raises:
        RuntimeError: a module is already being recorded (the same model
            captured in two threads at once).
    """
    rec = _Recording({id(m): b for b, m in modules.items()}, on_call)
    with _LOCK:
        busy = [b for b, m in modules.items() if id(m) in _ACTIVE]
        if busy:
            raise RuntimeError(f"blocks {busy} are already being captured (one capture of a model at a time)")
        for namespace, name, kind in _targets(modules.values()):  # the wrappers this model's modules need
            key = (id(namespace), name)
            if key not in _INSTALLED:
                original = _get(namespace, name)
                _INSTALLED[key] = (namespace, name, original)
                _set(namespace, name, _wrap(original, kind, name))
        for m in modules.values():
            _ACTIVE[id(m)] = rec
    try:
        yield rec.seen
    finally:
        with _LOCK:
            for m in modules.values():
                _ACTIVE.pop(id(m), None)
            if not _ACTIVE:
                for namespace, name, original in _INSTALLED.values():
                    _set(namespace, name, original)
                _INSTALLED.clear()
