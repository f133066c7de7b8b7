"""LLaVA 1.5 (transformers' LlavaForConditionalGeneration): a CLIP vision
tower, a projector, and a Llama-style decoder over interleaved tokens."""

from __future__ import annotations

import torch

from core.errors import QuestionError
from core.forward.geometry import VisualToken, resize_crop_boxes
from core.models.adapter import config_int, size_value
from core.models.config_check import check_image_seq_length
from core.models.declaration import Family
from core.models.family_adapter import FamilyAdapter


class LlavaAdapter(FamilyAdapter):
    """A Llama-style decoder as declared (the defaults); what is LLaVA's own:
    the fixed image token count, the vision features and the resize-crop geometry."""

    declaration = Family(
        name="llava",
        architectures=("LlavaForConditionalGeneration",),
        prompt="USER: <image>\n{question} ASSISTANT:",
        visual_sites=True,
    )

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        config_int(config, "image_seq_length")
        check_image_seq_length(config)  # the image tokens the length check counts: what the tower gives

    def check_fits(self, question: str, ids: list[int]) -> None:
        n_image = int(getattr(self.model.config, "image_seq_length", 0) or 0)
        total = len(self.tokenizer.encode(self.prompt(question))) + n_image
        limit = self.max_positions()
        if total > limit:
            raise QuestionError(f"the question is too long: {total} tokens with the image, the model takes {limit}")

    # ---- the vision side (interventions and the zoo's training reach it through here)
    def vision_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """``(batch, 3, H, W)`` pixels -> ``(batch, patches, vision width)``: what the
        projector reads, as the model selects it: the tower's hidden state at
        ``vision_feature_layer`` (several layers concatenated where it lists them),
        CLS dropped under the ``default`` select strategy."""
        config = self.model.config
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        out = self.model.model.vision_tower(pixel_values=pixels, output_hidden_states=True)
        x = torch.cat([out.hidden_states[layer] for layer in layers], dim=-1)
        return x[:, 1:] if config.vision_feature_select_strategy == "default" else x

    # ---- geometry
    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """The :class:`core.forward.geometry.VisualToken` of every image token, boxes in
        the original image (``image_size = (width, height)``)."""

        ip = self.processor.image_processor
        shortest = size_value(ip.size, "shortest_edge")
        crop = (ip.crop_size["height"], ip.crop_size["width"]) if ip.do_center_crop else None
        if shortest is None or crop is None:
            raise NotImplementedError("LLaVA geometry is mapped for resize-shortest-edge + centre-crop processors")
        patch = self.model.config.vision_config.patch_size
        boxes = resize_crop_boxes(image_size, shortest, crop, patch)
        return [
            VisualToken(i, None if positions is None else int(positions[i]), 0, r, c, box)
            for i, (r, c, box) in enumerate(boxes)
        ]
