"""LLaVA 1.5 (transformers' LlavaForConditionalGeneration): a CLIP vision
tower, a projector, and a Llama-style decoder over interleaved tokens."""

from __future__ import annotations

import torch
from PIL import Image

from core.errors import QuestionError
from core.models.adapter import Adapter, ModelInputs, config_int
from core.models.families._decoder import LlamaStyleWeights
from core.models.registry import register


@register(hf=("LlavaForConditionalGeneration",))
class LlavaAdapter(LlamaStyleWeights, Adapter):
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
        limit = self._max_positions()
        if total > limit:
            raise QuestionError(f"the question is too long: {total} tokens with the image, the model takes {limit}")

    def prepare(self, images: list[Image.Image], questions: list[str], *, raw_prompt: bool = False) -> ModelInputs:
        return self._batch_inputs(*self._processed_batch(images, questions, raw_prompt))

    def forward_logits(self, inputs: ModelInputs) -> torch.Tensor:
        return self.model(**inputs.tensors).logits

    def append_token(self, inputs: ModelInputs, token_id: int) -> ModelInputs:
        t = dict(inputs.tensors)
        new = torch.tensor([[token_id]], device=t["input_ids"].device)
        t["input_ids"] = torch.cat([t["input_ids"], new], dim=1)
        t["attention_mask"] = torch.cat([t["attention_mask"], torch.ones_like(new)], dim=1)
        return ModelInputs(t, inputs.answer_positions + 1, t["input_ids"], inputs.prompts)

    # ---- canonical weights (LlamaStyleWeights); the head size is family-specific
    @property
    def d_head(self) -> int:
        return getattr(self.text_config, "head_dim", None) or self.d_model // self.n_heads

    # ---- capture
    def visual_positions(self, inputs: ModelInputs) -> torch.Tensor:
        """``(batch, n_visual)`` positions of the image tokens in the sequence."""
        ids = inputs.input_ids
        mask = ids == self.model.config.image_token_id
        return torch.stack([row.nonzero().flatten() for row in mask])

    def visual_site_module(self, site: str):
        """``vision_out``: the projector's input, i.e. the vision tower's hidden
        state at ``vision_feature_layer`` with CLS dropped (the features the
        language side reads); ``projector_out``: the projector's output, the rows
        placed at the image-token positions."""
        projector = self.model.model.multi_modal_projector
        if site == "vision_out":
            return projector, "pre"
        if site == "projector_out":
            return projector, "fwd"
        return super().visual_site_module(site)

    def final_hooks(self, trace) -> list:
        def final(module, args):
            trace.final_resid = args[0]

        return [(self.language_model.norm, "pre", final)]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply RoPE to queries or keys ``(..., pos, heads, d_head)`` at ``positions (pos,)``."""
        from transformers.models.llama.modeling_llama import rotate_half

        cos, sin = self.language_model.rotary_emb(x, positions.view(1, -1))
        cos, sin = cos[0].to(x.dtype).unsqueeze(-2), sin[0].to(x.dtype).unsqueeze(-2)  # (pos, 1, d_head)
        return x * cos + rotate_half(x) * sin

    # ---- geometry
    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """The :class:`core.geometry.VisualToken` of every image token, boxes in
        the original image (``image_size = (width, height)``)."""
        from core.geometry import VisualToken, resize_crop_boxes

        ip = self.processor.image_processor
        size = ip.size
        shortest = size.get("shortest_edge") if hasattr(size, "get") else size["shortest_edge"]
        crop = (ip.crop_size["height"], ip.crop_size["width"]) if ip.do_center_crop else None
        if shortest is None or crop is None:
            raise NotImplementedError("LLaVA geometry is mapped for resize-shortest-edge + centre-crop processors")
        patch = self.model.config.vision_config.patch_size
        boxes = resize_crop_boxes(image_size, shortest, crop, patch)
        return [
            VisualToken(i, None if positions is None else int(positions[i]), 0, r, c, box)
            for i, (r, c, box) in enumerate(boxes)
        ]
