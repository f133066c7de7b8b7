"""LLaVA 1.5 (transformers' LlavaForConditionalGeneration): a CLIP vision
tower, a projector, and a Llama-style decoder over interleaved tokens."""

from __future__ import annotations

import torch
from PIL import Image

from core.errors import QuestionError
from core.models.adapter import Adapter, ModelInputs
from core.models.registry import register


def _unknown_token_check(tokenizer, question: str, ids: list[int]) -> None:
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and unk in ids:
        from core.zoo.vocab import unknown_words

        words = unknown_words(tokenizer, question)
        raise QuestionError(f"the question uses words this model's vocabulary does not have: {', '.join(words) or '?'}")


@register(hf=("LlavaForConditionalGeneration",))
class LlavaAdapter(Adapter):
    family = "llava"
    final_norm = "rmsnorm"
    attention_kind = "self"
    position_scheme = "rope"

    @property
    def text_config(self):
        return self.model.config.text_config

    @property
    def n_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def n_heads(self) -> int:
        return self.text_config.num_attention_heads

    @property
    def d_model(self) -> int:
        return self.text_config.hidden_size

    def prompt(self, question: str) -> str:
        conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        if getattr(self.processor, "chat_template", None):
            return self.processor.apply_chat_template(conversation, add_generation_prompt=True)
        return f"USER: <image>\n{question} ASSISTANT:"

    def check_question(self, question: str) -> None:
        if not question.strip():
            raise QuestionError("the question is empty")
        ids = self.tokenizer.encode(question, add_special_tokens=False)
        _unknown_token_check(self.tokenizer, question, ids)
        n_image = int(getattr(self.model.config, "image_seq_length", 0) or 0)
        total = len(self.tokenizer.encode(self.prompt(question))) + n_image
        limit = int(getattr(self.text_config, "max_position_embeddings", 10**9))
        if total > limit:
            raise QuestionError(f"the question is too long: {total} tokens with the image, the model takes {limit}")

    def prepare(self, images: list[Image.Image], questions: list[str]) -> ModelInputs:
        for q in questions:
            self.check_question(q)
        prompts = [self.prompt(q) for q in questions]
        tok = self.processor.tokenizer
        old_side = tok.padding_side
        tok.padding_side = "right"  # the answer position is then the last real token
        try:
            batch = self.processor(images=images, text=prompts, padding=True, return_tensors="pt")
        finally:
            tok.padding_side = old_side
        device = self.device
        dtype = next(self.model.parameters()).dtype
        tensors = {k: v.to(device) for k, v in batch.items()}
        if "pixel_values" in tensors:
            tensors["pixel_values"] = tensors["pixel_values"].to(dtype)
        mask = tensors["attention_mask"]
        last = mask.sum(dim=1) - 1
        return ModelInputs(tensors, last, tensors["input_ids"], prompts)

    def forward_logits(self, inputs: ModelInputs) -> torch.Tensor:
        return self.model(**inputs.tensors).logits

    def append_token(self, inputs: ModelInputs, token_id: int) -> ModelInputs:
        t = dict(inputs.tensors)
        new = torch.tensor([[token_id]], device=t["input_ids"].device)
        t["input_ids"] = torch.cat([t["input_ids"], new], dim=1)
        t["attention_mask"] = torch.cat([t["attention_mask"], torch.ones_like(new)], dim=1)
        return ModelInputs(t, inputs.answer_positions + 1, t["input_ids"], inputs.prompts)
