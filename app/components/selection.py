"""The component last selected in any read-out view (no Qt).

The Attention, DLA and Lens views each select a component of the model; the
intervention controls ablate whichever was selected last. The name is the
engine's (:func:`core.methods.component_ablation.parse_component` reads it):

* Attention: a head, ``L2.H3`` (:func:`head_component`: the block's name as
  the trace names it, then the head);
* DLA: a component of the residual split as the panel names it (``L2.H3``,
  ``L2.mlp``, ``L0.xattn.H1``, ``embed``, ``bias...``);
* Lens: row ``l`` reads the residual entering block ``l``, which holds what the
  blocks before ``l`` wrote, so row ``l >= 1`` (and the "final" row) selects
  block ``l - 1``'s writes, ``L{l-1}`` (:func:`lens_component`); row 0 is the
  embedding.

A selection belongs to the read-out it was made in (the analyze result the
views showed). When the workspace shows a run with another read-out (a new
Read out, another input's run restored), the selection is kept but marked
stale: the views may still highlight it, and the intervention controls ask for
it to be selected again in the read-out shown. Nothing shown at all clears it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from app.components.events import Event
from app.components.workspace import ShownRun, Workspace

# the views that select a component, as their tabs name them
VIEW_TITLES = {"attention": "Attention", "dla": "DLA", "lens": "Lens"}
HEAD_NAME = re.compile(r"\.H\d+$")  # L1.H2, L0.xattn.H1 (not L1.mlp, embed, a whole block)


def is_head(name: str) -> bool:
    """Whether a component name names one attention head."""
    return bool(HEAD_NAME.search(name))


def block_order(readout) -> list[str]:
    """An analyze result's block names in block order (``[]`` for None)."""
    names = readout.block_names if readout is not None else {}
    return [names[i] for i in sorted(names)]


def head_component(block_names: Sequence[str], block: int, head: int) -> str:
    """``L2.H3``: head ``head`` of block ``block`` (an index into ``block_names``)."""
    return f"{block_names[block]}.H{int(head)}"


def lens_component(block_names: Sequence[str], layer: int) -> tuple[str, str]:
    """``(component, note)`` of lens row ``layer`` (0 .. n_blocks; n_blocks is "final"):
    the writes of the block before the residual it reads; row 0 reads the embedding."""
    layer = int(layer)
    if not 0 <= layer <= len(block_names):
        raise ValueError(f"lens row {layer}: the lens has rows 0..{len(block_names)}")
    if layer == 0:
        return "embed", f"lens row {block_names[0] if block_names else 0}: the embedding (before any block)"
    reads = block_names[layer] if layer < len(block_names) else "final"
    return block_names[layer - 1], f"lens row {reads}: the writes of {block_names[layer - 1]}"


@dataclass(frozen=True)
class SelectedComponent:
    """One selection: the engine's ``name`` of the component, the ``view`` it was selected
    in (a key of :data:`VIEW_TITLES`), the session's id of the read-out it was selected in
    (None: not recorded, or not shown yet), a ``note`` on what it means, and whether a run
    with another read-out is shown now (``stale``)."""

    name: str
    view: str
    run_id: int | None = None
    note: str = ""
    stale: bool = False

    def describe(self) -> str:
        """``L1.H2 (selected in DLA, run #4)``, with the stale note when it is."""
        where = VIEW_TITLES.get(self.view, self.view)
        run = f", run #{self.run_id}" if self.run_id is not None else ""
        text = f"{self.name} (selected in {where}{run})"
        if self.note:
            text += f"; {self.note}"
        if self.stale:
            text += "; stale: another read-out is shown, select it again there"
        return text


class Selection:
    """The component last selected in any view of ``workspace``'s shown read-out.

    Attributes:
        current: the :class:`SelectedComponent`, or None.
        changed: :class:`Event` ``changed(selected=SelectedComponent | None)`` after every change.
    """

    def __init__(self, workspace: Workspace):
        self.workspace = workspace
        self.current: SelectedComponent | None = None
        self.changed = Event("changed")
        self._readout = None  # the analyze result it was selected in (compared by identity)
        self._disconnect = workspace.events.run_shown.connect(self._on_run_shown)

    def select(self, name: str, view: str, readout, note: str = "") -> SelectedComponent:
        """``name`` was selected in ``view`` while ``readout`` (the analyze result drawn there) was shown."""
        if view not in VIEW_TITLES:
            raise ValueError(f"view {view!r}: expected one of {', '.join(VIEW_TITLES)}")
        self._readout = readout
        self._set(SelectedComponent(str(name), view, self._run_id(self.workspace.shown), note))
        return self.current

    def select_head(self, readout, block: int, head: int) -> SelectedComponent:
        """Head ``head`` of block ``block`` (an index into ``readout``'s blocks), clicked in Attention."""
        return self.select(head_component(block_order(readout), block, head), "attention", readout)

    def select_lens_row(self, readout, layer: int) -> SelectedComponent:
        """Lens row ``layer`` of ``readout``: the writes of the block before the residual it reads."""
        name, note = lens_component(block_order(readout), layer)
        return self.select(name, "lens", readout, note)

    def clear(self) -> None:
        """Nothing is selected."""
        self._readout = None
        if self.current is not None:
            self._set(None)

    def disconnect(self) -> None:
        """Stop following the workspace."""
        self._disconnect()

    def _run_id(self, run: ShownRun | None) -> int | None:
        """The id of the read-out run ``run`` holds when it is the selection's read-out, else None."""
        if run is None or self._readout is None or run.analysis is not self._readout:
            return None
        return run.id_of("analyze")

    def _set(self, selected: SelectedComponent | None) -> None:
        self.current = selected
        self.changed.emit(selected=selected)

    def _on_run_shown(self, run: ShownRun | None, kind: str | None) -> None:
        if self.current is None:
            return
        if run is None:  # nothing is shown: the read-out it was selected in is gone from every view
            self.clear()
            return
        if self._readout is not None and run.analysis is self._readout:
            # a follow-up of the same read-out (an ablation), or the read-out's run shown after it was drawn
            run_id = self._run_id(run)
            if run_id != self.current.run_id or self.current.stale:
                self._set(dataclasses.replace(self.current, run_id=run_id, stale=False))
            return
        if not self.current.stale:
            self._set(dataclasses.replace(self.current, stale=True))
