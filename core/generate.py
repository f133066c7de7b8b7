"""Greedy generation with the model's key / value cache, for every family.

The prompt runs once (:meth:`core.models.adapter.Adapter.start_decoding`);
then each step feeds only the new token through the cache
(:meth:`~core.models.adapter.Adapter.decode_step`: transformers' Cache through
the model's own ``prepare_inputs_for_generation``; BLIP's text decoder; CoCa's
blocks run by its adapter, since open_clip keeps no cache). ``use_cache=False``
is the reference: every step re-runs the whole sequence
(:meth:`~core.models.adapter.Adapter.append_token` +
:meth:`~core.models.adapter.Adapter.next_token_logits`), and the two give the
same tokens and, to float tolerance, the same probabilities
(tests/core/test_generate.py).

A generated answer is read out at any of its tokens through
:meth:`Generation.answer_text` (``AnswerText.of_ids(adapter,
generation.token_ids, k, text=generation.text)``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from core.answer_text import AnswerText
from core.audit import AuditRecord
from core.errors import InputFileError, QuestionError, oom_guard
from core.readout import jsonable

Progress = Callable[[int, int, str], None] | None
Cancel = Callable[[], bool] | None

DEFAULT_MAX_NEW_TOKENS = 32
STOP_REASONS = ("eos", "stop_string", "max_new_tokens", "max_length", "cancelled")
SCHEMA_VERSION = 1


@dataclass
class Generation:
    """A greedy continuation of one prompt (the ``generate`` run kind).

    Attributes:
        token_ids: the generated tokens, in order; the token that ended the
            answer (EOS or padding) is not among them (see ``stop_token``).
        tokens: one display string per token (:meth:`Adapter.token_str`).
        probs: each token's probability at its step: a float64 softmax of the
            model's logits (float32 logits for a float32 model).
        top: per step the ``top_k`` most probable tokens, ``[[token, prob], ...]``.
        stop_reason: ``"eos"`` (an end token: the generation config's EOS ids,
            the tokenizer's EOS or padding, BLIP's [SEP]), ``"stop_string"``,
            ``"max_new_tokens"``, ``"max_length"`` (the prompt and answer filled
            the model's positions or the generation config's ``max_length``) or
            ``"cancelled"``.
        text: the tokenizer's decoding of ``token_ids``, special tokens
            skipped; after a stop string, cut just after its first occurrence.
        stop_token: ``{"token_id", "token", "prob", "top"}`` of the end token
            (stop reason "eos"), else None.
        cache: whether the steps ran through a key / value cache (False: each
            step re-ran the whole sequence).
        question, raw_prompt: what was asked.
        prompt_length: the sequence length of the prompt (image tokens included
            for the families that interleave them).
        max_new_tokens, stop_strings, top_k: what the call was given.
        model: ``{"spec", "fingerprint", **adapter.describe()}``.
    """

    token_ids: list[int]
    tokens: list[str]
    probs: list[float]
    top: list[list]
    stop_reason: str
    text: str
    stop_token: dict | None
    cache: bool
    question: str
    raw_prompt: bool
    prompt_length: int
    max_new_tokens: int
    stop_strings: list[str]
    top_k: int
    model: dict

    kind = "generate"

    def answer_text(self, index: int = 0) -> AnswerText:
        """Token ``index`` of this answer, for a read-out at it (the ids as
        generated: no re-tokenisation of the text)."""
        return AnswerText(self.text, tuple(self.token_ids), tuple(self.tokens), index)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("question", "raw_prompt")}
        d["input"] = {"question": self.question, "raw_prompt": self.raw_prompt, "prompt_length": self.prompt_length}
        # the dtype and device it ran in, as the model block states them (Adapter.dtype_and_device)
        d["input"].update({k: self.model[k] for k in ("dtype", "device") if k in self.model})
        del d["prompt_length"]
        return jsonable({"schema_version": SCHEMA_VERSION, "kind": self.kind, **d})

    @classmethod
    def from_dict(cls, d: dict) -> Generation:
        """The Generation of :meth:`to_dict` (or of the CLI's JSON, which adds to ``input``)."""
        names = {f.name for f in fields(cls)}
        own = {k: v for k, v in d.items() if k in names}
        inp = d["input"]
        own.update(
            question=inp["question"], raw_prompt=bool(inp["raw_prompt"]), prompt_length=int(inp["prompt_length"])
        )
        return cls(**own)

    def summary(self) -> str:
        """``7 tokens 'a red circle' (eos, KV cache); p min 0.41 at 2 'circle', mean 0.83``."""
        how = "KV cache" if self.cache else "re-run each step"
        line = f"{len(self.token_ids)} tokens {self.text!r} ({self.stop_reason}, {how})"
        if self.probs:
            low = min(range(len(self.probs)), key=self.probs.__getitem__)
            mean = sum(self.probs) / len(self.probs)
            line += f"; p min {self.probs[low]:.3f} at {low} {self.tokens[low]!r}, mean {mean:.3f}"
        return line

    def parameters(self) -> dict:
        return {
            "question": self.question,
            "max_new_tokens": self.max_new_tokens,
            "stop_strings": list(self.stop_strings),
            "top_k": self.top_k,
            "raw_prompt": self.raw_prompt,
            "cache": self.cache,
        }

    def audit_records(self) -> list[AuditRecord]:
        """One "model output" row: what the model answers, not how it computed it."""
        notes = [
            "behaviour, not mechanism: the generated tokens say what the model answers, not which internal "
            "route produced them",
            f"stopped: {self.stop_reason} after {len(self.token_ids)} tokens",
        ]
        if not self.cache:
            notes.append("no key / value cache: every step re-ran the whole sequence")
        return [
            AuditRecord.for_method(
                "model output",
                controls=[
                    "greedy decoding (the argmax at every step; no sampling)",
                    f"each token's probability and top-{self.top_k} alternatives recorded",
                ],
                parameters={**self.parameters(), "stop_reason": self.stop_reason, "n_tokens": len(self.token_ids)},
                notes=notes,
            )
        ]


def decoded_text(adapter, token_ids: Sequence[int]) -> str:
    """The tokenizer's decoding of ``token_ids`` (special tokens skipped)."""
    tok = adapter.tokenizer
    ids = [int(i) for i in token_ids]
    if hasattr(tok, "get_vocab"):  # a Hugging Face tokenizer
        return tok.decode(ids, skip_special_tokens=True).strip()
    if hasattr(tok, "decode"):  # open_clip's SimpleTokenizer
        return tok.decode(ids).strip()
    return " ".join(adapter.token_str(i) for i in ids)


def _check_arguments(max_new_tokens, top_k, stop_strings) -> tuple[str, ...]:
    for name, value in (("max_new_tokens", max_new_tokens), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise QuestionError(f"{name} must be a positive integer, got {value!r}")
    stops = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise QuestionError(f"a stop string must be non-empty text, got {s!r}")
    return stops


def _limits(loaded, max_new_tokens: int | None) -> tuple[int, int]:
    """``(max_new_tokens, max_length)``: the caller's count, else the model
    folder's generation config's, else :data:`DEFAULT_MAX_NEW_TOKENS`; the
    longest sequence (prompt and answer), the smaller of the model's position
    limit and the generation config's ``max_length``."""
    config = getattr(loaded.model, "generation_config", None)
    if max_new_tokens is None:
        max_new_tokens = getattr(config, "max_new_tokens", None) or DEFAULT_MAX_NEW_TOKENS
    max_length = loaded.adapter.max_positions()
    if getattr(config, "max_length", None):
        max_length = min(max_length, int(config.max_length))
    return max_new_tokens, max_length


def _step_numbers(adapter, logits: torch.Tensor, top_k: int) -> tuple[int, float, list]:
    """``(argmax id, its probability, [[token, prob], ...] top_k)`` of one ``(vocab,)`` row."""
    probs = logits.detach().double().softmax(-1)
    values, indices = probs.topk(min(top_k, probs.shape[-1]))
    top = [[adapter.token_str(i), float(p)] for i, p in zip(indices.tolist(), values.tolist())]
    return int(indices[0]), float(values[0]), top


@torch.no_grad()
def generate(
    loaded,
    image,
    question: str,
    *,
    max_new_tokens: int | None = None,
    stop_strings: Sequence[str] = (),
    top_k: int = 5,
    raw_prompt: bool = False,
    use_cache: bool = True,
    progress: Progress = None,
    cancel: Cancel = None,
) -> Generation:
    """Greedy decoding of the answer to ``question`` about ``image``.

    Each step takes the argmax of the next-token distribution. It stops at an
    end token (:meth:`Adapter.end_token_ids`: the generation config's EOS ids,
    the tokenizer's EOS and padding; not kept in ``token_ids``), once the
    decoded answer contains one of ``stop_strings`` (the token completing it is
    kept; ``text`` is cut just after the stop string), after
    ``max_new_tokens`` tokens, or when the prompt and the answer reach
    ``max_length`` (see :func:`_limits`).

    Args:
        image: a path, PIL image or uint8 array.
        max_new_tokens: None: the generation config's ``max_new_tokens``, else 32.
        raw_prompt: see :func:`core.answer.answer_batch`.
        use_cache: False re-runs the whole sequence at every step (the reference).
        progress: called ``(tokens done, max_new_tokens, message)`` after each step.
        cancel: polled before each step; True stops with the tokens so far
            (stop reason "cancelled").

    Raises:
        QuestionError: a question the model cannot be run on, or a bad count or stop string.
    """
    max_new_tokens, max_length = _limits(loaded, max_new_tokens)
    stops = _check_arguments(max_new_tokens, top_k, stop_strings)
    adapter = loaded.adapter
    end_ids = adapter.end_token_ids()
    ids: list[int] = []
    tokens: list[str] = []
    probs: list[float] = []
    top: list[list] = []
    stop_token, stop_reason, text = None, "max_new_tokens", ""
    with oom_guard("generating"):
        inputs = adapter.prepare([image], [question], raw_prompt=raw_prompt)
        prompt_length = int(inputs.input_ids.shape[1])
        state = adapter.start_decoding(inputs, use_cache=use_cache)
        cached = state.cache is not None
        for step in range(max_new_tokens):
            if prompt_length + step >= max_length:
                stop_reason = "max_length"
                break
            if cancel is not None and cancel():
                stop_reason = "cancelled"
                break
            if step:
                state = adapter.decode_step(state, ids[-1])
            token_id, prob, step_top = _step_numbers(adapter, state.logits[0], top_k)
            if token_id in end_ids:
                stop_token = {"token_id": token_id, "token": adapter.token_str(token_id), "prob": prob, "top": step_top}
                stop_reason = "eos"
                break
            ids.append(token_id)
            tokens.append(adapter.token_str(token_id))
            probs.append(prob)
            top.append(step_top)
            if progress is not None:
                progress(len(ids), max_new_tokens, f"token {len(ids)}/{max_new_tokens} {tokens[-1]!r}")
            text = decoded_text(adapter, ids)
            hits = [text.find(s) + len(s) for s in stops if s in text]
            if hits:
                text = text[: min(hits)]
                stop_reason = "stop_string"
                break
    return Generation(
        token_ids=ids,
        tokens=tokens,
        probs=probs,
        top=top,
        stop_reason=stop_reason,
        text=text,
        stop_token=stop_token,
        cache=cached,
        question=question,
        raw_prompt=raw_prompt,
        prompt_length=prompt_length,
        max_new_tokens=max_new_tokens,
        stop_strings=list(stops),
        top_k=top_k,
        model={"spec": loaded.spec, "fingerprint": loaded.fingerprint, **adapter.describe()},
    )


def read_generation(path: str | Path) -> Generation:
    """The :class:`Generation` of a ``vlm-readout generate --json`` file;
    InputFileError (one line, naming the file) for anything else."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputFileError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputFileError(f"{p}: not a generate JSON ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if not isinstance(doc, dict) or doc.get("kind") != Generation.kind:
        raise InputFileError(f'{p}: not a generate JSON (no "kind": "generate")')
    ids = doc.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InputFileError(f'{p}: "token_ids" must be a non-empty list of integers')
    try:
        return Generation.from_dict(doc)
    except (KeyError, TypeError, ValueError) as e:
        raise InputFileError(f"{p}: not a generate JSON ({type(e).__name__}: {e})") from None
