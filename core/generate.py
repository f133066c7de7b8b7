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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from core.answer_text import AnswerText
from core.errors import InputFileError, QuestionError, oom_guard
from core.files import json_fields as jf
from core.files.input_files import read_json_file
from core.results.audit import AuditRecord
from core.results.readout import jsonable

Progress = Callable[[int, int, str], None] | None
Cancel = Callable[[], bool] | None

DEFAULT_MAX_NEW_TOKENS = 32
STOP_REASONS = ("eos", "stop_string", "max_new_tokens", "max_length", "cancelled")
SCHEMA_VERSION = 1
# Bounds of a generate JSON read back (--answer-from): far above what a run writes
# (a model's positions bound its tokens), low enough that no file makes the reader
# allocate much.
MAX_GENERATION_BYTES = 64 * 2**20
MAX_GENERATED_TOKENS = 1_000_000


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
        image_sha256: the image's :func:`core.files.images.image_sha256` where a
            file recorded it (the CLI's JSON), else None.
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
    image_sha256: str | None = field(default=None, compare=False)

    kind = "generate"

    def answer_text(self, index: int = 0) -> AnswerText:
        """Token ``index`` of this answer, for a read-out at it (the ids as
        generated: no re-tokenisation of the text)."""
        return AnswerText(self.text, tuple(self.token_ids), tuple(self.tokens), index)

    def to_dict(self) -> dict:
        inputs = ("question", "raw_prompt", "image_sha256")
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in inputs}
        d["input"] = {"question": self.question, "raw_prompt": self.raw_prompt, "prompt_length": self.prompt_length}
        if self.image_sha256 is not None:
            d["input"]["image_sha256"] = self.image_sha256
        # the dtype and device it ran in, as the model block states them (Adapter.dtype_and_device)
        d["input"].update({k: self.model[k] for k in ("dtype", "device") if k in self.model})
        del d["prompt_length"]
        return jsonable({"schema_version": SCHEMA_VERSION, "kind": self.kind, **d})

    @classmethod
    def from_dict(cls, d: dict) -> Generation:
        """The Generation of :meth:`to_dict` (or of the CLI's JSON, which adds
        ``image``, ``image_sha256`` and ``image_size`` to ``input``). Every field
        is checked by type, range and length (the ids against no vocabulary:
        :func:`check_generation` does that); ValueError naming the first bad one."""
        fields_ = _generation_fields(d)
        return cls(**fields_, image_sha256=d["input"].get("image_sha256"))

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
    folders_new_tokens, max_length = loaded.adapter.generation_limits()
    if max_new_tokens is None:
        max_new_tokens = folders_new_tokens or DEFAULT_MAX_NEW_TOKENS
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
    """The :class:`Generation` of a ``vlm-readout generate --json`` file, with
    at least one token; InputFileError (one line, naming the file and the
    field) for anything else. Fields are checked by type, range and length
    here (:meth:`Generation.from_dict`); against a model and an input by
    :func:`check_generation`."""
    name = str(path)
    doc = read_json_file(path, InputFileError, max_bytes=MAX_GENERATION_BYTES)
    if doc.get("kind") != Generation.kind:
        raise InputFileError(f'{name}: not a generate JSON (no "kind": "generate")')
    try:
        generation = Generation.from_dict(doc)
    except ValueError as e:
        raise InputFileError(f"{name}: {e}") from None
    if not generation.token_ids:
        raise InputFileError(f'{name}: "token_ids" is empty (the model generated no token to read out)')
    return generation


def check_generation(
    generation: Generation,
    loaded,
    name: str,
    *,
    question: str,
    raw_prompt: bool = False,
    image_sha256: str | None = None,
) -> None:
    """InputFileError (one line starting with ``name``) unless ``generation``
    was made by ``loaded`` (its fingerprint) for ``question`` (and, where the
    file records it, the image of ``image_sha256``), and every token is one
    this model can be fed after the prompt: an id inside its vocabulary, not an
    image / video placeholder, no other markup unless ``raw_prompt``, its
    string the tokenizer's, the text the tokens' decoding, shorter than the
    model's positions."""
    made_by, have = generation.model.get("fingerprint"), getattr(loaded, "fingerprint", None)
    if made_by != have:
        raise InputFileError(
            f"{name}: generated by model {jf.shown(generation.model.get('spec'))} (fingerprint {str(made_by)[:12]}), "
            f"not the one loaded ({str(have)[:12]})"
        )
    if generation.question != question:
        raise InputFileError(f"{name}: generated for the question {jf.shown(generation.question)}, not this one")
    made_for = generation.image_sha256
    if made_for is not None and image_sha256 is not None and made_for != image_sha256:
        raise InputFileError(
            f'{name}: generated for another image ("input.image_sha256" {made_for[:12]}, this image '
            f"{image_sha256[:12]}); give the answer as --answer-text to read it out on this image"
        )
    adapter = loaded.adapter
    vocab = int(adapter.W_U.shape[-1])
    limit = adapter.max_positions()
    if len(generation.token_ids) >= limit:
        raise InputFileError(
            f'{name}: "token_ids" holds {len(generation.token_ids):,} tokens; the model takes {limit:,} positions'
        )
    markup = adapter.markup
    for i, (token_id, token) in enumerate(zip(generation.token_ids, generation.tokens)):
        where = f'{name}: "token_ids[{i}]"'
        if token_id >= vocab:
            raise InputFileError(
                f"{where}: {token_id} is outside the model's {vocab}-token vocabulary (0..{vocab - 1})"
            )
        special = markup.ids.get(token_id)
        if special in markup.placeholders:
            kind = markup.placeholders[special]
            raise InputFileError(f"{where}: {token_id} is the {kind} placeholder {special!r}, never an answer token")
        if special is not None and not raw_prompt:
            raise InputFileError(
                f"{where}: {token_id} is the special token {special!r} (markup); read out after it only with "
                "--raw-prompt"
            )
        if token != adapter.token_str(token_id):
            raise InputFileError(
                f'{name}: "tokens[{i}]" is {jf.shown(token)}, but token {token_id} is {adapter.token_str(token_id)!r}'
            )
    decoded = decoded_text(adapter, generation.token_ids)
    cut = generation.stop_reason == "stop_string"  # the text ends just after the stop string
    if generation.text != decoded and not (cut and generation.text and decoded.startswith(generation.text)):
        raise InputFileError(
            f'{name}: "text" is {jf.shown(generation.text)}, but the tokens decode to {jf.shown(decoded)}'
        )


