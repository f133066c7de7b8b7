"""Qwen2-VL and Qwen2.5-VL (transformers' ``Qwen2VLForConditionalGeneration``
and ``Qwen2_5_VLForConditionalGeneration``): a native-resolution ViT whose
2x2 neighbouring patches are merged into one visual token, and a Qwen2
decoder (q/k/v biases, grouped-query K/V, RMSNorm) over interleaved tokens
with multimodal rotary position embedding (M-RoPE).

Both families share the decoder and the processor; they differ only inside
the vision tower (Qwen2.5-VL runs windowed attention on a window-reordered
patch sequence, and puts the merged tokens back in row-major order after its
merger), so one adapter serves both; :class:`Qwen2_5_VLAdapter` only renames
the family.

M-RoPE: every token has three position ids (temporal, height, width). Text
tokens carry the same id on all three axes; the visual tokens of one image
carry ``(start, start + row, start + col)`` on the merged-token grid, and the
text after the image resumes at ``start + max(rows, cols)``. The head's
``d_head / 2`` rotary frequencies are split into ``mrope_section`` blocks
that rotate with the temporal, height and width id respectively. So
:meth:`Qwen2VLAdapter.rotate` takes ``positions`` of shape ``(3, pos)`` (the
model's own position ids for one batch row), not the ``(pos,)`` of plain
RoPE; a capture records them as ``trace.position_ids`` ``(3, batch, pos)``
and ``positions_for_inputs`` (the generic adapter's, for M-RoPE) recomputes them from prepared
inputs.
"""

from __future__ import annotations

from dataclasses import replace

from core.errors import ImageLoadError
from core.forward.geometry import stretched_grid_tokens
from core.models.declaration import Family, Rotary
from core.models.family_adapter import FamilyAdapter

# What Qwen's own chat template renders for one user turn holding an image
# then the question, with the generation prompt (used when the processor has
# no chat template).
QWEN_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


class Qwen2VLAdapter(FamilyAdapter):
    """The canonical view of a Qwen2-VL model (see the module docstring): a
    Llama-style decoder (q/k/v biases) rotated by M-RoPE, whose positions
    ``(3, batch, pos)`` the capture records as ``trace.position_ids``. The number
    of visual tokens depends on the image size (the processor resizes to
    multiples of ``patch_size * merge_size`` within ``[min_pixels, max_pixels]``),
    so :meth:`visual_tokens` needs the image size and a batch of differently
    sized images has ragged visual positions."""

    declaration = Family(
        name="qwen2_vl",
        architectures=("Qwen2VLForConditionalGeneration",),
        prompt=QWEN_PROMPT,
        rotary=Rotary("mrope", rotate_half="transformers.models.qwen2_vl.modeling_qwen2_vl.rotate_half"),
        edit_sites=("z", "mlp", "knockout"),
    )

    # ---- running: prepare (the base's, FamilyAdapter's check_fits) gives one
    # right-padded batch, one image per question: ``input_ids``, ``attention_mask``,
    # ``mm_token_type_ids`` (0 text, 1 image; append_token extends it with 0),
    # ``pixel_values`` ``(n_patches_total, C * T * P * P)`` in the model's dtype and
    # ``image_grid_thw`` ``(n_images, 3)`` in patches; the model recomputes the
    # M-RoPE positions of an appended token (the next text position); a cached
    # decoding step gets them from FamilyAdapter.positions_for_inputs.
    # ---- geometry
    def visual_grid(self, image_size: tuple[int, int]) -> tuple[int, int, int, int]:
        """``(rows, cols, resized_height, resized_width)``: the merged-token grid
        and the size the processor resizes an image of ``image_size = (width,
        height)`` to (smart_resize: multiples of ``patch_size * merge_size``
        with the pixel count within ``[min_pixels, max_pixels]``)."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        ip = self.processor.image_processor
        patch = int(ip.patch_size)
        merge = int(ip.merge_size)
        vision = self.model.config.vision_config
        if patch != vision.patch_size or merge != vision.spatial_merge_size:
            raise ValueError(
                f"processor (patch {patch}, merge {merge}) and vision tower "
                f"(patch {vision.patch_size}, merge {vision.spatial_merge_size}) disagree"
            )
        cell = patch * merge
        w, h = image_size
        if getattr(ip, "do_resize", True):
            # Qwen's processor keeps min_pixels / max_pixels in size.shortest_edge / size.longest_edge
            min_pixels = self._image_size_setting("shortest_edge") or self._image_size_setting("min_pixels")
            max_pixels = self._image_size_setting("longest_edge") or self._image_size_setting("max_pixels")
            try:
                rh, rw = smart_resize(h, w, factor=cell, min_pixels=min_pixels, max_pixels=max_pixels)
            except ValueError as e:  # an aspect ratio of 200 or more, or pixel bounds that contradict
                raise ImageLoadError(f"this model's processor cannot resize the {w}x{h} image ({e})") from None
        else:
            rh, rw = h, w
        return rh // cell, rw // cell, rh, rw

    def resized_pixels(self, image_size: tuple[int, int]) -> tuple[int, str] | None:
        """smart_resize's pixel count (its bound is size.longest_edge, Qwen's max_pixels)."""
        _, _, rh, rw = self.visual_grid(image_size)
        return rh * rw, f"smart_resize with size.longest_edge (max_pixels) = {self._image_size_setting('longest_edge')}"

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """The :class:`core.forward.geometry.VisualToken` of every image token, boxes in
        the original image (``image_size = (width, height)``).

        A token is one merged ``merge_size x merge_size`` block of
        ``patch_size`` px patches of the resized image; ``row``/``col`` index
        the merged-token grid, in the row-major order in which the tokens enter
        the decoder (Qwen2.5-VL's window reordering is undone by its vision
        tower before the tokens leave it). The resize (no crop, no pad) is
        undone by scaling each axis by original / resized size.
        """
        rows, cols, rh, rw = self.visual_grid(image_size)
        cell = int(self.processor.image_processor.patch_size) * int(self.processor.image_processor.merge_size)
        return stretched_grid_tokens(image_size, (rw, rh), (rows, cols), cell, positions)


class Qwen2_5_VLAdapter(Qwen2VLAdapter):
    """Qwen2.5-VL: the same decoder, processor and token order as Qwen2-VL
    (the windowed vision tower restores row-major order after its merger)."""

    declaration = replace(
        Qwen2VLAdapter.declaration, name="qwen2_5_vl", architectures=("Qwen2_5_VLForConditionalGeneration",)
    )
