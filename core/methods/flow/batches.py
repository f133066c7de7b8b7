"""Copies of one prepared input as the rows of a batch, and the batched edited forwards
the flow methods run on them (one edit set per row, ``Edit.rows``)."""

from __future__ import annotations

import dataclasses

import torch

from core.forward.capture import edited_logits


def copies(adapter, inputs, n: int, image, question: str, answer_prefix=()):
    """``inputs`` (one row) as ``n`` identical rows. Where every tensor of the batch has the
    batch first (one row: a first dimension of 1), the tensors are repeated: the image is
    processed once, not ``n`` times (on shapes-llava a preparation of 8 copies costs about one
    forward). Otherwise (a family whose processor flattens the image's patches across the batch)
    the processor prepares ``n`` copies."""
    if n == 1:
        return inputs
    tensors = inputs.tensors
    if all(isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == 1 for t in tensors.values()):
        repeated = {k: t.expand(n, *t.shape[1:]).contiguous() for k, t in tensors.items()}
        return dataclasses.replace(
            inputs,
            tensors=repeated,
            answer_positions=inputs.answer_positions.expand(n).contiguous(),
            input_ids=repeated["input_ids"] if "input_ids" in repeated else inputs.input_ids.expand(n, -1).contiguous(),
            prompts=list(inputs.prompts) * n,
        )
    return adapter.prepare([image] * n, [question] * n, answer_prefix=list(answer_prefix))


def edited_rows(
    loaded, inputs, keys, edits_of, *, batch_size: int, image, question: str, answer_prefix=(), cancel=None
):
    """Each of ``keys`` as one row of batched edited forwards of ``inputs`` (its edits
    ``edits_of(key)`` in its row only), ``batch_size`` rows a forward, nothing recorded
    (:func:`core.forward.capture.edited_logits`): yields ``(done, chunk, logits)`` per
    forward, ``logits`` ``(len(chunk), pos, vocab)``; stops before a forward when ``cancel()``
    (then fewer than ``len(keys)`` are done)."""
    for start in range(0, len(keys), batch_size):
        if cancel is not None and cancel():
            return
        chunk = keys[start : start + batch_size]
        batch = copies(loaded.adapter, inputs, len(chunk), image, question, answer_prefix)
        edits = [dataclasses.replace(e, rows=(row,)) for row, key in enumerate(chunk) for e in edits_of(key)]
        yield start + len(chunk), chunk, edited_logits(loaded, batch, edits)
