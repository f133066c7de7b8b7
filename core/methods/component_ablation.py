"""Ablating a component named as the read-outs name it.

The Attention view selects a head (``L2.H3``), the DLA view a component of the
residual split (``L2.H3``, ``L2.mlp``), the lens a layer (the residual entering
block l reads what blocks before l wrote; the lens row after block l selects
its writes, ``L2``). :func:`ablation_edits` turns such a name, an ablation kind
and a choice of positions into the :class:`core.forward.edits.Edit` s that
:func:`core.methods.interventions.run_interventions` runs:

* kinds: ``zero`` (the write removed), ``mean`` (replaced by its mean over
  reference runs at the same absolute position), ``resample`` (replaced by its
  value on one other input, read at the matching position);
* positions: ``target`` (the answer position read out), ``all`` (every real
  position), ``region`` (the sequence positions of a set of visual tokens,
  e.g. the painted region's).

docs/METHODS.md ("Ablation") states what each kind can and cannot support.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from core.errors import InterventionError
from core.forward.capture import Trace
from core.forward.edits import Edit
from core.methods.interventions import activation_patch, mean_ablation, reference_mean, zero_ablation

KINDS = ("zero", "mean", "resample")
POSITIONS = ("target", "all", "region")


@dataclass(frozen=True)
class Component:
    """A head (``head`` set), a block's MLP (``part="mlp"``), every head of a
    block (``part="attn"``) or all of a block's writes (``part="block"``: its
    heads and its MLP)."""

    name: str
    block: int
    part: str
    head: int | None = None

    def sites(self, n_heads: int) -> list[tuple[str, int | None]]:
        """``[(site, head)]`` of the activations this component writes through."""
        heads = [("z", h) for h in range(n_heads)]
        return {
            "head": [("z", self.head)],
            "mlp": [("mlp", None)],
            "attn": heads,
            "block": [*heads, ("mlp", None)],
        }[self.part]


def parse_component(name: str, block_names: Sequence[str]) -> Component:
    """The :class:`Component` of ``L2.H3``, ``L2.mlp``, ``L2.attn`` or ``L2``
    (block names as the trace has them: ``T0``, ``L1.xattn``, ...); one-line
    InterventionError for a name that is no ablatable write (``embed``, a bias, a
    stream write of the image such as Qwen3-VL's ``deepstack.L0``)."""
    name = name.strip()
    if name == "embed" or name.startswith(("bias.", "deepstack.")):
        raise InterventionError(
            f"{name}: not an activation a forward can ablate (a constant write); "
            "patch the residual entering a block instead"
        )
    blocks = {b: i for i, b in enumerate(block_names)}
    if name in blocks:
        return Component(name, blocks[name], "block")
    m = re.fullmatch(r"(.+)\.(H(\d+)|mlp|attn)", name)
    if m is None or m.group(1) not in blocks:
        raise InterventionError(f"{name!r} names no component of this model (blocks {', '.join(block_names)})")
    block, what = blocks[m.group(1)], m.group(2)
    if what == "mlp":
        return Component(name, block, "mlp")
    if what == "attn":
        return Component(name, block, "attn")
    return Component(name, block, "head", int(m.group(3)))


def parse_head(name: str, adapter) -> Component:
    """The head ``name`` (``L1.H3``, ``L1.xattn.H0``) of this model's blocks; a one-line
    InterventionError for a name that is no head (unknown block, ``L1.mlp``, an index
    past the model's heads)."""
    block_names = [block_name for block_name, _ in adapter.blocks]
    component = parse_component(name, block_names)
    if component.part != "head":
        raise InterventionError(f"{name!r} is not a head: name one as BLOCK.H<index>, e.g. {block_names[0]}.H0")
    if not 0 <= component.head < adapter.n_heads:
        raise InterventionError(f"{name!r}: this model's blocks have heads H0..H{adapter.n_heads - 1}")
    return component


def ablation_positions(base: Trace, positions: str, region_tokens: Sequence[int] = ()) -> list[int] | None:
    """The sequence positions of ``target`` / ``all`` (None: every position) /
    ``region`` (the visual tokens' positions in the text stream)."""
    if positions == "target":
        return [int(base.answer_positions[0])]
    if positions == "all":
        return None
    if positions == "region":
        if not region_tokens:
            raise InterventionError("the region covers no visual token: paint a region first")
        visual = base.visual_positions[0]
        if visual.numel() == 0:
            raise InterventionError(
                "this model reads the image through cross-attention: its visual tokens are no positions of "
                "the text stream (patch them at kv_source instead)"
            )
        return [int(visual[t]) for t in region_tokens]
    raise InterventionError(f"positions {positions!r}: expected one of {', '.join(POSITIONS)}")


def ablation_edits(
    adapter,
    base: Trace,
    component: Component,
    *,
    kind: str = "zero",
    positions: str = "target",
    region_tokens: Sequence[int] = (),
    references: Sequence[Trace] = (),
    source: Trace | None = None,
) -> list[Edit]:
    """The edits that ablate ``component`` in the run ``base``.

    Args:
        kind: ``zero``, ``mean`` (``references``: unedited captures of other
            inputs, averaged at each absolute position) or ``resample``
            (``source``: an unedited capture of one other input; at the target
            position its own answer position is read, else the same positions).
        positions: ``target``, ``all`` or ``region`` (``region_tokens``: visual token indices).
    """
    if kind not in KINDS:
        raise InterventionError(f"ablation {kind!r}: expected one of {', '.join(KINDS)}")
    if component.head is not None and not 0 <= component.head < adapter.n_heads:
        raise InterventionError(f"{component.name}: the model has heads 0..{adapter.n_heads - 1}")
    where = ablation_positions(base, positions, region_tokens)
    edits = []
    for site, head in component.sites(adapter.n_heads):
        if kind == "zero":
            edits.append(zero_ablation(component.block, head, where, site=site))
        elif kind == "mean":
            mean = reference_mean(adapter, list(references), component.block, head, site=site)
            edits.append(mean_ablation(adapter, base, mean, where))
        else:
            if source is None:
                raise InterventionError("resample ablation needs a capture of another input")
            source_where = [int(source.answer_positions[0])] if positions == "target" else where
            edits.append(
                activation_patch(source, site, component.block, head, where, source_positions=source_where, target=base)
            )
    return edits
