"""open_clip CoCa: a ViT vision tower, a causal text tower, and a
multimodal decoder whose cross-attention layers read the image tokens."""

from __future__ import annotations

import torch
from PIL import Image

from core.errors import QuestionError
from core.models.adapter import Adapter, ModelInputs
from core.models.families.llava import _unknown_token_check
from core.models.registry import register


@register(open_clip=("CoCa",))
class CocaAdapter(Adapter):
    """``processor`` is open_clip's image transform; ``tokenizer`` a Hugging
    Face tokenizer (the default models) or open_clip's tokenizer."""

    family = "coca"
    final_norm = "layernorm"
    attention_kind = "cross"
    position_scheme = "absolute"

    @property
    def decoder(self):
        return self.model.text_decoder

    @property
    def n_layers(self) -> int:
        return len(self.decoder.resblocks)

    @property
    def n_heads(self) -> int:
        return self.decoder.resblocks[0].attn.num_heads

    @property
    def d_model(self) -> int:
        return self.decoder.width

    @property
    def context_length(self) -> int:
        return int(self.model.text.positional_embedding.shape[0])

    def prompt(self, question: str) -> str:
        return self.config.get("prompt", "{question}").format(question=question)

    def _encode(self, text: str) -> list[int]:
        if hasattr(self.tokenizer, "encode") and hasattr(self.tokenizer, "get_vocab"):
            return list(self.tokenizer.encode(text))  # Hugging Face tokenizer, <s> included
        # open_clip tokenizer: [sot, ..., eot, pad...]; continue after the text, so drop eot/pad.
        ids = self.tokenizer([text])[0].tolist()
        eot = getattr(self.tokenizer, "eot_token_id", None)
        return ids[: ids.index(eot)] if eot in ids else [i for i in ids if i != 0]

    def check_question(self, question: str) -> None:
        if not question.strip():
            raise QuestionError("the question is empty")
        if hasattr(self.tokenizer, "get_vocab"):
            _unknown_token_check(self.tokenizer, question, self.tokenizer.encode(question, add_special_tokens=False))
        # The text tower appends a CLS token, so one position is reserved.
        n = len(self._encode(self.prompt(question)))
        if n + 1 > self.context_length:
            raise QuestionError(f"the question is too long: {n} tokens, the model takes {self.context_length - 1}")

    def token_str(self, token_id: int) -> str:
        if hasattr(self.tokenizer, "decode"):
            return self.tokenizer.decode([int(token_id)]).strip()
        return str(token_id)

    def prepare(self, images: list[Image.Image], questions: list[str]) -> ModelInputs:
        for q in questions:
            self.check_question(q)
        prompts = [self.prompt(q) for q in questions]
        encoded = [self._encode(p) for p in prompts]
        longest = max(len(e) for e in encoded)
        pad = getattr(self.model, "pad_id", 0)
        ids = torch.full((len(encoded), longest), pad, dtype=torch.long)
        for i, e in enumerate(encoded):
            ids[i, : len(e)] = torch.tensor(e)
        dtype = next(self.model.parameters()).dtype
        pixels = torch.stack([self.processor(im) for im in images]).to(self.device, dtype)
        last = torch.tensor([len(e) - 1 for e in encoded], device=self.device)
        ids = ids.to(self.device)
        return ModelInputs({"image": pixels, "text": ids}, last, ids, prompts)

    def forward_logits(self, inputs: ModelInputs) -> torch.Tensor:
        """Decoder logits for every text position, ``(batch, pos, vocab)``.
        Padding sits after the last real token, so causal attention keeps it
        out of every real position."""
        out = self.model(inputs.tensors["image"], inputs.tensors["text"], output_labels=False)
        return out["logits"]

    def append_token(self, inputs: ModelInputs, token_id: int) -> ModelInputs:
        text = inputs.tensors["text"]
        if text.shape[1] + 1 >= self.context_length:
            raise QuestionError(f"the text reached the model's context length ({self.context_length - 1} tokens)")
        new = torch.tensor([[token_id]], device=text.device)
        text = torch.cat([text, new], dim=1)
        return ModelInputs({**inputs.tensors, "text": text}, inputs.answer_positions + 1, text, inputs.prompts)
