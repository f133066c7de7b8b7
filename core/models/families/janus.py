"""Janus / Janus-Pro (transformers' ``JanusForConditionalGeneration``), the
UNDERSTANDING path only: a SigLIP vision tower (no CLS), an MLP aligner and a
Llama decoder over interleaved tokens.

The processor (``JanusImageProcessor``) resizes the image so that its longer
side is the tower's ``S = image_size`` px (the shorter ``max(round(side * S /
longer), min_size)``), pads it centred to ``S x S`` with the mean colour (the
odd pixel after) and the tower cuts that canvas into ``(S / patch)^2``
patches, row-major: one visual token per patch. Markup: ``<begin_of_image>``
+ ``<image_placeholder>`` x ``num_image_tokens`` + ``<end_of_image>``; the
two ends are delimiters, not patches.

The image-generation path (the VQ model, ``generation_embeddings`` /
``generation_aligner`` / ``generation_head``) never runs in a text forward:
nothing is read out of it, and a processor set to ``generation_mode="image"``
is overridden (every prompt is an understanding prompt).
"""

from __future__ import annotations

from core.errors import ModelLoadError, QuestionError
from core.forward.geometry import VisualToken
from core.models.adapter import config_value, size_value
from core.models.declaration import Family
from core.models.families.internvl import InternVLAdapter
from core.models.families.llava import LlavaAdapter


class JanusAdapter(LlavaAdapter):
    """LLaVA's Llama-style decoder; what is Janus's own: the aligner as projector,
    the letterbox geometry and the image delimiters (declared)."""

    declaration = Family(
        name="janus",
        architectures=("JanusForConditionalGeneration",),
        # What Janus-Pro's chat template renders for one user turn holding an image then the question.
        prompt="<|User|>: <image_placeholder>\n{question}\n\n<|Assistant|>:",
        projector="model.aligner",
        visual_sites=True,
        delimiters=("processor.image_start_token", "processor.image_end_token"),
    )

    @classmethod
    def check_config(cls, config) -> None:
        """Also what the geometry reads: a square tower image of whole patches
        giving ``num_image_tokens`` patches."""
        super().check_config(config)
        size, patch, n = (
            config_value(config, f"vision_config.{k}") for k in ("image_size", "patch_size", "num_image_tokens")
        )
        if not (
            isinstance(size, int)
            and isinstance(patch, int)
            and patch > 0
            and size % patch == 0
            and n == (size // patch) ** 2
        ):
            raise ModelLoadError(
                "config.json: Janus geometry is mapped for an integer vision_config image_size, a patch_size "
                f"dividing it and num_image_tokens = (image_size / patch_size)^2; got {size}, {patch}, {n}"
            )

    def processor_options(self, prompts: list[str]) -> dict:
        # JanusProcessor pads on the left by default; "image" mode would append <begin_of_image> (generation).
        return {**InternVLAdapter.processor_options(self, prompts), "generation_mode": "text"}

    def check_fits(self, question: str, ids: list[int]) -> None:
        # the prompt's one <image_placeholder> becomes <begin_of_image>, the image's tokens and <end_of_image>
        total = len(self.tokenizer.encode(self.prompt(question))) + 1 + self.processor.num_image_tokens
        if total > self.max_positions():
            raise QuestionError(
                f"the question is too long: {total} tokens with the image, the model takes {self.max_positions()}"
            )

    # ---- the vision side (the aligner's sites are declared)
    def vision_features(self, pixels):
        """``(batch, 3, S, S)`` -> ``(batch, patches, vision width)``: the tower's
        last hidden state after its post-layernorm (SigLIP: no CLS to drop)."""
        return self.model.model.vision_model(pixel_values=pixels).last_hidden_state

    # ---- geometry
    def letterbox(self, image_size: tuple[int, int]) -> tuple[int, tuple[int, int], tuple[int, int]]:
        """``(S, (resized width, height), (left, top) padding)`` as the processor
        resizes and pads an image of ``image_size = (width, height)``."""
        ip = self.processor.image_processor
        vision = self.model.config.vision_config
        side = int(vision.image_size)
        if (size_value(ip.size, "height"), size_value(ip.size, "width")) != (side, side) or not (
            ip.do_resize and ip.do_pad
        ):
            raise NotImplementedError(
                f"Janus geometry is mapped for processors resizing and padding to the tower's {side} px square: "
                f"size {dict(ip.size)}, do_resize {ip.do_resize}, do_pad {ip.do_pad}"
            )
        w, h = image_size
        scale = side / max(w, h)  # the processor's own arithmetic (its resize)
        rw, rh = max(round(w * scale), ip.min_size), max(round(h * scale), ip.min_size)
        square = max(rw, rh)
        return side, (rw, rh), ((square - rw) // 2, (square - rh) // 2)

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """The :class:`core.forward.geometry.VisualToken` of every ``<image_placeholder>``,
        row-major on the ``S / patch`` grid, boxes in the original image: the
        patch's canvas box minus the padding, scaled back through the resize.
        Patches over the padding get boxes (partly or wholly) outside the image."""
        side, (rw, rh), (left, top) = self.letterbox(image_size)
        patch = int(self.model.config.vision_config.patch_size)
        g = side // patch
        if positions is not None and len(positions) != g * g:
            raise ValueError(f"{len(positions)} visual positions for {g}x{g} patches")
        sx, sy = image_size[0] / rw, image_size[1] / rh
        out = []
        for i in range(g * g):
            r, c = divmod(i, g)
            box = [
                (c * patch - left) * sx,
                (r * patch - top) * sy,
                ((c + 1) * patch - left) * sx,
                ((r + 1) * patch - top) * sy,
            ]
            out.append(VisualToken(i, None if positions is None else int(positions[i]), 0, r, c, box))
        return out
