"""Edits to a forward: remove (zero) or replace one component's write.

A :class:`core.capture.Trace` records the edits its run was made with, so an
edited trace is never mistaken for the model's own computation. Hook-based
families apply edits with :meth:`core.models.adapter.Adapter.edit_hooks`;
families that replay the forward (CoCa) apply them in the replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Edit:
    """One component's write, changed during a forward.

    Attributes:
        block: block index (``Trace.block_names``).
        head: query head whose ``z`` is changed, or None for the block's MLP output.
        positions: sequence positions the edit applies to (None: every position).
        value: None to zero the write; else the replacement, ``(n_pos, d_head)``
            for a head's ``z`` or ``(n_pos, d_model)`` for an MLP output, one
            row per edited position (patching).
    """

    block: int
    head: int | None = None
    positions: tuple[int, ...] | None = None
    value: torch.Tensor | None = None

    def describe(self) -> str:
        what = "mlp" if self.head is None else f"H{self.head}"
        where = "all positions" if self.positions is None else f"positions {list(self.positions)}"
        how = "zeroed" if self.value is None else "replaced"
        return f"block {self.block} {what} {how} at {where}"

    def apply(self, x: torch.Tensor, d_head: int | None = None) -> torch.Tensor:
        """A copy of ``x`` ``(batch, pos, width)`` with the edit applied: the
        head's slice ``[h * d_head, (h + 1) * d_head)`` of z, or the whole MLP output."""
        x = x.clone()
        pos = slice(None) if self.positions is None else list(self.positions)
        cols = slice(None) if self.head is None else slice(self.head * d_head, (self.head + 1) * d_head)
        if self.value is None:
            x[:, pos, cols] = 0
        else:
            x[:, pos, cols] = self.value.to(x.dtype).to(x.device)
        return x
