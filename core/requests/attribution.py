"""The attribution-patching request: the first-order estimate of every activation
patch of a clean / source pair, with its top components patched for real
(``vlm-readout attribution-patching``;
:func:`core.methods.flow.attribution.attribution_patching`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from core.requests.base import AskedRequest, Cancel, Progress, register_request

if TYPE_CHECKING:
    from PIL import Image

    from core.methods.flow.attribution import AttributionPatching


@register_request
@dataclass(frozen=True, kw_only=True, eq=False)
class AttributionPatchingRequest(AskedRequest):
    """Estimate every patch from ``source_image`` into the asked run; check the ``top_k``.

    Attributes:
        source_image: the other image's pixels (the same size), asked the same question.
        source_image_path: the file they were read from (None: pixels without a file).
        top_k: how many of the largest estimates are patched for real.
        batch_size: patched copies per forward.
    """

    name: ClassVar[str] = "attribution-patching"

    source_image: Image.Image
    source_image_path: str | None = None
    top_k: int = 20
    batch_size: int = 8

    def __post_init__(self) -> None:
        from core.errors import InterventionError

        if self.top_k < 1 or self.batch_size < 1:
            raise InterventionError("the top k and the batch size are at least 1")

    def parameters(self) -> dict[str, Any]:
        from core.files.images import image_sha256

        return {
            **self.asked_parameters(),
            "source_image": self.source_image_path,
            "source_image_sha256": image_sha256(self.source_image),
            "top_k": self.top_k,
        }

    def run(self, loaded, progress: Progress = None, cancel: Cancel = None) -> AttributionPatching:
        from core.methods.flow.attribution import attribution_patching

        tokens = self.tokens(loaded.adapter)
        return attribution_patching(
            loaded,
            self.image,
            self.source_image,
            self.question,
            answer_id=tokens["answer"],
            foil_id=tokens["foil"],
            top_k=self.top_k,
            answer_prefix=self.answer_prefix,
            batch_size=self.batch_size,
            progress=progress,
        )