# ---- the fields of a generate JSON, checked by Generation.from_dict (ValueError: the field and what was expected)


def _probability(value, label: str) -> float | None:
    """A probability as the tool writes it: a number in [0, 1], or null (a non-finite one)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f'"{label}" must be a probability (a number in [0, 1]), got {jf.json_kind(value)}')
    if not 0 <= value <= 1:
        raise ValueError(f'"{label}" must be a probability in [0, 1], got {value!r}')
    return value


def _per_token(d: dict, key: str, n: int) -> list:
    """``d[key]``: one entry per generated token."""
    return jf.array(jf.required(d, key), key, most=MAX_GENERATED_TOKENS, length=n)


def _alternatives(value, label: str, top_k: int) -> list:
    """One step's ``[[token, prob], ...]``, at most ``top_k`` of them."""
    for j, pair in enumerate(jf.array(value, label, most=top_k)):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f'"{label}[{j}]" must be a [token, probability] pair, got {jf.json_kind(pair)}')
        jf.text(pair[0], f"{label}[{j}][0]")
        _probability(pair[1], f"{label}[{j}][1]")
    return value


def _generation_fields(d) -> dict:
    """The keyword arguments of :class:`Generation` (less ``image_sha256``)
    from a generate JSON document, every field checked; ValueError naming the
    first bad one."""
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object, got {jf.json_kind(d)}")
    version = jf.required(d, "schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise ValueError(f'"schema_version" is {repr(version)[:40]}; this build reads {SCHEMA_VERSION}')
    top_k = jf.integer(jf.required(d, "top_k"), "top_k", 1, jf.INT32_MAX)
    max_new = jf.integer(jf.required(d, "max_new_tokens"), "max_new_tokens", 1, jf.INT32_MAX)
    ids = jf.array(jf.required(d, "token_ids"), "token_ids", most=MAX_GENERATED_TOKENS)
    for i, token_id in enumerate(ids):
        jf.integer(token_id, f"token_ids[{i}]", 0, jf.INT32_MAX)
    if len(ids) > max_new:
        raise ValueError(f'"token_ids" has {len(ids):,} tokens, more than its "max_new_tokens" ({max_new:,})')
    tokens = _per_token(d, "tokens", len(ids))
    for i, token in enumerate(tokens):
        jf.text(token, f"tokens[{i}]")
    probs = _per_token(d, "probs", len(ids))
    for i, p in enumerate(probs):
        _probability(p, f"probs[{i}]")
    top = _per_token(d, "top", len(ids))
    for i, step in enumerate(top):
        _alternatives(step, f"top[{i}]", top_k)
    stop_reason = jf.one_of(jf.required(d, "stop_reason"), "stop_reason", STOP_REASONS)
    stop_token = jf.required(d, "stop_token")
    if (stop_reason == "eos") != (stop_token is not None):
        raise ValueError('"stop_token" must be an object when "stop_reason" is "eos", else null')
    if stop_token is not None:
        jf.obj(stop_token, "stop_token")
        jf.integer(jf.required(stop_token, "token_id", "stop_token."), "stop_token.token_id", 0, jf.INT32_MAX)
        jf.text(jf.required(stop_token, "token", "stop_token."), "stop_token.token")
        _probability(jf.required(stop_token, "prob", "stop_token."), "stop_token.prob")
        _alternatives(jf.required(stop_token, "top", "stop_token."), "stop_token.top", top_k)
    stops = jf.array(jf.required(d, "stop_strings"), "stop_strings", most=MAX_GENERATED_TOKENS)
    for i, s in enumerate(stops):
        jf.text(s, f"stop_strings[{i}]", non_empty=True)
    model = jf.obj(jf.required(d, "model"), "model")
    for key in ("spec", "fingerprint"):
        if model.get(key) is not None:
            jf.text(model[key], f"model.{key}")
    inp = jf.obj(jf.required(d, "input"), "input")
    image_sha = inp.get("image_sha256")
    if image_sha is not None and (
        not isinstance(image_sha, str) or len(image_sha) != 64 or image_sha.strip("0123456789abcdef")
    ):
        raise ValueError('"input.image_sha256" must be 64 lowercase hex digits')
    return {
        "token_ids": ids,
        "tokens": tokens,
        "probs": probs,
        "top": top,
        "stop_reason": stop_reason,
        "text": jf.text(jf.required(d, "text"), "text"),
        "stop_token": stop_token,
        "cache": jf.boolean(jf.required(d, "cache"), "cache"),
        "question": jf.text(jf.required(inp, "question", "input."), "input.question", non_empty=True),
        "raw_prompt": jf.boolean(jf.required(inp, "raw_prompt", "input."), "input.raw_prompt"),
        "prompt_length": jf.integer(
            jf.required(inp, "prompt_length", "input."), "input.prompt_length", 1, jf.INT32_MAX
        ),
        "max_new_tokens": max_new,
        "stop_strings": stops,
        "top_k": top_k,
        "model": model,
    }
