"""The patching request: copy visual-token features from another image into the
run and back (``vlm-readout patch``, the Interventions box's Patch), at one
visual-feature site (:func:`core.methods.interventions.patch_visual_features`):
the painted region's tokens, or every visual token.

Which sites a family can patch (:func:`patch_sites`) and the one a patch uses
when none is chosen (:func:`default_patch_site`) live here, beside the request
that resolves them: the app's site box lists the same ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from core.requests.base import AskedRequest, Cancel, Progress, register_request

if TYPE_CHECKING:
    from PIL import Image

    from core.methods.interventions import VisualPatchResult

# the visual-feature sites a patch can copy (core.methods.interventions.patch_visual_features), in forward order
PATCH_SITES = ("vision_out", "projector_out", "resid", "kv_source")
# the site a patch uses when none is chosen: the earliest the language side reads
DEFAULT_PATCH_SITES = ("projector_out", "kv_source", "resid")
# the token set of a patch without a painted region, and of one with it
ALL_VISUAL_TOKENS, PAINTED_REGION = "all visual tokens", "painted region"


def patch_sites(adapter) -> list[str]:
    """The visual-feature sites this family can patch: its ``edit_sites`` among :data:`PATCH_SITES`,
    without ``resid`` for a cross-attention family (its visual tokens are not in the text stream)."""
    return [
        s for s in PATCH_SITES if s in adapter.edit_sites and not (s == "resid" and adapter.attention_kind == "cross")
    ]


def default_patch_site(sites: Sequence[str]) -> str | None:
    """The site a patch uses when none is chosen: the first of :data:`DEFAULT_PATCH_SITES` in ``sites``."""
    return next((s for s in DEFAULT_PATCH_SITES if s in sites), None)


@register_request
@dataclass(frozen=True, kw_only=True, eq=False)  # eq: the mask is an array
class PatchingRequest(AskedRequest):
    """Patch the asked image's visual-token features from ``source_image`` and back.

    Attributes:
        source_image: the other image's pixels, asked the same question.
        source_image_path: the file they were read from (None: pixels without a file).
        mask: ``(H, W)`` bool, the painted region whose visual tokens are patched (None: every visual token).
        site: ``vision_out``, ``projector_out``, ``resid`` or ``kv_source`` (None: :func:`default_patch_site`).
        layer: ``resid``: the block whose entering residual is patched (None: 0); ``kv_source``:
            one cross block (None: every one).
    """

    name: ClassVar[str] = "patching"

    source_image: Image.Image
    source_image_path: str | None = None
    mask: Any = None
    site: str | None = None
    layer: int | None = None

    def __post_init__(self) -> None:
        from core.errors import InterventionError

        if self.site is not None and self.site not in PATCH_SITES:
            raise InterventionError(f"site {self.site!r}: expected one of {', '.join(PATCH_SITES)}")

    def parameters(self) -> dict[str, Any]:
        """The input and the source image (its path, its SHA-256). The site, layer and token
        sets the patch ran with are the result's parameters (the site resolved for the family)."""
        from core.files.images import image_sha256

        return {
            **self.asked_parameters(),
            "source_image": self.source_image_path,
            "source_image_sha256": image_sha256(self.source_image),
        }

    def resolved_site(self, adapter) -> tuple[str, int | None]:
        """``(site, layer)`` the patch runs at on this model; a one-line InterventionError for a
        site the family lacks (naming the ones it has)."""
        from core.errors import InterventionError

        sites = patch_sites(adapter)
        site = self.site if self.site is not None else default_patch_site(sites)
        if site is None:
            raise InterventionError(f"{adapter.family}: no visual-feature site to patch")
        if site not in sites:
            raise InterventionError(
                f"{adapter.family}: no {site!r} site to patch (it has {', '.join(sites) or 'none'})"
            )
        return site, 0 if site == "resid" and self.layer is None else self.layer

    def run(self, loaded, progress: Progress = None, cancel: Cancel = None) -> VisualPatchResult:
        """Forward (the source's features into this run) and reverse, each token set cancellable."""
        from core.errors import InterventionError
        from core.forward.geometry import painted_tokens
        from core.methods.interventions import patch_visual_features

        adapter = loaded.adapter
        site, layer = self.resolved_site(adapter)
        tokens = adapter.visual_tokens(self.image.size)
        if self.mask is None:
            token_sets = {ALL_VISUAL_TOKENS: list(range(len(tokens)))}
        else:
            region = painted_tokens(tokens, self.mask)
            if not region:
                raise InterventionError("the painted region covers no visual token")
            token_sets = {PAINTED_REGION: region}
        return patch_visual_features(
            loaded,
            self.image,
            self.question,
            self.source_image,
            site=site,
            layer=layer,
            token_sets=token_sets,
            source_image_path=self.source_image_path,
            answer_prefix=self.answer_prefix,
            progress=progress,
            cancel=cancel,
            **self.tokens(adapter),
        )
