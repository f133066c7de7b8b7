"""Which view of the image the canvas draws (see :mod:`core.views`).

A choice is a view's ``image`` (that view alone) or :data:`ALL_VIEWS`: every
view laid out on the original image, finest on top (each pixel shows the finest
view that covers it; the views' boxes are in original-image pixels, so this is
geometry, not an image warp). :class:`ViewSelector` is the combo box that lists them.
"""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtWidgets import QComboBox

from core.views import ImageView, covered_area, overlay_order

ALL_VIEWS = "all"
ALL_VIEWS_TEXT = "all views (finest on top)"
SELECTOR_TIP = (
    "which view of the image the grid and the heatmap show: one view the model sees, "
    "or all of them laid out on the image (where views overlap, the finest is drawn); "
    "the dashed orange outline is the region each shown view covers"
)


def view_choices(views: Sequence[ImageView]) -> list[tuple[int | str, str]]:
    """``[(choice, text)]``: each view, then "all views" when there are several."""
    out: list[tuple[int | str, str]] = [(v.image, v.title) for v in views]
    if len(views) > 1:
        out.append((ALL_VIEWS, ALL_VIEWS_TEXT))
    return out


def default_choice(views: Sequence[ImageView], primary: int | None) -> int | str | None:
    """The primary view (the whole-image view, as the read-outs' ``visual_patch_mass``),
    unless the views together cover more of the image than it does (Mllama's tiles):
    then all views. None without views."""
    if not views:
        return None
    view = next((v for v in views if v.image == primary), views[0])
    if len(views) > 1:
        alone, together = covered_area([view.region]), covered_area([v.region for v in views])
        if together > alone * (1 + 1e-9) + 1e-9:
            return ALL_VIEWS
    return view.image


def shown_views(views: Sequence[ImageView], choice: int | str | None) -> list[ImageView]:
    """The views a choice draws, in draw-layer order (finest first for all views)."""
    if choice == ALL_VIEWS:
        return overlay_order(views)
    return [v for v in views if v.image == choice]


class ViewSelector(QComboBox):
    """The view combo box: one entry per :func:`view_choices`, the choice as its data.
    Hidden while there is one view or none (nothing to choose)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setToolTip(SELECTOR_TIP)
        self.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.setMinimumContentsLength(12)  # long view names elide in the box, not widen the canvas
        self.hide()

    def set_choices(self, views: Sequence[ImageView], current: int | str | None) -> None:
        """List ``views`` with ``current`` selected, without emitting a change (the
        entries are rebuilt only when they change: this runs inside the box's own signal)."""
        self.blockSignals(True)
        entries = view_choices(views)
        if entries != [(self.itemData(i), self.itemText(i)) for i in range(self.count())]:
            self.clear()
            for choice, text in entries:
                self.addItem(text, choice)
        index = self.findData(current)
        self.setCurrentIndex(index if index >= 0 else 0)
        self.blockSignals(False)
        self.setVisible(self.count() > 1)

    def choices(self) -> list[int | str]:
        return [self.itemData(i) for i in range(self.count())]
