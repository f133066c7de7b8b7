"""Where each answer token's query looks: the text-side patterns over a whole answer.

With an answer read out at token k (teacher forcing, :mod:`core.answer_text`),
the positions that predict the answer's tokens 0..k are the prompt's last
token and the first k answer tokens. For each of those query rows and each
self-attention block this module splits the attention weight by what the keys
are: the question's text tokens, the answer tokens before the one predicted,
the image's visual tokens, the attention sink, and the rest (chat markup,
image delimiters, special tokens). Each row's parts sum to 1 (padding is never
a key: the causal mask and the attention mask give it no weight).

A mass is where the query reads, not what the read value carries or whether
the answer needs it (docs/METHODS.md, "Attention is not attribution").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.results.audit import AuditRecord

# The parts a row's weight is split into, in the JSON's order.
PARTS = ("question_mass", "answer_mass", "image_mass", "sink_mass", "other_mass")


@dataclass
class AnswerPatterns:
    """Attention mass per answer query row, by key kind.

    Attributes:
        positions: the query rows' sequence positions: the prompt's last token,
            then each answer token before the one read out.
        tokens: the token at each of those positions.
        predicts: the answer token index each row predicts (0 .. k).
        blocks: the self-attention blocks averaged over (cross-attention blocks,
            which read only the image, are not among them: ``skipped_blocks``).
        by_block: ``{part: (blocks, rows)}`` each block's mass, averaged over its heads.
        mean: ``{part: (rows,)}`` averaged over heads and blocks.
    """

    positions: list[int]
    tokens: list[str]
    predicts: list[int]
    blocks: list[int]
    skipped_blocks: list[int]
    by_block: dict[str, torch.Tensor]
    mean: dict[str, torch.Tensor]
    audit: AuditRecord = field(repr=False, default=None)

    def to_dict(self) -> dict:
        return {
            "positions": self.positions,
            "tokens": self.tokens,
            "predicts": self.predicts,
            "blocks": self.blocks,
            "skipped_blocks": self.skipped_blocks,
            "rows": [
                {
                    "position": p,
                    "token": t,
                    "predicts": k,
                    **{part: float(self.mean[part][i]) for part in PARTS},
                }
                for i, (p, t, k) in enumerate(zip(self.positions, self.tokens, self.predicts))
            ],
            "by_block": {part: self.by_block[part].tolist() for part in PARTS},
        }

    @classmethod
    def from_dict(cls, d: dict) -> AnswerPatterns:
        """The inverse of :meth:`to_dict` (the audit row travels apart, in the analyze JSON's
        ``audit``); the masses in float64, which holds every JSON number as written."""
        rows = d["rows"]
        return cls(
            list(d["positions"]),
            list(d["tokens"]),
            list(d["predicts"]),
            list(d["blocks"]),
            list(d["skipped_blocks"]),
            {part: torch.tensor(d["by_block"][part], dtype=torch.float64) for part in PARTS},
            {part: torch.tensor([row[part] for row in rows], dtype=torch.float64) for part in PARTS},
        )

    def masses(self, row: int, block: int | None = None) -> tuple[float, ...]:
        """Row ``row``'s masses in :data:`PARTS` order: averaged over the blocks (``block``
        None) or in one of them (an index into :attr:`blocks`)."""
        if block is None:
            return tuple(float(self.mean[part][row]) for part in PARTS)
        return tuple(float(self.by_block[part][block][row]) for part in PARTS)


def key_kinds(adapter, trace, n_prompt: int, batch: int = 0) -> list[str]:
    """One of "question", "answer", "image", "sink", "other" or "padding" per
    sequence position: the prompt's text tokens are the question, every
    position from ``n_prompt`` on is an answer token."""
    kinds = []
    for position, role in enumerate(adapter.token_roles(trace, batch)):
        if role == "padding":
            kinds.append("padding")
        elif position >= n_prompt:
            kinds.append("answer")
        elif role == "text":
            kinds.append("question")
        elif role == "visual":
            kinds.append("image")
        elif role == "sink":
            kinds.append("sink")
        else:
            kinds.append("other")
    return kinds


@torch.no_grad()
def answer_patterns(
    adapter, trace, n_answer_prefix: int, token_strings: list[str] | None = None, batch: int = 0
) -> AnswerPatterns:
    """The masses of every answer query row (:class:`AnswerPatterns`).

    Args:
        n_answer_prefix: how many answer tokens the forward ran after the prompt
            (0: the first-token read-out, one row).
        token_strings: one string per sequence position (default: the ids).

    Raises:
        ValueError: the capture did not keep the pattern rows of the answer positions.
    """
    answer = int(trace.answer_positions[batch])
    positions = list(range(answer - n_answer_prefix, answer + 1))
    kept = trace.query_positions.tolist()
    missing = [p for p in positions if p not in kept]
    if missing:
        raise ValueError(f"answer_patterns: the capture's query_positions lack the answer rows {missing}")
    rows = torch.tensor([kept.index(p) for p in positions])
    kinds = key_kinds(adapter, trace, positions[0] + 1, batch)
    masks = {part: torch.tensor([k == part.removesuffix("_mass") for k in kinds]) for part in PARTS}
    blocks = [b for b in range(trace.n_blocks) if trace.block_kinds[b] == "self"]
    skipped = [b for b in range(trace.n_blocks) if trace.block_kinds[b] != "self"]
    by_block = {part: torch.zeros(len(blocks), len(positions), dtype=torch.float64) for part in PARTS}
    for i, block in enumerate(blocks):
        pattern = trace.patterns[block][batch][:, rows].double().cpu()  # (heads, rows, keys)
        for part in PARTS:
            by_block[part][i] = pattern[:, :, masks[part]].sum(-1).mean(0)
    mean = {
        part: v.mean(0) if blocks else torch.zeros(len(positions), dtype=torch.float64) for part, v in by_block.items()
    }
    ids = trace.input_ids[batch].tolist()
    tokens = [token_strings[p] if token_strings is not None else str(ids[p]) for p in positions]
    audit = AuditRecord.for_method(
        "pattern analysis",
        controls=[
            "every answer row's weight split by key kind (question, earlier answer tokens, image, sink, other); "
            "the parts of a row sum to 1",
            "padding excluded (no weight under the causal and attention masks)",
        ],
        parameters={"positions": positions, "blocks": blocks, "average": "heads, then self-attention blocks"},
        notes=[
            "a mass says where a query reads, not what the value carries or whether the answer needs it",
            *(
                ["cross-attention blocks read only the image and are left out; image mass here is self-attention's"]
                if skipped
                else []
            ),
        ],
    )
    return AnswerPatterns(positions, tokens, list(range(len(positions))), blocks, skipped, by_block, mean, audit)
