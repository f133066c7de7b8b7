"""Edits to a forward: remove (zero), replace (patch) or knock out one
component, one stream slice, or one attention edge.

A :class:`core.forward.capture.Trace` records the edits its run was made with, so an
edited trace is never mistaken for the model's own computation. Hook-based
families apply edits with :meth:`core.models.adapter.Adapter.edit_hooks`;
families that replay the forward (CoCa) apply them in the replay.

Sites (``Edit.site``):

* ``"z"``: a head's output before the output projection, the slice
  ``[h * d_head, (h + 1) * d_head)`` of ``z`` ``(batch, pos, heads * d_head)`` at
  sequence positions (zero, mean, resample ablation; head patching). ``b_O`` stays.
* ``"mlp"``: a block's MLP output ``(batch, pos, d_model)`` at sequence positions.
* ``"resid"``: the residual stream entering block ``block`` ``(batch, pos, d_model)``
  at sequence positions (what ``Trace.resid_pre[block]`` records).
* ``"vision_out"``: the vision encoder's output as the language side reads it
  ``(batch, n_visual, d_vision)``, at visual-token indices (LLaVA: the selected
  feature layer with CLS dropped, i.e. the projector's input).
* ``"projector_out"``: the projector's output ``(batch, n_visual, d_model)`` at
  visual-token indices (LLaVA: the rows scattered into the image positions).
* ``"kv_source"``: what cross-attention keys and values read before their norm
  ``(batch, n_visual, d_model)`` at visual-token indices (CoCa: the image tokens
  after ``ln_post``; ``block=None`` changes it for every cross block, an index
  for that cross block only). ``Trace.kv_source`` records it.
* ``"mixer"``: the write of a block whose token mixer is not attention (linear
  attention, a short convolution) ``(batch, pos, d_model)`` at sequence positions.
* ``"expert"``: one routed expert's write (what the model adds for it: Adapter.expert_writes) in a
  mixture-of-experts MLP, at sequence positions: taken out of the MLP's output
  (zero ablation) or replaced by ``value``; the router and the other experts as they ran.
* ``"knockout"``: attention edges removed before the softmax: the scores of
  query ``positions`` to key ``keys`` (sequence positions for self-attention,
  visual-token indices for cross-attention) of ``head`` (None: every head) in
  block ``block`` get ``-inf`` added, so the remaining weights renormalise.

For sites other than ``knockout``, ``value=None`` zeroes the slice and a tensor
replaces it, one row per edited position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.errors import InterventionError

SITES: tuple[str, ...] = (
    "z",
    "mlp",
    "resid",
    "vision_out",
    "projector_out",
    "kv_source",
    "knockout",
    "mixer",
    "expert",
)
VISUAL_SITES: tuple[str, ...] = ("vision_out", "projector_out", "kv_source")  # indexed by visual token
BLOCK_SITES: tuple[str, ...] = ("z", "mlp", "resid", "knockout", "mixer", "expert")  # need a block index


def _int_tuple(values, what: str) -> tuple[int, ...] | None:
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        values = values.flatten().tolist()
    elif isinstance(values, int):
        values = [values]
    out = tuple(int(v) for v in values)
    if any(v < 0 for v in out):
        raise InterventionError(f"{what} must be non-negative indices, got {list(out)}")
    if len(set(out)) != len(out):
        raise InterventionError(f"{what} repeat an index: {list(out)}")
    return out


@dataclass(frozen=True)
class Edit:
    """One change made during a forward.

    Existing calls keep their meaning: ``Edit(block, head, positions, value)``
    edits a head's ``z`` and ``Edit(block, None, positions, value)`` the MLP
    output.

    Attributes:
        block: block index (``Trace.block_names``); None for the sites outside
            the language model's blocks (``vision_out``, ``projector_out``) and
            for ``kv_source`` read by every cross block.
        head: query head whose ``z`` is changed (site ``z``); the head whose edges
            are knocked out (site ``knockout``, None: every head); else None.
        positions: sequence positions (``z``, ``mlp``, ``resid``; the query
            positions of a ``knockout``) or visual-token indices (the visual
            sites); None: every position.
        value: None to zero the slice; else the replacement ``(n_pos, width)``
            (or ``(batch, n_pos, width)``, one per batch row), one row per
            edited position; width ``d_head`` for ``z``. Always None for a knockout.
        site: one of :data:`SITES`; None picks ``"z"`` when ``head`` is given,
            else ``"mlp"`` (the original meaning of an Edit).
        keys: the key positions whose edges a ``knockout`` removes.
        rows: the batch rows the edit applies to (None: every row): one batched forward
            runs several edited copies of one input, an edit set per row.
        add: ``value`` is added to the slice instead of replacing it (the activation stays in
            the autograd graph: a zero value that requires grad reads the gradient there).
        expert: the routed expert whose write an ``expert`` edit changes.
    """

    block: int | None
    head: int | None = None
    positions: tuple[int, ...] | None = None
    value: torch.Tensor | None = None
    site: str | None = None
    keys: tuple[int, ...] | None = None
    rows: tuple[int, ...] | None = None
    add: bool = False
    expert: int | None = None

    def __post_init__(self):
        site = self.site if self.site is not None else ("z" if self.head is not None else "mlp")
        if site not in SITES:
            raise InterventionError(f"unknown edit site {site!r}; expected one of {', '.join(SITES)}")
        object.__setattr__(self, "site", site)
        object.__setattr__(self, "positions", _int_tuple(self.positions, "positions"))
        object.__setattr__(self, "keys", _int_tuple(self.keys, "knockout keys"))
        object.__setattr__(self, "rows", _int_tuple(self.rows, "batch rows"))
        if self.rows is not None and self.value is not None and self.value.ndim == 3:
            raise InterventionError("an edit of chosen batch rows takes one value (n_pos, width) for each")
        if site in BLOCK_SITES and self.block is None:
            raise InterventionError(f"a {site!r} edit needs a block index")
        if site in ("vision_out", "projector_out") and self.block is not None:
            raise InterventionError(f"{site!r} lies before the language model's blocks: pass block=None")
        if site == "z" and self.head is None:
            raise InterventionError("a 'z' edit needs a head")
        if (site == "expert") != (self.expert is not None):
            raise InterventionError("an 'expert' edit names its expert, and only an expert edit does")
        if self.expert is not None and self.expert < 0:
            raise InterventionError(f"expert {self.expert}: expected a non-negative index")
        if site not in ("z", "knockout") and self.head is not None:
            raise InterventionError(f"a {site!r} edit has no head (it changes the whole {site} vector)")
        if site == "knockout":
            if not self.keys:
                raise InterventionError("a knockout needs the key positions whose edges it removes")
            if self.value is not None:
                raise InterventionError("a knockout removes edges; it takes no value")
        elif self.keys is not None:
            raise InterventionError(f"keys only apply to a knockout, not to a {site!r} edit")
        if self.add and self.value is None:
            raise InterventionError("an added edit needs the value it adds")
        if self.value is not None:
            if not isinstance(self.value, torch.Tensor) or self.value.ndim not in (2, 3):
                raise InterventionError("an edit value is a tensor (n_pos, width) or (batch, n_pos, width)")
            if self.positions is not None and self.value.shape[-2] != len(self.positions):
                raise InterventionError(
                    f"the value has {self.value.shape[-2]} rows for {len(self.positions)} edited positions"
                )

    @property
    def kind(self) -> str:
        """ "zero", "replace" or "knockout"."""
        if self.site == "knockout":
            return "knockout"
        if self.add:
            return "add"
        return "zero" if self.value is None else "replace"

    def describe(self) -> str:
        where = "all positions" if self.positions is None else f"positions {list(self.positions)}"
        if self.site in ("z", "mixer", "expert") or (self.site == "mlp" and self.block is not None):
            what = {"mlp": "mlp", "mixer": "mixer", "expert": f"expert E{self.expert}"}.get(self.site, f"H{self.head}")
            how = "zeroed" if self.value is None else "added to" if self.add else "replaced"
            return f"block {self.block} {what} {how} at {where}"
        how = "zeroed" if self.value is None else "added to" if self.add else "replaced"
        if self.site == "resid":
            return f"residual entering block {self.block} {how} at {where}"
        if self.site == "knockout":
            heads = "every head" if self.head is None else f"H{self.head}"
            queries = "every query" if self.positions is None else f"queries {list(self.positions)}"
            return f"block {self.block} {heads}: edges {queries} -> keys {list(self.keys)} knocked out before softmax"
        tokens = "all visual tokens" if self.positions is None else f"visual tokens {list(self.positions)}"
        scope = (
            ""
            if self.site != "kv_source"
            else (" (every cross block)" if self.block is None else f" (block {self.block})")
        )
        return f"{self.site}{scope} {how} at {tokens}"

    def to_dict(self) -> dict:
        """JSON-ready description (the value's shape, not its numbers)."""
        return {
            "site": self.site,
            "block": self.block,
            "head": self.head,
            **({"expert": self.expert} if self.expert is not None else {}),
            "positions": None if self.positions is None else list(self.positions),
            "keys": None if self.keys is None else list(self.keys),
            "kind": self.kind,
            "value_shape": None if self.value is None else list(self.value.shape),
            **({"rows": list(self.rows)} if self.rows is not None else {}),
            "description": self.describe(),
        }

    def _check_range(self, n: int, what: str) -> None:
        if self.positions is not None and self.positions and max(self.positions) >= n:
            raise InterventionError(f"{self.describe()}: index {max(self.positions)} is out of range ({n} {what})")

    def apply(self, x: torch.Tensor, d_head: int | None = None) -> torch.Tensor:
        """A copy of ``x`` ``(batch, pos, width)`` with the edit applied: the
        head's slice ``[h * d_head, (h + 1) * d_head)`` of z, or the whole
        vector (MLP output, residual, visual features) at the edited rows."""
        if self.site == "knockout":
            raise InterventionError("a knockout edits attention scores: use Edit.knock")
        self._check_range(x.shape[1], "rows")
        x = x.clone()
        pos = slice(None) if self.positions is None else list(self.positions)
        if self.site == "z":
            if d_head is None:
                raise InterventionError("a head edit needs d_head")
            cols = slice(self.head * d_head, (self.head + 1) * d_head)
            width = d_head
        else:
            cols, width = slice(None), x.shape[-1]
        if self.value is not None and self.value.shape[-1] != width:
            raise InterventionError(f"{self.describe()}: value width {self.value.shape[-1]}, expected {width}")
        value = 0 if self.value is None else self.value.to(x.dtype).to(x.device)
        for row in self._rows(x.shape[0]):
            x[row, pos, cols] = x[row, pos, cols] + value if self.add else value
        return x

    def apply_part(self, out: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """A copy of the module output ``out (batch, pos, d_model)`` in which the part
        ``part`` of it (same shape: one expert's write) is taken out at the edited rows
        (zero ablation), replaced by ``value``, or has ``value`` added (``add``)."""
        self._check_range(out.shape[1], "rows")
        out = out.clone()
        pos = slice(None) if self.positions is None else list(self.positions)
        if self.value is not None and self.value.shape[-1] != out.shape[-1]:
            raise InterventionError(f"{self.describe()}: value width {self.value.shape[-1]}, expected {out.shape[-1]}")
        value = 0 if self.value is None else self.value.to(out.dtype).to(out.device)
        for row in self._rows(out.shape[0]):
            out[row, pos] = out[row, pos] + value if self.add else out[row, pos] - part[row, pos] + value
        return out

    def _rows(self, n: int) -> list:
        """The batch rows to edit, as indices of ``x[row]`` (every row at once: one slice)."""
        if self.rows is None:
            return [slice(None)]
        if max(self.rows) >= n:
            raise InterventionError(f"{self.describe()}: batch row {max(self.rows)} is out of range ({n} rows)")
        return list(self.rows)

    def knock(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores (batch, heads, n_query, n_keys)`` (scaled scores or an additive
        mask, before the softmax) with ``-inf`` at the knocked-out edges. A query
        row left with no finite entry (every key it may read removed) is refused."""
        if self.site != "knockout":
            raise InterventionError(f"{self.describe()} is not a knockout")
        b, n_heads, n_q, n_k = scores.shape
        self._check_range(n_q, "query positions")
        if max(self.keys) >= n_k:
            raise InterventionError(f"{self.describe()}: key {max(self.keys)} is out of range ({n_k} keys)")
        if self.head is not None and self.head >= n_heads:
            raise InterventionError(f"{self.describe()}: the block has {n_heads} heads")
        select = torch.zeros(n_heads, n_q, n_k, dtype=torch.bool, device=scores.device)
        heads = slice(None) if self.head is None else self.head
        queries = torch.arange(n_q) if self.positions is None else torch.tensor(self.positions)
        keys = torch.tensor(self.keys)
        if self.head is None:
            select[:, queries[:, None], keys[None, :]] = True
        else:
            select[heads, queries[:, None], keys[None, :]] = True
        out = scores.clone()
        for row in self._rows(b):
            out[row] = scores[row].masked_fill(select, float("-inf"))
        floor = torch.finfo(scores.dtype).min / 2
        was_alive = (scores > floor).any(-1)
        if bool((was_alive & ~(out > floor).any(-1)).any()):
            raise InterventionError(f"{self.describe()}: a query would have no key left to attend to")
        return out
