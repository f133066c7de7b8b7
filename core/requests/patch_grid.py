"""The patch-grid request: copy one activation from the run of a source image into
the run of the asked image at every layer x position group (``vlm-readout
patch-grid``; :func:`core.methods.flow.patch_grid.patch_grid`).

The answer is the asked one (default: the clean run's top token), the foil the
asked one (default: the source run's top token), read at the answer token read
out (``answer_text``: teacher forcing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from core.requests.base import AskedRequest, Cancel, Progress, register_request

if TYPE_CHECKING:
    from PIL import Image

    from core.methods.flow.patch_grid import PatchGrid

# core.methods.flow.patch_grid's SITES, GROUPS and EACH (not imported: it loads torch)
PATCH_GRID_SITES = ("resid", "attn", "mlp", "head")
POSITION_GROUPS = ("image", "region", "question", "answer")
EVERY_POSITION = "each"
# the counterfactual fills a source can be made with (core.methods.counterfactual.FILLS less paste: that is a source image)
SOURCE_FILLS = ("mean", "constant", "blur", "noise", "inpaint")


@register_request
@dataclass(frozen=True, kw_only=True, eq=False)  # eq: the mask is an array
class PatchGridRequest(AskedRequest):
    """Patch ``site`` from ``source_image`` at every layer x column.

    Attributes:
        source_image: the other image's pixels (the same size), asked the same question; None with
            ``source_fill``: the asked image with its painted region filled.
        source_fill: a counterfactual fill (mean, constant, blur, noise, inpaint) of the painted
            region that makes the source (None: ``source_image``).
        source_image_path: the file they were read from (None: pixels without a file).
        site: ``resid``, ``attn``, ``mlp`` or ``head``.
        head: the head of site ``head``.
        columns: position groups (``image``, ``region``, ``question``, ``answer``, ``text``,
            ``last``, ``word:W``), or ``("each",)``: every position.
        mask: ``(H, W)`` bool, the painted region (the ``region`` group).
        batch_size: patched copies per forward.
    """

    name: ClassVar[str] = "patch-grid"

    source_image: Image.Image | None = None
    source_image_path: str | None = None
    source_fill: str | None = None
    site: str = "resid"
    head: int | None = None
    columns: tuple[str, ...] = POSITION_GROUPS
    mask: Any = None
    batch_size: int = 8

    def __post_init__(self) -> None:
        from core.errors import InterventionError
        from core.methods.flow.positions import REGION, check_set_name

        if (self.source_image is None) == (self.source_fill is None):
            raise InterventionError("the source is another image or a fill of the painted region: one of them")
        if self.source_fill is not None and self.mask is None:
            raise InterventionError(f"the {self.source_fill!r} fill of the source needs a painted region (a mask)")
        if self.source_fill is not None and self.source_fill not in SOURCE_FILLS:
            raise InterventionError(f"source fill {self.source_fill!r}: expected one of {', '.join(SOURCE_FILLS)}")
        if self.site not in PATCH_GRID_SITES:
            raise InterventionError(f"patch site {self.site!r}: expected one of {', '.join(PATCH_GRID_SITES)}")
        if (self.site == "head") != (self.head is not None):
            raise InterventionError("a head is patched with site 'head', and only that site takes one")
        columns = tuple(c.strip() for c in self.columns if c.strip())
        if not columns:
            raise InterventionError("name at least one position group")
        if columns != (EVERY_POSITION,):
            for c in columns:
                check_set_name(c)
        if len(set(columns)) != len(columns):
            raise InterventionError(f"a position group is named twice: {', '.join(columns)}")
        if self.mask is None and REGION in columns and columns != POSITION_GROUPS:  # the default leaves it out
            raise InterventionError("the region group needs a painted region (a mask)")
        if self.batch_size < 1:
            raise InterventionError("the batch size is at least 1")
        object.__setattr__(self, "columns", columns)

    def parameters(self) -> dict[str, Any]:
        from core.files.images import image_sha256

        source = (
            {"source_fill": self.source_fill}
            if self.source_fill is not None
            else {"source_image": self.source_image_path, "source_image_sha256": image_sha256(self.source_image)}
        )
        return {
            **self.asked_parameters(),
            **source,
            "site": self.site,
            "head": self.head,
            "columns": list(self.columns),
        }

    def source(self):
        """The source image: the one given, or the asked image with the painted region filled."""
        if self.source_fill is None:
            return self.source_image
        from PIL import Image

        from core.methods.counterfactual import fill_region

        return Image.fromarray(fill_region(self.image, self.mask, self.source_fill))

    def run(self, loaded, progress: Progress = None, cancel: Cancel = None) -> PatchGrid:
        from core.forward.geometry import painted_tokens
        from core.methods.flow.patch_grid import patch_grid

        adapter = loaded.adapter
        tokens = self.tokens(adapter)
        region = painted_tokens(adapter.visual_tokens(self.image.size), self.mask) if self.mask is not None else ()
        return patch_grid(
            loaded,
            self.image,
            self.source(),
            self.question,
            site=self.site,
            head=self.head,
            columns=EVERY_POSITION if self.columns == (EVERY_POSITION,) else self.columns,
            answer_id=tokens["answer"],
            foil_id=tokens["foil"],
            region=region,
            answer_prefix=self.answer_prefix,
            batch_size=self.batch_size,
            progress=progress,
            cancel=cancel,
        )
