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
    block (``part="attn"``), all of a block's writes (``part="block"``: its
    heads and its MLP), a hybrid block's token mixer without heads (``part="mixer"``:
    ``L0.linear_attn``) or one routed expert of a mixture-of-experts MLP
    (``part="expert"``, ``expert`` set: ``L1.E3``)."""

    name: str
    block: int
    part: str
    head: int | None = None
    expert: int | None = None
    mixer: bool = False  # the block's first write is a token mixer without heads

    def sites(self, n_heads: int) -> list[tuple[str, int | None]]:
        """``[(site, head)]`` of the activations this component writes through."""
        first = [("mixer", None)] if self.mixer else [("z", h) for h in range(n_heads)]
        return {
            "head": [("z", self.head)],
            "mlp": [("mlp", None)],
            "attn": first,
            "mixer": [("mixer", None)],
            "expert": [("expert", None)],
            "block": [*first, ("mlp", None)],
        }[self.part]


def mixer_modules(adapter) -> dict[int, str]:
    """``{block: its mixer's module name}`` of the blocks without attention (hybrid decoders)."""
    return {b: adapter.mixer(b).module for b in range(len(adapter.blocks)) if adapter.mixer(b) is not None}


def parse_component(name: str, block_names: Sequence[str], mixers: dict[int, str] | None = None) -> Component:
    """The :class:`Component` of ``L2.H3``, ``L2.mlp``, ``L2.attn``, ``L2``, a mixer
    ``L0.linear_attn`` or an expert ``L1.E3`` (block names as the trace has them:
    ``T0``, ``L1.xattn``, ...). ``mixers``: :func:`mixer_modules` of the model (None:
    not known where the name is checked, so a block's lower-case part is taken for its
    mixer and the run checks it). One-line InterventionError for a name that is no
    ablatable write (``embed``, a bias, a residue, a stream write of the image such
    as Qwen3-VL's ``deepstack.L0``, a head of a block that has none)."""
    name = name.strip()
    if name == "embed" or name.startswith(("bias.", "deepstack.")) or name.endswith("_residue"):
        raise InterventionError(
            f"{name}: not an activation a forward can ablate (a constant write or a rounding residue); "
            "patch the residual entering a block instead"
        )
    blocks = {b: i for i, b in enumerate(block_names)}
    known = mixers or {}
    if name in blocks:
        return Component(name, blocks[name], "block", mixer=blocks[name] in known)
    m = re.fullmatch(r"(.+)\.(H(\d+)|E(\d+)|mlp|attn|[a-z_]+)", name)
    if m is None or m.group(1) not in blocks:
        raise InterventionError(f"{name!r} names no component of this model (blocks {', '.join(block_names)})")
    block, what = blocks[m.group(1)], m.group(2)
    if what == "mlp":
        return Component(name, block, "mlp", mixer=block in known)
    if what == "attn":
        return Component(name, block, "attn", mixer=block in known)
    if m.group(4) is not None:
        return Component(name, block, "expert", expert=int(m.group(4)), mixer=block in known)
    if m.group(3) is not None:
        if block in known:
            raise InterventionError(f"{name!r}: block {m.group(1)} has no heads (its token mixer is {known[block]})")
        return Component(name, block, "head", int(m.group(3)))
    if mixers is not None and known.get(block) != what:
        raise InterventionError(f"{name!r} names no component of this model (blocks {', '.join(block_names)})")
    return Component(name, block, "mixer", mixer=True)


def parse_head(name: str, adapter) -> Component:
    """The head ``name`` (``L1.H3``, ``L1.xattn.H0``) of this model's blocks; a one-line
    InterventionError for a name that is no head (unknown block, ``L1.mlp``, an index
    past the model's heads)."""
    block_names = [block_name for block_name, _ in adapter.blocks]
    component = parse_component(name, block_names, mixer_modules(adapter))
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
    if component.part == "expert" and kind != "zero":
        raise InterventionError(
            f"{component.name}: an expert's write is ablated by zeroing it (its mean or another input's value is "
            "not recorded: it is recomputed from the MLP's input)"
        )
    for site, head in component.sites(adapter.n_heads):
        if site == "expert":
            edits.append(Edit(component.block, None, where, site="expert", expert=component.expert))
        elif kind == "zero":
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
