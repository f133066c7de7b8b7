"""A prepared batch: what :meth:`core.models.adapter.Adapter.prepare` returns and
every forward, capture and decoding step runs (its own module so that the
adapter's mix-ins can name it without importing the adapter)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ModelInputs:
    """A prepared batch.

    Attributes:
        tensors: keyword arguments for the family's forward.
        answer_positions: ``(batch,)`` index of the position whose next-token
            distribution is the answer.
        input_ids: ``(batch, pos)`` the token ids of the text stream.
    """

    tensors: dict[str, torch.Tensor]
    answer_positions: torch.Tensor
    input_ids: torch.Tensor
    prompts: list[str]
