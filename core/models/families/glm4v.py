"""GLM-4.1V / GLM-4V (transformers' ``Glm4vForConditionalGeneration``): a
native-resolution ViT whose 2x2 neighbouring patches are merged (a strided
conv) into one visual token, and a GLM-4 decoder over interleaved tokens.

Qwen2-VL's conventions carry over (:class:`Qwen2VLAdapter`): the processor's
batches (``mm_token_type_ids``, ``image_grid_thw``), the 3-D position ids
``(t, start + row, start + col)`` of the merged-token grid (text resumes at
``start + max(rows, cols)``), recorded as ``trace.position_ids``, and the
row-major token geometry. What is GLM's own:

* **RoPE.** Only the first ``partial_rotary_factor * d_head`` coordinates of a
  head rotate, in *interleaved* pairs ``(2i, 2i + 1)``; frequency ``i`` turns
  with the temporal, height or width id by contiguous ``mrope_section`` blocks.
  The decoder's rotary module builds cos / sin; the declared rotation
  (``partial``, GLM's ``rotate_half_llm``) applies them as the model does (the
  rest of the head passes unrotated).
* **Sandwich norms.** A layer adds ``post_self_attn_layernorm(o_proj(z))`` and
  ``post_mlp_layernorm(mlp(post_attention_layernorm(x)))`` (GLM's
  ``post_attention_layernorm`` is the MLP's *input* norm). The sandwich split
  of :class:`~core.models.family_adapter.FamilyAdapter` applies: a head's component is its write under the
  post-attention norm's scale frozen at the block's o_proj output ``a``; the
  float32 norm's rounding is ``L{l}.attn_norm_residue``; ``mlp_out`` (and the
  "mlp" edit site) is the MLP's write, after its post-norm.
* **Resize.** GLM's smart_resize (an image counts as ``temporal_patch_size``
  frames against the pixel bounds; images smaller than a cell are scaled up).

Masks are causal with padding keys dropped (the base's rule). Videos are not mapped.
"""

from __future__ import annotations

from dataclasses import replace

from core.errors import ImageLoadError
from core.models.declaration import Decoder, Rotary
from core.models.families.qwen2_vl import Qwen2VLAdapter

# GLM-4.1V's chat template for one user turn holding an image then the question.
GLM_PROMPT = "[gMASK]<sop><|user|>\n<|begin_of_image|><|image|><|end_of_image|>{question}<|assistant|>\n"


class Glm4vAdapter(Qwen2VLAdapter):
    """Qwen2-VL's batches, positions and geometry; GLM's partial interleaved RoPE
    and sandwich norms (declared), and its resize."""

    declaration = replace(
        Qwen2VLAdapter.declaration,
        name="glm4v",
        architectures=("Glm4vForConditionalGeneration",),
        prompt=GLM_PROMPT,
        decoder=Decoder(form="sandwich", sandwich=("post_self_attn_layernorm", "post_mlp_layernorm")),
        rotary=Rotary("mrope", rotate_half="transformers.models.glm4v.modeling_glm4v.rotate_half_llm", partial=True),
    )
    token_id_fields = (
        ("image_token_id", True),
        ("video_token_id", False),
        ("image_start_token_id", False),
        ("image_end_token_id", False),
    )

    # ---- geometry: GLM's smart_resize
    def visual_grid(self, image_size: tuple[int, int]) -> tuple[int, int, int, int]:
        """``(rows, cols, resized_height, resized_width)`` as GLM's processor resizes
        ``image_size = (width, height)``: multiples of ``patch_size * merge_size``, the
        image counted as ``temporal_patch_size`` frames against size.shortest_edge /
        size.longest_edge (min / max pixels)."""
        from transformers.models.glm4v.image_processing_glm4v import smart_resize

        ip = self.processor.image_processor
        patch, merge, frames = int(ip.patch_size), int(ip.merge_size), int(ip.temporal_patch_size)
        vision = self.model.config.vision_config
        if (patch, merge, frames) != (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size):
            raise ValueError(
                f"processor (patch {patch}, merge {merge}, frames {frames}) and vision tower (patch "
                f"{vision.patch_size}, merge {vision.spatial_merge_size}, frames {vision.temporal_patch_size}) disagree"
            )
        cell = patch * merge
        w, h = image_size
        rh, rw = h, w
        if getattr(ip, "do_resize", True):
            bounds = {"min_pixels": self._image_size_setting("shortest_edge")}
            bounds["max_pixels"] = self._image_size_setting("longest_edge")
            try:
                rh, rw = smart_resize(frames, h, w, temporal_factor=frames, factor=cell, **bounds)
            except ValueError as e:  # an aspect ratio of 200 or more
                raise ImageLoadError(f"this model's processor cannot resize the {w}x{h} image ({e})") from None
        return rh // cell, rw // cell, rh, rw
