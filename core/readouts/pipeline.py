"""The one capture the read-outs read, for analyze (one sample) and the
dataset audit (a batch): the processor's inputs, the pattern rows the
read-outs ask for (:func:`pattern_rows`), the rollout stream fed during the
forward, the capture, and the answer rows' logits; then one
:class:`SampleContext` per sample, built by keyword.

Not imported by ``core.readouts`` itself (it imports torch; the registry is
read to build the command line)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core.errors import oom_guard
from core.forward.capture import ATTENTION_KINDS, Trace, capture
from core.methods.patterns import FULL_PATTERN_LIMIT, RolloutStream
from core.models.inputs import ModelInputs
from core.models.memory import check_working_set
from core.readouts.base import ReadoutOptions, SampleContext, pattern_rows

# What the read-outs of :data:`core.readouts.ANALYZE_READOUTS` keep (their ``patterns``).
ALL_PATTERNS = frozenset({"answer", "text", "rollout"})


@dataclass
class CapturedBatch:
    """One forward over a batch, as the read-outs read it.

    Attributes:
        inputs: the processed batch.
        trace: the capture (None when no read-out needs one: then only the logits).
        rollout: the stream the capture fed (None: not asked for, or a prompt over
            :data:`FULL_PATTERN_LIMIT` tokens).
        logits: ``(batch, vocab)`` float32 logits at each answer position, on the CPU.
        answer_positions: each row's answer position.
    """

    inputs: ModelInputs
    trace: Trace | None
    rollout: RolloutStream | None
    logits: torch.Tensor
    answer_positions: list[int]

    def context(
        self, loaded, row: int, *, answer_id: int | None, options: ReadoutOptions, **sample: Any
    ) -> SampleContext:
        """The :class:`SampleContext` of batch row ``row``: ``answer_id`` None
        reads the model's top token; ``sample`` holds the sample's own fields
        (``image``, ``question``, ``foil_id``, ``tokens``, ``item``, ``mask``,
        ``cover``, ``region``, ``answer_prefix``)."""
        position = self.answer_positions[row]
        logits = self.logits[row]
        predicted = int(logits.argmax())
        query_index = self.trace.query_positions.tolist().index(position) if self.trace is not None else None
        return SampleContext(
            loaded=loaded,
            trace=self.trace,
            batch=row,
            query_index=query_index,
            rollout=self.rollout,
            logits=logits,
            answer_id=predicted if answer_id is None else answer_id,
            predicted_id=predicted,
            options=options,
            position=position,
            **sample,
        )


def capture_batch(
    loaded,
    images: Sequence,
    questions: Sequence[str],
    options: ReadoutOptions,
    *,
    patterns: Iterable[str] = ALL_PATTERNS,
    needs_capture: bool = True,
    answer_prefix: tuple[int, ...] = (),
    raw_prompt: bool = False,
    attention: str = "sdpa",
    check_memory: bool = False,
) -> CapturedBatch:
    """Prepare and run the batch once for read-outs that keep ``patterns``
    ("answer": every block's answer rows; "text": the text rows nearest the
    answer as well; "rollout": the whole pattern folded into a
    :class:`RolloutStream`). ``needs_capture`` False: a plain forward, the
    answer rows' logits only. ``check_memory``: refuse, in one line, a capture
    that would not fit beside the model (:func:`check_working_set`) before it runs."""
    adapter = loaded.adapter
    wanted = set(patterns)
    inputs = adapter.prepare(list(images), list(questions), raw_prompt=raw_prompt, answer_prefix=answer_prefix)
    answer_positions = [int(p) for p in inputs.answer_positions.tolist()]
    if not needs_capture:
        with oom_guard(f"running a batch of {len(answer_positions)}"), torch.no_grad():
            logits = adapter.next_token_logits(inputs).float().cpu()
        return CapturedBatch(inputs, None, None, logits, answer_positions)
    n_tokens = inputs.input_ids.shape[1]
    if check_memory:
        check_working_set(loaded, n_tokens, "capture", batch=len(answer_positions), eager=attention == "eager")
    every_block_attends = all(kind in ATTENTION_KINDS for _, kind in adapter.blocks)  # rollout multiplies them all
    stream = (
        RolloutStream(options.rollout_alpha)
        if "rollout" in wanted and n_tokens <= FULL_PATTERN_LIMIT and every_block_attends
        else None
    )
    rows = pattern_rows(adapter, inputs, len(answer_prefix)) if "text" in wanted else sorted(set(answer_positions))
    trace = capture(  # checked: finite logits at the answers, the processor agreeing with the model
        loaded,
        None,
        "",
        inputs=inputs,
        query_positions=rows,
        pattern_layers=None if wanted & {"answer", "text"} else [],
        attention=attention,
        pattern_streams=[stream] if stream is not None else [],
    )
    logits = trace.logits[torch.arange(len(answer_positions)), torch.as_tensor(answer_positions)].float().cpu()
    return CapturedBatch(inputs, trace, stream, logits, answer_positions)
