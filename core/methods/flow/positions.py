"""Named position sets of one prepared input: what an attention edge or a patch
is stated in.

``image``: the visual tokens (every one the model reads); ``region``: the visual
tokens a painted mask touches; ``question``: the question's own tokens in the
prompt (not the chat markup around it); ``word:W``: the tokens of word ``W`` in
the question; ``text``: every position that is not a visual token (the question,
the chat markup, the answer: the cut of the image from all of them leaves no
indirect route); ``last``: the last prompt token; ``answer``: the answer position
(the position whose next token is the answer read out: the last prompt token,
or under teacher forcing the last answer token given).

A set has two faces. Its sequence positions are the keys and queries of
self-attention; its visual-token indices are the keys of cross-attention
(``visual``), where the image is not in the sequence. A set of text positions
has no cross-attention keys; the image's set has no self-attention keys in a
family whose image is read through cross-attention only.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import InterventionError

IMAGE, REGION, QUESTION, TEXT, LAST, ANSWER = "image", "region", "question", "text", "last", "answer"
WORD_PREFIX = "word:"
SET_NAMES = (IMAGE, REGION, QUESTION, TEXT, LAST, ANSWER)  # and word:W
# the queries an edge may end at: text positions (a visual token as a query is the image reading itself)
TARGET_NAMES = (ANSWER, QUESTION, TEXT, LAST)


@dataclass(frozen=True)
class PositionSet:
    """One named set: ``positions`` (sequence positions, ascending) and ``visual``
    (visual-token indices; empty for a set of text positions)."""

    name: str
    positions: tuple[int, ...]
    visual: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {"name": self.name, "positions": list(self.positions), "visual_tokens": list(self.visual)}

    @classmethod
    def from_dict(cls, d: dict) -> PositionSet:
        return cls(str(d["name"]), tuple(int(p) for p in d["positions"]), tuple(int(v) for v in d["visual_tokens"]))


def check_set_name(name: str, *, target: bool = False) -> str:
    """``name`` if it names a set (a target: one of :data:`TARGET_NAMES` or a word); else
    one line naming the sets there are."""
    name = name.strip()
    if name.startswith(WORD_PREFIX):
        if not name[len(WORD_PREFIX) :].strip():
            raise InterventionError(f"{name!r}: name the word after {WORD_PREFIX!r} (word:blue)")
        return name
    allowed = TARGET_NAMES if target else SET_NAMES
    if name not in allowed:
        what = "target" if target else "source"
        raise InterventionError(f"{what} set {name!r}: expected one of {', '.join(allowed)} or word:W")
    return name


@dataclass(frozen=True)
class EdgeKind:
    """Edges from a key in ``source`` to a query in ``target`` (set names)."""

    source: str
    target: str

    @property
    def name(self) -> str:
        return f"{self.source}->{self.target}"

    @classmethod
    def parse(cls, text: str) -> EdgeKind:
        """``"image->answer"``; one line naming the sets for anything else."""
        if "->" not in text:
            raise InterventionError(f"edge {text!r}: write SOURCE->TARGET (image->answer, question->last)")
        source, target = (part.strip() for part in text.split("->", 1))
        return cls(check_set_name(source), check_set_name(target, target=True))


def parse_edges(text: str) -> list[EdgeKind]:
    """A comma-separated list of edge kinds, each once."""
    edges = [EdgeKind.parse(part) for part in text.split(",") if part.strip()]
    if not edges:
        raise InterventionError("name at least one edge kind (image->answer)")
    names = [e.name for e in edges]
    if len(set(names)) != len(names):
        raise InterventionError(f"an edge kind is named twice: {', '.join(names)}")
    return edges


def question_span(adapter, ids: list[int], question: str) -> tuple[int, int]:
    """``[start, end)`` of the question's tokens in the sequence ``ids``: its last run of the
    question's own token ids (tokenized alone, with and without a leading space); where the
    prompt's markup merges with the question's first or last token, the run of its inner
    tokens and the one token on each side."""
    text = question.strip()
    variants = []
    for written in (text, " " + text):
        q = adapter.tokenizer(written, add_special_tokens=False)["input_ids"]
        variants += [(q, 0), (q[1:-1], 1)] if len(q) > 2 else [(q, 0)]
    for q, widen in variants:
        n = len(q)
        for start in range(len(ids) - n, -1, -1):
            if n and ids[start : start + n] == q:
                return max(0, start - widen), min(len(ids), start + n + widen)
    raise InterventionError(f"the question's tokens are not in the prompt as the tokenizer writes them: {question!r}")


def word_positions(adapter, ids: list[int], span: tuple[int, int], word: str) -> tuple[int, ...]:
    """The positions in ``span`` whose tokens spell ``word`` (case and spaces aside); one line
    naming the question's tokens when it is not there."""
    start, end = span
    pieces = [adapter.tokenizer.decode([ids[p]]) for p in range(start, end)]
    squeezed, owner = "", []
    for p, piece in zip(range(start, end), pieces):
        for ch in "".join(piece.split()).lower():
            squeezed += ch
            owner.append(p)
    target = "".join(word.split()).lower()
    at = squeezed.find(target)
    if not target or at < 0:
        shown = " ".join(repr(piece) for piece in pieces)
        raise InterventionError(f"the word {word!r} is not in the question (its tokens: {shown})")
    return tuple(sorted(set(owner[at : at + len(target)])))


