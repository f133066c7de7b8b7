"""Decoding through a family's key / value cache (mixed into
:class:`core.models.adapter.Adapter`; :mod:`core.generate` drives it): the
prompt once, then one new position per step. Each step also grows the inputs
by :meth:`Adapter.append_token`, so one full forward of them is the reference
every cached step is checked against (tests/core/test_generate.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from core.models.inputs import ModelInputs


@dataclass
class DecodingState:
    """Where a greedy decoding stands (:meth:`Decoding.start_decoding`,
    :meth:`Decoding.decode_step`; used by :mod:`core.generate`).

    Attributes:
        inputs: the prompt and the tokens decoded so far, grown by
            :meth:`Adapter.append_token`, so one full forward of ``inputs`` is
            the reference of every step.
        logits: ``(batch, vocab)`` the next-token logits at the last position.
        cache: the family's key / value cache (a transformers ``Cache``, which
            each step grows in place, so a state is stepped from once; CoCa's
            per-block keys and values); None: each step re-runs ``inputs``.
        context: what every cached step reads unchanged (BLIP's image tokens;
            CoCa's cross-attention keys and values; None for the rest).
    """

    inputs: ModelInputs
    logits: torch.Tensor
    cache: Any = None
    context: Any = None


class Decoding:
    """Greedy decoding steps (a mix-in of :class:`core.models.adapter.Adapter`):
    the Hugging Face default through ``past_key_values``; families override
    :meth:`cached_prefill` / :meth:`cached_step` / :meth:`decoding_inputs`."""

    # Whether start_decoding can keep a key / value cache; a family that cannot sets
    # False and every step re-runs the sequence (the Generation then says cache False).
    decodes_with_cache: ClassVar[bool] = True

    def start_decoding(self, inputs: ModelInputs, *, use_cache: bool = True) -> DecodingState:
        """The state after the prompt ``inputs`` (rows ending at their answer
        position): one forward of the whole prompt, keeping the key / value
        cache when ``use_cache`` (and :attr:`decodes_with_cache`); without it
        every :meth:`decode_step` re-runs the whole sequence, the reference a
        cached step is checked against."""
        if bool((inputs.answer_positions != inputs.input_ids.shape[1] - 1).any()):
            raise ValueError("start_decoding: a row is padded after its answer position (decode rows one at a time)")
        if not (use_cache and self.decodes_with_cache):
            return DecodingState(inputs, self.next_token_logits(inputs))
        logits, cache, context = self.cached_prefill(inputs)
        self.check_logits(logits)
        return DecodingState(inputs, logits, cache, context)

    def decode_step(self, state: DecodingState, token_id: int) -> DecodingState:
        """``state`` with ``token_id`` appended (:meth:`append_token`, so the
        family's per-token tensors grow as in a re-run): one new position
        through the cache, which grows in place (step from the returned
        state, not ``state``), or a forward of the whole sequence without one."""
        longer = self.append_token(state.inputs, token_id)
        if state.cache is None:
            return DecodingState(longer, self.next_token_logits(longer))
        logits, cache = self.cached_step(longer, state.cache, state.context)
        self.check_logits(logits)
        return DecodingState(longer, logits, cache, state.context)

    def cached_prefill(self, inputs: ModelInputs) -> tuple[torch.Tensor, Any, Any]:
        """``(logits (batch, vocab) at the last position, cache, context)`` of
        the prompt; the Hugging Face default: the model's forward with
        ``use_cache=True`` (its Cache; no context)."""
        out = self.run_model(**inputs.tensors, **self.decoding_inputs(inputs), use_cache=True, return_dict=True)
        return out.logits[:, -1], out.cache, None

    def cached_step(self, inputs: ModelInputs, cache, context) -> tuple[torch.Tensor, Any]:
        """``(logits (batch, vocab), cache)`` of the last position of ``inputs``
        run through ``cache``. The Hugging Face default: the model's own
        ``prepare_inputs_for_generation`` picks what the step feeds, as
        ``generate`` does (the new token's id and per-token tensors, the whole
        attention mask, no pixels after the prefill, Mllama's cross-attention
        mask row, PaliGemma's 1-based positions)."""
        tensors = {**inputs.tensors, **self.decoding_inputs(inputs)}
        ids = tensors.pop("input_ids")
        step = self.model.prepare_inputs_for_generation(
            ids, next_sequence_length=1, cache=cache, use_cache=True, **tensors
        )
        out = self.run_model(**step, return_dict=True)
        return out.logits[:, -1], out.cache

    def decoding_inputs(self, inputs: ModelInputs) -> dict[str, torch.Tensor]:
        """Forward inputs a cached prefill or step adds to ``inputs.tensors``
        (default none; Qwen2-VL: its M-RoPE position ids)."""
        return {}

    def generation_limits(self) -> tuple[int | None, int]:
        """``(max_new_tokens, max_length)`` of the model folder's generation
        config (the first None where it sets none); ``max_length`` no more than
        the decoder's position limit (:meth:`max_positions`)."""
        config = getattr(self.model, "generation_config", None)
        max_length = self.max_positions()
        if getattr(config, "max_length", None):
            max_length = min(max_length, int(config.max_length))
        return getattr(config, "max_new_tokens", None), max_length

    def end_token_ids(self) -> set[int]:
        """The token ids that end an answer: the model folder's generation
        config ``eos_token_id`` (an int or a list), the tokenizer's EOS and
        its padding token."""
        ids: set[int] = set()
        config = getattr(self.model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
        for value in eos if isinstance(eos, (list, tuple)) else [eos]:
            if value is not None:
                ids.add(int(value))
        for name in ("eos_token_id", "pad_token_id"):
            value = getattr(self.tokenizer, name, None)
            if isinstance(value, int):
                ids.add(value)
        return ids
