"""The fill requests: fill a painted region and re-run (:class:`CounterfactualRequest`,
:func:`core.methods.counterfactual.region_counterfactual`), or fill every k x k block of
patches in turn (:class:`SweepRequest`, :func:`core.methods.counterfactual.occlusion_sweep`);
``vlm-readout counterfactual [--sweep K]`` and the Counterfactual tab."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from core.requests.base import AskedRequest, Cancel, Progress, register_request

if TYPE_CHECKING:
    from PIL import Image

    from core.methods.counterfactual import Fill, OcclusionMap, RegionCounterfactual


@dataclass(frozen=True, kw_only=True, eq=False)  # eq: a paste source is pixels
class FillRequest(AskedRequest):
    """What both fill requests share: how a region is filled.

    Attributes:
        fill: ``mean``, ``constant``, ``blur``, ``noise``, ``inpaint`` or ``paste``
            (:data:`core.methods.counterfactual.FILLS`).
        color, radius, seed: the constant fill's RGB, the blur's sigma in pixels, the noise's
            seed (None: :class:`core.methods.counterfactual.Fill`'s default).
        paste_from: the paste fill's source pixels (resized to the image's size).
        paste_from_path: the file ``paste_from`` was read from (None: pixels without a file).
    """

    fill: str = "mean"
    color: tuple[int, int, int] | None = None
    radius: float | None = None
    seed: int | None = None
    paste_from: Image.Image | None = None
    paste_from_path: str | None = None

    def fill_spec(self) -> Fill:
        """The :class:`core.methods.counterfactual.Fill` asked (its checks: one line each)."""
        from core.methods.counterfactual import Fill

        options = {"color": self.color, "radius": self.radius, "seed": self.seed, "paste_from": self.paste_from}
        return Fill(self.fill, **{k: v for k, v in options.items() if v is not None})

    def header(self, loaded) -> dict[str, Any]:
        """The model and the input, which the counterfactual JSON has always carried beside the
        method's result (:meth:`document`)."""
        from core.files.images import image_sha256

        mask_name = getattr(self, "mask_name", None)
        return {
            "model": {
                "spec": loaded.spec,
                "fingerprint": getattr(loaded, "fingerprint", None),
                **loaded.adapter.describe(),
            },
            "input": {
                "question": self.question,
                "image": None if self.image_path is None else str(self.image_path),
                "image_sha256": image_sha256(self.image),
                "image_size": list(self.image.size),
                "mask": None if mask_name is None else str(mask_name),
                "paste_from": None if self.paste_from_path is None else str(self.paste_from_path),
                **(self.answer_text.to_dict() if self.answer_text is not None else {}),
                **loaded.adapter.dtype_and_device(),
            },
        }

    def document(self, result, loaded) -> dict[str, Any]:
        return {**result.to_dict(), **self.header(loaded)}

    def fill_parameters(self) -> dict[str, Any]:
        """The fill as asked: its kind, the options given, the paste source's file. (The
        result records the fill it ran with as ``fill`` and ``fill_parameters``.)"""
        options = {"color": None if self.color is None else list(self.color), "radius": self.radius, "seed": self.seed}
        return {
            "fill": self.fill,
            "fill_options": {k: v for k, v in options.items() if v is not None},
            "paste_from": self.paste_from_path,
        }


@register_request
@dataclass(frozen=True, kw_only=True, eq=False)  # eq: the mask is an array
class CounterfactualRequest(FillRequest):
    """Fill ``mask`` ``(H, W)`` bool (white = the region, the image's size) and re-run the
    model; with ``routing``, the region's routing read-outs from one capture of the original.
    ``mask_name``: where the mask came from (its file; None: painted)."""

    name: ClassVar[str] = "counterfactual"

    mask: Any
    mask_name: str | None = None
    routing: bool = True

    def parameters(self) -> dict[str, Any]:
        return {**self.asked_parameters(), **self.fill_parameters(), "mask": self.mask_name, "routing": self.routing}

    def run(self, loaded, progress: Progress = None, cancel: Cancel = None) -> RegionCounterfactual:
        """:func:`core.methods.counterfactual.region_counterfactual` (one batch of two and
        one capture: nothing to cancel between)."""
        from core.methods.counterfactual import region_counterfactual

        if progress is not None:
            progress(0, 0, f"counterfactual ({self.fill} fill)…")
        return region_counterfactual(
            loaded,
            self.image,
            self.question,
            self.mask,
            self.fill_spec(),
            **self.tokens(loaded.adapter),
            routing=self.routing,
            answer_prefix=self.answer_prefix,
        )


@register_request
@dataclass(frozen=True, kw_only=True, eq=False)  # eq: a paste source is pixels
class SweepRequest(FillRequest):
    """Fill every ``k`` x ``k`` block of patches in turn, ``batch_size`` edited images a forward;
    ``interpolated``: the JSON also holds a bilinear upsampled map (flagged: visual smoothing,
    not a causal pixel mask)."""

    name: ClassVar[str] = "sweep"

    k: int = 1
    batch_size: int = 16
    interpolated: bool = False

    def parameters(self) -> dict[str, Any]:
        return {
            **self.asked_parameters(),
            **self.fill_parameters(),
            "k": self.k,
            "batch_size": self.batch_size,
            "interpolated": self.interpolated,
        }

    def document(self, result, loaded) -> dict[str, Any]:
        """The map (with the flagged bilinear one when ``interpolated``) and the header."""
        return {**result.to_dict(interpolated=self.interpolated), **self.header(loaded)}

    def run(self, loaded, progress: Progress = None, cancel: Cancel = None) -> OcclusionMap:
        """:func:`core.methods.counterfactual.occlusion_sweep`, cancellable between batches
        (the cells not run are NaN, ``complete`` False)."""
        from core.methods.counterfactual import occlusion_sweep

        return occlusion_sweep(
            loaded,
            self.image,
            self.question,
            k=self.k,
            fill=self.fill_spec(),
            **self.tokens(loaded.adapter),
            batch_size=self.batch_size,
            progress=progress,
            cancel=cancel,
            answer_prefix=self.answer_prefix,
        )
