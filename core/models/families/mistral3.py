"""Mistral 3 (transformers' ``Mistral3ForConditionalGeneration``): a Pixtral
vision tower at variable resolution, an RMSNorm + 2x2 patch merger + MLP
projector, and a Mistral decoder (Llama-style; RoPE, grouped-query K/V, an
optional sliding window) over interleaved tokens.

The processor resizes an image of ``(w, h)`` px so that it fits
``size["longest_edge"]`` (only down, aspect kept, floored), then stretches it
up to whole ``cell = patch_size * spatial_merge_size`` multiples (no crop, no
pad), so a visual token covers one ``cell x cell`` block (``merge x merge``
patches merged) of that ``(rh, rw)`` image: ``[c*cell*w/rw, r*cell*h/rh, ...]``
in the original. The markup is row-major::

    [IMG]*cols [IMG_BREAK] ... [IMG]*cols [IMG_END]      (rows lines)

``[IMG_BREAK]`` / ``[IMG_END]`` are text tokens with their own embeddings,
no patch: declared delimiters, never visual tokens.

The Pixtral tower has its own 2-D RoPE and a block-diagonal mask between
images; nothing of it is read out (patterns, heads and DLA are the language
model's). The projector runs on the patches of every image flattened (no
batch axis) and merges them, so no per-token visual-feature edit site is
mapped (``vision_out`` / ``projector_out`` are refused, as are
``vision_features`` / ``project_visual``)."""

from __future__ import annotations

from core.errors import ImageLoadError, UnsupportedArchitectureError
from core.forward.geometry import stretched_grid_tokens
from core.models.adapter import config_int
from core.models.declaration import Family
from core.models.family_adapter import FamilyAdapter


class Mistral3Adapter(FamilyAdapter):
    """The canonical view of a Mistral 3 model (see the module docstring): a
    Llama-style decoder as declared (the sliding window read from the config);
    its own the merged-token geometry."""

    declaration = Family(
        name="mistral3",
        architectures=("Mistral3ForConditionalGeneration",),
        prompt="<s>[INST][IMG]{question}[/INST]",
        delimiters=("processor.image_break_token", "processor.image_end_token"),
        no_visual_sites="the projector merges the patches of every image flattened together "
        "(no per-token batch layout to edit)",
    )

    @classmethod
    def check_config(cls, config) -> None:
        """A Mistral decoder only (Ministral 3 scales its queries by position, which
        the canonical q does not hold); the sizes the geometry and the mask read."""
        super().check_config(config)
        text_type = getattr(getattr(config, "text_config", None), "model_type", None)
        if text_type != "mistral":
            raise UnsupportedArchitectureError(
                f"config.json text_config.model_type: {text_type!r} is not mapped for Mistral3 (only 'mistral')"
            )
        config_int(config, "spatial_merge_size", minimum=1, required=True)
        config_int(config, "vision_config.patch_size", minimum=1, required=True)
        config_int(config, "text_config.sliding_window", minimum=1)  # sliding_window (the mask) reads it

    # ---- geometry
    def resized_size(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """``(height, width)`` the processor resizes an image of ``image_size = (width,
        height)`` to (transformers' own ``get_resize_output_image_size``: down into
        ``size.longest_edge``, then up to whole ``patch_size * spatial_merge_size`` cells)."""
        import numpy as np
        from transformers.image_utils import ChannelDimension
        from transformers.models.pixtral.image_processing_pixtral import get_resize_output_image_size

        proc = self.processor
        patch, merge = int(self.model.config.vision_config.patch_size), int(self.model.config.spatial_merge_size)
        if (int(proc.patch_size), int(proc.spatial_merge_size)) != (patch, merge):
            raise ValueError(
                f"processor (patch {proc.patch_size}, merge {proc.spatial_merge_size}) and model "
                f"(patch {patch}, merge {merge}) disagree"
            )
        longest = self._image_size_setting("longest_edge")
        if longest is None:
            raise NotImplementedError("Mistral3 geometry is mapped for processors with size.longest_edge")
        w, h = image_size
        dummy = np.broadcast_to(np.uint8(0), (h, w, 1))  # only its shape is read
        cell = (patch * merge,) * 2
        rh, rw = get_resize_output_image_size(dummy, (longest, longest), cell, ChannelDimension.LAST)
        if rh == 0 or rw == 0:
            raise ImageLoadError(f"this model's processor resizes the {w}x{h} image to {rw}x{rh} pixels")
        return rh, rw

    def visual_grid(self, image_size: tuple[int, int]) -> tuple[int, int, int, int]:
        """``(rows, cols, resized_height, resized_width)``: the merged-token grid of an
        image of ``image_size = (width, height)`` and the size it is resized to."""
        ip = self.processor.image_processor
        if not getattr(ip, "do_resize", True) or getattr(ip, "do_center_crop", False):
            raise NotImplementedError("Mistral3 geometry is mapped for the longest-edge resize without a crop")
        rh, rw = self.resized_size(image_size)
        cell = int(self.model.config.vision_config.patch_size) * int(self.model.config.spatial_merge_size)
        return rh // cell, rw // cell, rh, rw

    def resized_pixels(self, image_size: tuple[int, int]) -> tuple[int, str] | None:
        """The resized image's pixels (only down to ``size.longest_edge``, then up to whole cells)."""
        if not getattr(self.processor.image_processor, "do_resize", True):
            return None
        rh, rw = self.resized_size(image_size)
        return rh * rw, f"size.longest_edge = {self._image_size_setting('longest_edge')}"

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """The :class:`core.forward.geometry.VisualToken` of every ``[IMG]`` token, row-major,
        boxes in the original image: one merged ``cell x cell`` block of the resized image."""
        rows, cols, rh, rw = self.visual_grid(image_size)
        return stretched_grid_tokens(image_size, (rw, rh), (rows, cols), rh // rows, positions)  # rh is whole cells
