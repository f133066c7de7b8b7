"""Canonical weights shared by Llama-style decoders (q/k/v/o_proj, RMSNorm,
lm_head, RoPE): the language models of LLaVA, LLaVA-NeXT, Idefics3, Qwen2-VL,
PaliGemma and Mllama. Not a family: adapters mix it in and define ``d_head``."""

from __future__ import annotations

import torch

from core.attention_rows import WeightsRows
from core.capture import on_device_of, record_pattern
from core.errors import QuestionError
from core.models.adapter import config_int
from core.models.norms import Norm


def pattern_hook(trace, layer: int):
    """A forward hook on an eager attention module that gives block ``layer``'s
    weights ``(batch, heads, queries, keys)`` to :func:`core.capture.record_pattern`."""

    def pattern(module, args, out):
        weights = out[1]
        if weights is None:
            raise RuntimeError("attention weights missing: the model is not running eager attention")
        record_pattern(trace, layer, WeightsRows(weights))

    return pattern


class TextConfigSizes:
    """The sizes of a decoder described by the model config's ``text_config``."""

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


class LlamaStyleWeights(TextConfigSizes):
    """Per-head W_Q/W_K/W_V/W_O (grouped K/V expanded), norms, unembedding
    and capture hooks of ``self.model.model.language_model`` (decoder layers
    with ``self_attn.o_proj`` and ``mlp``) and ``self.model.lm_head``."""

    # ---- prompts and batches through the model's own Hugging Face processor
    fallback_prompt: str = "{question}"  # used when the processor has no chat template
    forward_options = {"use_cache": False}  # one full run: no key / value cache

    @classmethod
    def check_config(cls, config) -> None:
        """The image token id (the model finds its image by it) and the length
        limit the adapter reads must be integers."""
        super().check_config(config)
        config_int(config, "image_token_id", required=True)
        text = "text_config." if getattr(config, "text_config", None) is not None else ""
        config_int(config, f"{text}max_position_embeddings", minimum=1)

    def max_positions(self) -> int:
        """The decoder's position limit (10**9 when the config sets none)."""
        return int(getattr(self.text_config, "max_position_embeddings", None) or 10**9)

    def check_fits(self, question: str, ids: list[int]) -> None:
        """QuestionError for a prompt whose own tokens cannot fit the decoder;
        where the image's token count follows its size, :meth:`prepare` checks
        the real total (:meth:`Adapter.batch_inputs`)."""
        total = len(self.tokenizer.encode(self.prompt(question), add_special_tokens=False))
        if total > self.max_positions():
            raise QuestionError(f"the question is too long: {total} tokens, the model takes {self.max_positions()}")

    @property
    def prompt_field(self) -> str:
        return "chat_template" if getattr(self.processor, "chat_template", None) else f"{self.family} fallback prompt"

    def prompt(self, question: str) -> str:
        """The processor's chat template rendered for one user turn holding the
        image then the question, with the generation prompt; the family's
        :attr:`fallback_prompt` when the processor has no template.
        QuestionError naming ``chat_template`` if the template does not render."""
        conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        if getattr(self.processor, "chat_template", None):
            try:
                return self.processor.apply_chat_template(conversation, add_generation_prompt=True)
            except Exception as e:  # the template is data from the model folder: any Jinja error or raise
                first = (str(e).splitlines() or [""])[0][:300]
                raise QuestionError(f"chat_template: cannot render the prompt ({type(e).__name__}: {first})") from None
        return self.fallback_prompt.format(question=question)

    @property
    def language_model(self):
        return self.model.model.language_model

    @property
    def lm_head(self) -> torch.nn.Module:
        """The unembedding module (``W_U`` / ``b_U`` are its weight and bias)."""
        return self.model.lm_head

    def _attn(self, layer: int):
        return self.language_model.layers[layer].self_attn

    def sliding_window(self, block: int) -> int | None:
        """The attention module's own ``sliding_window`` where transformers sets it per
        layer (None on full layers: Qwen2, Cohere 2, Gemma 3), else the text config's
        (Mistral), unless its ``layer_types`` call the layer full attention."""
        attn = self._attn(block)
        if hasattr(attn, "sliding_window"):
            window = attn.sliding_window
        else:
            types = getattr(self.text_config, "layer_types", None)
            full = types is not None and types[block] != "sliding_attention"
            window = None if full else getattr(self.text_config, "sliding_window", None)
        return None if window is None else int(window)

    def attention_module(self, block: int):
        return self._attn(block)

    def z_module(self, block: int):
        return self._attn(block).o_proj

    def mlp_module(self, block: int):
        return self.language_model.layers[block].mlp

    def layer_module(self, block: int):
        return self.language_model.layers[block]

    def score_scale(self, block: int) -> float:
        return float(self._attn(block).scaling)

    @property
    def n_kv_heads(self) -> int:
        return self.text_config.num_key_value_heads

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

        return Norm("rmsnorm", module.weight, None, module.variance_epsilon, compute_dtype=torch.float32)

    def attn_norm(self, layer: int):
        return self._norm(self.language_model.layers[layer].input_layernorm)

    def final_norm_layer(self):
        return self._norm(self.language_model.norm)

    @property
    def W_U(self) -> torch.Tensor:
        return self.lm_head.weight.T

    @property
    def b_U(self) -> torch.Tensor:
        head = self.lm_head
        return (
            head.bias
            if head.bias is not None
            else torch.zeros(head.weight.shape[0], dtype=head.weight.dtype, device=head.weight.device)
        )

    def capture_hooks(self, layer: int, trace, keep_pattern: bool) -> list:
        """Hooks that fill ``trace`` for block ``layer`` (see core.capture.Trace)."""
        block = self.language_model.layers[layer]
        attn = block.self_attn

        def resid_pre(module, args, kwargs):
            trace.resid_pre[layer] = on_device_of(block, args[0] if args else kwargs["hidden_states"])

        def z_in(module, args):
            x = args[0]
            trace.z[layer] = x.view(*x.shape[:-1], self.n_heads, self.d_head)

        def attn_out(module, args, out):
            trace.attn_out[layer] = out

        def mlp_out(module, args, out):
            trace.mlp_out[layer] = out

        regs = [
            (block, "pre_kw", resid_pre),
            (attn.o_proj, "pre", z_in),
            (block.mlp, "fwd", mlp_out),
        ]
        if trace.keep_attn_out:
            regs.append((attn.o_proj, "fwd", attn_out))
        if keep_pattern:
            regs.append((attn, "fwd", pattern_hook(trace, layer)))
        return regs

    def final_hooks(self, trace) -> list:
        def final(module, args):
            trace.final_resid = on_device_of(module, args[0])

        return [(self.language_model.norm, "pre", final)]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply RoPE to queries or keys ``(..., pos, heads, d_head)`` at
        ``positions (pos,)`` with the decoder's own rotary embedding."""
        from transformers.models.llama.modeling_llama import rotate_half

        cos, sin = self.language_model.rotary_emb(x, positions.to(x.device).view(1, -1))
        cos, sin = cos[0].to(x).unsqueeze(-2), sin[0].to(x).unsqueeze(-2)  # (pos, 1, d_head), on x's device
        return x * cos + rotate_half(x) * sin
