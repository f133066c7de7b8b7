"""Where a claim is read on one input (docs/METHODS.md §4.11, "Claim specifications"):
the specification's query position, the keys its pattern relation is scored over,
the sources among them, and the two tokens its metric S is the logit difference of
(:class:`Row`, :func:`locate`); and step 4's counterfactual of an input for the
relations whose sources are the sequence's own tokens (:func:`shifted`,
:func:`other_image`).

Everything here reads the prepared token ids and the visual tokens' geometry: no
forward, so a relation's chance and the held-out set's power are known before any
model runs (:mod:`core.methods.validation.power`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from core.errors import InterventionError, QuestionError
from core.forward.geometry import region_tokens
from core.methods.flow.positions import question_span
from core.methods.validation.setting import REGION_MIN_COVER
from core.methods.validation.spec import ClaimSpec


@dataclass
class Row:
    """One input's reading of a relation.

    Attributes:
        length: the prompt's token count (rows of one length and query share a batch).
        query: the query's sequence position (its attention row, its z edit, its S).
        keys: the key of each slot, as a self-attention head reads it (a sequence position;
            empty where the image is read through cross-attention only).
        cross_keys: the same slots as a cross-attention head reads them (visual-token
            indices), or None where the sources are sequence positions (no cross key).
        scored: the slots the argmax is taken over (the image: the patch tokens).
        sources: the slots the relation names; ``distractors`` the contrasted ones, each a
            list of slots; ``background`` the scored slots that are neither.
        answer_id, foil_id: S is ``logit[answer_id] - logit[foil_id]`` at the query.
    """

    length: int
    query: int
    keys: list[int]
    cross_keys: list[int] | None
    scored: list[int]
    sources: list[int]
    distractors: list[list[int]] = field(default_factory=list)
    background: list[int] = field(default_factory=list)
    answer_id: int = -1
    foil_id: int = -1

    @property
    def n_slots(self) -> int:
        return len(self.keys) if self.cross_keys is None else len(self.cross_keys)

    @property
    def chance(self) -> float:
        """A uniform head's chance to put its argmax on a source."""
        return len(self.sources) / len(self.scored) if self.scored else 0.0

    def key_positions(self, kind: str) -> list[int]:
        """The slots' keys for a block of ``kind`` ("self" or "cross")."""
        if kind == "cross":
            if self.cross_keys is None:
                raise InterventionError("a cross-attention head has no key among the sequence's own tokens")
            return self.cross_keys
        return self.keys


class Unreadable(Exception):
    """An input on which the relation has no reading (the reason is the message): left out, counted."""


def _image(sample):
    from PIL import Image

    return Image.fromarray(np.asarray(sample.image))


def prepared(adapter, sample, question: str | None = None):
    """The model's inputs for ``sample`` (its own question, or ``question``)."""
    return adapter.prepare([_image(sample)], [sample.question if question is None else question])


def _span(adapter, ids: list[int], question: str) -> tuple[int, int]:
    try:
        return question_span(adapter, ids, question)
    except InterventionError as e:
        raise Unreadable(str(e)) from None


def _query(spec: ClaimSpec, adapter, ids: list[int], answer: int, question: str, seed: int, index: int) -> int:
    if spec.query == "answer":
        return answer
    start, end = _span(adapter, ids, question)
    if spec.query == "question_word":
        if end - start < 2:
            raise Unreadable("the question has one token: no word of it follows another")
        rng = np.random.default_rng([seed, max(index, 0), 7])
        return int(start + 1 + rng.integers(end - start - 1))
    for q in range(end - 1, start, -1):  # "repeat": the last token that occurred before, not just before
        if _earlier(ids, q, start) is not None:
            return q
    raise Unreadable("no token of the question repeats an earlier one with another token after it")


def _earlier(ids: list[int], q: int, start: int) -> int | None:
    """The latest earlier occurrence e of ``ids[q]`` in ``[start, q - 1)`` (its next token is not the query)."""
    for e in range(q - 2, start - 1, -1):
        if ids[e] == ids[q]:
            return e
    return None


def _delimiters(adapter, ids: list[int], visual: set[int], q: int) -> list[int]:
    """The first position, the special and visual-delimiter tokens and the punctuation-only text tokens up to ``q``."""
    special = set(getattr(adapter.tokenizer, "all_special_ids", []) or [])
    out = [0]
    for p in range(1, q + 1):
        if p in visual:
            continue
        if ids[p] in special:
            out.append(p)
            continue
        text = adapter.tokenizer.decode([ids[p]])
        if text.strip() == "" or all(not ch.isalnum() for ch in text.strip()):
            out.append(p)
    return out


def foil_word(adapter, words, avoid: set[int], seed: int, index: int) -> tuple[str, int]:
    """A seeded word of ``words`` that is one token of this model and none of ``avoid``."""
    order = np.random.default_rng([seed, max(index, 0), 11]).permutation(len(words))
    for k in order:
        try:
            token = adapter.token_id(words[int(k)])
        except QuestionError:
            continue
        if token not in avoid:
            return words[int(k)], token
    raise Unreadable("no foil word is one token of this model and absent from the input")