def position_sets(
    adapter, trace, inputs, question: str, names, *, region=(), answer_prefix=()
) -> dict[str, PositionSet]:
    """Each named set of the captured input ``trace`` (``inputs`` one row). ``region``: the
    visual-token indices of the painted region (:func:`core.forward.geometry.painted_tokens`),
    needed by ``region``."""
    visual_positions = [int(p) for p in trace.visual_positions[0].tolist()]
    answer = int(trace.answer_positions[0])
    last = answer - len(answer_prefix)
    span = None
    out = {}
    for name in dict.fromkeys(names):
        if name == IMAGE:
            out[name] = PositionSet(name, tuple(visual_positions), tuple(range(_n_visual(trace))))
        elif name == REGION:
            if not region:
                raise InterventionError("the region set needs a painted region that touches a visual token")
            tokens = tuple(sorted(int(t) for t in region))
            if max(tokens) >= _n_visual(trace):
                raise InterventionError(f"region token {max(tokens)} out of range ({_n_visual(trace)} visual tokens)")
            positions = tuple(visual_positions[t] for t in tokens) if visual_positions else ()
            out[name] = PositionSet(name, positions, tokens)
        elif name in (QUESTION,) or name.startswith(WORD_PREFIX):
            span = span or question_span(adapter, inputs.input_ids[0][: last + 1].tolist(), question)
            if name == QUESTION:
                out[name] = PositionSet(name, tuple(range(*span)))
            else:
                ids = inputs.input_ids[0].tolist()
                out[name] = PositionSet(name, word_positions(adapter, ids, span, name[len(WORD_PREFIX) :]))
        elif name == TEXT:
            seen = set(visual_positions)
            out[name] = PositionSet(name, tuple(p for p in range(answer + 1) if p not in seen))
        elif name == LAST:
            out[name] = PositionSet(name, (last,))
        elif name == ANSWER:
            out[name] = PositionSet(name, (answer,))
        else:
            check_set_name(name)
    return out


def _n_visual(trace) -> int:
    """How many visual tokens the model reads: in the sequence, else its cross-attention keys."""
    n = int(trace.visual_positions.shape[1])
    if n:
        return n
    cross = [kv for kv, kind in zip(trace.kv_source, trace.block_kinds) if kind == "cross" and kv is not None]
    return int(cross[0].shape[1]) if cross else 0
