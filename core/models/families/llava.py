"""LLaVA 1.5 (transformers' LlavaForConditionalGeneration): a CLIP vision
tower, a projector, and a Llama-style decoder over interleaved tokens."""

from __future__ import annotations

import torch

from core.errors import QuestionError
from core.geometry import VisualToken, resize_crop_boxes
from core.models.adapter import Adapter, config_int, size_value
from core.models.families._decoder import LlamaStyleWeights


class LlavaAdapter(LlamaStyleWeights, Adapter):
    """Batches, weights, norms, hooks and RoPE from :class:`LlamaStyleWeights`;
    what is LLaVA's own: the fixed image token count, the projector's sites and
    the resize-crop geometry."""

    hf_architectures = ("LlavaForConditionalGeneration",)

    family = "llava"
    final_norm = "rmsnorm"
    attention_kind = "self"
    position_scheme = "rope"

    fallback_prompt = "USER: <image>\n{question} ASSISTANT:"
    edit_sites = ("z", "mlp", "resid", "knockout", "vision_out", "projector_out")

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        config_int(config, "image_seq_length")

    def check_fits(self, question: str, ids: list[int]) -> None:
        n_image = int(getattr(self.model.config, "image_seq_length", 0) or 0)
        total = len(self.tokenizer.encode(self.prompt(question))) + n_image
        limit = self.max_positions()
        if total > limit:
            raise QuestionError(f"the question is too long: {total} tokens with the image, the model takes {limit}")

    # ---- canonical weights (LlamaStyleWeights); the head size is family-specific
    @property
    def d_head(self) -> int:
        return getattr(self.text_config, "head_dim", None) or self.d_model // self.n_heads

    # ---- the vision side (interventions and the zoo's training reach it through here)
    @property
    def projector(self) -> torch.nn.Module:
        return self.model.model.multi_modal_projector

    def vision_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """``(batch, 3, H, W)`` pixels -> ``(batch, patches, vision width)``: the
        vision tower's last hidden state, CLS dropped."""
        return self.model.model.vision_tower(pixel_values=pixels).last_hidden_state[:, 1:]

    def project_visual(self, features: torch.Tensor) -> torch.Tensor:
        """``(batch, patches, vision width)`` -> ``(batch, patches, d_model)``: what the language model reads."""
        return self.projector(features)

    def visual_site_module(self, site: str):
        """``vision_out``: the projector's input, i.e. the vision tower's hidden
        state at ``vision_feature_layer`` with CLS dropped (the features the
        language side reads); ``projector_out``: the projector's output, the rows
        placed at the image-token positions."""
        if site == "vision_out":
            return self.projector, "pre"
        if site == "projector_out":
            return self.projector, "fwd"
        return super().visual_site_module(site)

    # ---- geometry
    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """The :class:`core.geometry.VisualToken` of every image token, boxes in
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