def locate(adapter, spec: ClaimSpec, sample, inputs, *, seed: int = 0, words=(), tokens=None) -> Row:
    """Where ``spec`` is read on ``sample`` (``inputs``: its prepared batch of one; ``tokens``:
    its visual tokens, for the image relations); :class:`Unreadable` where it has no reading."""
    ids = [int(t) for t in inputs.input_ids[0].tolist()]
    answer = int(inputs.answer_positions[0])
    visual = [int(p) for p in adapter.visual_positions(inputs)[0].tolist()]
    index = int(getattr(sample, "index", 0))
    if spec.on_image:
        if getattr(sample, "target", None) is None:
            raise Unreadable("the input has no target object")
        size = (np.asarray(sample.image).shape[1], np.asarray(sample.image).shape[0])
        tokens = tokens if tokens is not None else adapter.visual_tokens(size, visual)
        target = region_tokens(tokens, sample.objects[sample.target].mask, REGION_MIN_COVER)
        if not target:
            raise Unreadable("the target covers no visual token")
        ds = [
            [t for t in region_tokens(tokens, sample.objects[d].mask, REGION_MIN_COVER) if t not in target]
            for d in sample.distractors
        ]
        union = np.zeros(np.asarray(sample.image).shape[:2], dtype=bool)
        for o in sample.objects:
            union |= o.mask
        touched = set(region_tokens(tokens, union, 1e-9))
        scored = [k for k, t in enumerate(tokens) if t.col >= 0]
        row = Row(
            len(ids),
            answer,
            visual,
            list(range(len(tokens))),
            scored,
            target,
            ds,
            [k for k in scored if k not in touched],
        )
    else:
        q = _query(spec, adapter, ids, answer, sample.question, seed, index)
        if spec.sources == "previous_token":
            sources = [q - 1]
        elif spec.sources == "after_earlier_occurrence":
            e = _earlier(ids, q, _span(adapter, ids, sample.question)[0])
            if e is None:
                raise Unreadable("the query token has no earlier occurrence")
            sources = [e + 1]
        elif spec.sources == "first_token":
            sources = [0]
        else:
            sources = _delimiters(adapter, ids, set(visual), q)
        scored = list(range(q + 1))
        others = [k for k in scored if k not in sources and k != q]
        row = Row(len(ids), q, scored, None, scored, sources, [[k] for k in others], others)
    if spec.content == "copy":
        row.answer_id = ids[row.keys[row.sources[0]]]
        _, row.foil_id = foil_word(adapter, list(words), set(ids), seed, index)
    else:
        try:
            row.answer_id, row.foil_id = adapter.token_id(sample.answer), adapter.token_id(sample.foil)
        except (QuestionError, AttributeError) as e:
            raise Unreadable(f"the answer or foil is no single token ({e})") from None
    return row


def answer_row(adapter, sample, inputs) -> Row:
    """The answer position of an input of another question kind (step 7): S is its answer
    minus its foil there; no keys (only its ablation is run)."""
    q = int(inputs.answer_positions[0])
    return Row(
        int(inputs.input_ids.shape[1]),
        q,
        [],
        None,
        [],
        [],
        answer_id=adapter.token_id(sample.answer),
        foil_id=adapter.token_id(sample.foil),
    )


@dataclass
class Counterfactual:
    """Step 4's counterfactual of one input: its image and question, and the slots of the
    original row (``a``) and of the counterfactual's (``b``) the sources sat at and moved to
    (the same for a relation whose sources stay)."""

    image: np.ndarray
    question: str
    query: int
    a: list[int]
    b: list[int]
    length: int
    scored: list[int]


def shifted(adapter, spec: ClaimSpec, sample, row: Row, *, seed: int = 0, words=()) -> Counterfactual:
    """``sample`` with one seeded word inserted before the sources' anchor (the previous token
    itself; the earlier occurrence whose next token is the source): every later position moves
    one on, the query and the sources with it. :class:`Unreadable` where the tokenizer does not
    write the longer question as the same tokens plus one."""
    inputs = prepared(adapter, sample)
    ids = [int(t) for t in inputs.input_ids[0].tolist()]
    source = row.keys[row.sources[0]]
    anchor = source if spec.sources == "previous_token" else source - 1
    start, end = _span(adapter, ids, sample.question)
    if not start <= anchor < end:
        raise Unreadable("the sources' anchor is not in the question")
    word, _ = foil_word(adapter, list(words), set(ids), seed, int(getattr(sample, "index", 0)) + 1)
    before = adapter.tokenizer.decode(ids[start:anchor]).strip()
    after = adapter.tokenizer.decode(ids[anchor:end]).strip()
    question = " ".join(t for t in (before, word, after) if t)
    moved = prepared(adapter, sample, question)
    got = [int(t) for t in moved.input_ids[0].tolist()]
    # the word as the tokenizer writes it there (a BPE's " word" is not its "word"): one token, nothing else moved
    if len(got) != len(ids) + 1 or got[:anchor] != ids[:anchor] or got[anchor + 1 :] != ids[anchor:]:
        raise Unreadable("the question with one word inserted is not the same tokens plus one")
    return Counterfactual(
        np.asarray(sample.image), question, row.query + 1, [source], [source + 1], len(got), list(range(row.query + 2))
    )


def other_image(adapter, spec: ClaimSpec, sample, row: Row, partner) -> Counterfactual:
    """``sample``'s question under ``partner``'s image: the first token and the delimiters stay
    (relocated in the new input, where the image's tokens may differ in number)."""
    inputs = adapter.prepare([_image(partner)], [sample.question])
    ids = [int(t) for t in inputs.input_ids[0].tolist()]
    q = int(inputs.answer_positions[0])
    visual = set(int(p) for p in adapter.visual_positions(inputs)[0].tolist())
    b = [0] if spec.sources == "first_token" else _delimiters(adapter, ids, visual, q)
    return Counterfactual(
        np.asarray(partner.image),
        sample.question,
        q,
        [row.keys[k] for k in row.sources],
        b,
        len(ids),
        list(range(q + 1)),
    )
