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
        from core.images import load_image

        images = [load_image(im) for im in images]  # paths and arrays too; RGB, EXIF applied
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

    # ---- canonical weights
    @property
    def language_model(self):
        return self.model.model.language_model

    def _attn(self, layer: int):
        return self.language_model.layers[layer].self_attn

    @property
    def n_kv_heads(self) -> int:
        return self.text_config.num_key_value_heads

    @property
    def d_head(self) -> int:
        return getattr(self.text_config, "head_dim", None) or self.d_model // self.n_heads

    def _split_in(self, linear, n: int, expand: bool) -> torch.Tensor:
        """(n * d_head, d_model) weight -> (heads, d_model, d_head), groups expanded if ``expand``."""
        w = linear.weight.view(n, self.d_head, -1).transpose(1, 2)
        if expand and n != self.n_heads:
            w = w.repeat_interleave(self.n_heads // n, dim=0)
        return w

    def _split_bias(self, linear, n: int) -> torch.Tensor:
        if linear.bias is None:
            return torch.zeros(self.n_heads, self.d_head, dtype=linear.weight.dtype, device=linear.weight.device)
        b = linear.bias.view(n, self.d_head)
        return b.repeat_interleave(self.n_heads // n, dim=0) if n != self.n_heads else b

    def W_Q(self, layer: int) -> torch.Tensor:
        return self._split_in(self._attn(layer).q_proj, self.n_heads, False)

    def b_Q(self, layer: int) -> torch.Tensor:
        return self._split_bias(self._attn(layer).q_proj, self.n_heads)

    def W_K(self, layer: int) -> torch.Tensor:
        return self._split_in(self._attn(layer).k_proj, self.n_kv_heads, True)

    def b_K(self, layer: int) -> torch.Tensor:
        return self._split_bias(self._attn(layer).k_proj, self.n_kv_heads)

    def W_V(self, layer: int) -> torch.Tensor:
        return self._split_in(self._attn(layer).v_proj, self.n_kv_heads, True)

    def b_V(self, layer: int) -> torch.Tensor:
        return self._split_bias(self._attn(layer).v_proj, self.n_kv_heads)

    def W_O(self, layer: int) -> torch.Tensor:
        o = self._attn(layer).o_proj
        return o.weight.view(self.d_model, self.n_heads, self.d_head).permute(1, 2, 0)

    def b_O(self, layer: int) -> torch.Tensor:
        o = self._attn(layer).o_proj
        return o.bias if o.bias is not None else torch.zeros(self.d_model, dtype=o.weight.dtype, device=o.weight.device)

    @staticmethod
    def _norm(module):
        from core.models.norms import Norm

        return Norm("rmsnorm", module.weight, None, module.variance_epsilon, compute_dtype=torch.float32)

    def attn_norm(self, layer: int):
        return self._norm(self.language_model.layers[layer].input_layernorm)

    def final_norm_layer(self):
        return self._norm(self.language_model.norm)

    @property
    def W_U(self) -> torch.Tensor:
        return self.model.lm_head.weight.T

    @property
    def b_U(self) -> torch.Tensor:
        head = self.model.lm_head
        return head.bias if head.bias is not None else torch.zeros(head.weight.shape[0], dtype=head.weight.dtype)

    # ---- capture
    def visual_positions(self, inputs: ModelInputs) -> torch.Tensor:
        """``(batch, n_visual)`` positions of the image tokens in the sequence."""
        ids = inputs.input_ids
        mask = ids == self.model.config.image_token_id
        return torch.stack([row.nonzero().flatten() for row in mask])

    def capture_hooks(self, layer: int, trace, keep_pattern: bool) -> list:
        """Hooks that fill ``trace`` for block ``layer`` (see core.capture.Trace)."""
        block = self.language_model.layers[layer]
        attn = block.self_attn

        def resid_pre(module, args, kwargs):
            trace.resid_pre[layer] = args[0] if args else kwargs["hidden_states"]

        def z_in(module, args):
            x = args[0]
            trace.z[layer] = x.view(*x.shape[:-1], self.n_heads, self.d_head)

        def attn_out(module, args, out):
            trace.attn_out[layer] = out

        def mlp_out(module, args, out):
            trace.mlp_out[layer] = out

        def pattern(module, args, out):
            weights = out[1]
            if weights is None:
                raise RuntimeError("attention weights missing: the model is not running eager attention")
            trace.patterns[layer] = weights[:, :, trace.query_positions.to(weights.device)]

        regs = [
            (block, "pre_kw", resid_pre),
            (attn.o_proj, "pre", z_in),
            (attn.o_proj, "fwd", attn_out),
            (block.mlp, "fwd", mlp_out),
        ]
        if keep_pattern:
            regs.append((attn, "fwd", pattern))
        return regs

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
