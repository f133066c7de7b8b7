"""A tiny random float64 Qwen3.5 (``Qwen3_5ForConditionalGeneration``), built
offline from transformers' own config and model classes, with a real
``Qwen3VLProcessor`` (the processor transformers maps ``qwen3_5`` to) over a
word-level tokenizer with Qwen3.5's special tokens.

The decoder is hybrid: layer_types [linear, full, linear, full] (Gated DeltaNet
linear attention, then gated full attention with partial interleaved M-RoPE).
No flash-linear-attention / causal-conv1d kernels: the torch fallbacks run.
Every norm gain is randomised (the decoder's RMSNorms are ``x * (1 + w)`` with w
initialised to 0; the gated norm's and the vision LayerNorms' gains start at 1),
and so are dt_bias and (slower) the decays A, so that no computation is vacuous."""

import json

import torch

SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
    "<unk>",
)
WORDS = "system you are a helpful assistant . user is there red blue circle square ? what color shape yes no of the"
# Qwen3.5's chat template, reduced to text and image items (no system turn, no thinking block).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = "is there a red circle?"
PATCH, MERGE = 16, 2
CELL = PATCH * MERGE
MIN_PIXELS, MAX_PIXELS = CELL * CELL * 4, CELL * CELL * 16
IMAGE_SIZE = (200, 150)  # non-square: 6 x 8 patches of 16 px after the resize, 3 x 4 visual tokens
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
HEAD_DIM = 32
PARTIAL_ROTARY = 0.25  # as the released checkpoints: the first 8 of 32 dims of each head rotate
MROPE_SECTION = [2, 1, 1]  # temporal, height, width frequencies of the 4 = 32 * 0.25 / 2 rotary frequencies


def tiny_tokenizer():
    """Qwen3.5's own tokenizer class (``Qwen3_5Tokenizer``: byte-level BPE with its
    pre-tokenizer) over a vocabulary trained here, offline, on WORDS: each word, with
    and without its leading space, is one token; the special tokens take ids 0..9 in
    SPECIAL's order. A folder it is saved to loads back as the same tokenizer (the
    class transformers maps qwen3_5 to rebuilds a BPE from the saved vocabulary and merges)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    shape = Qwen3_5Tokenizer(vocab={"<|endoftext|>": 0}, merges=[])  # its pre-tokenizer, to train under
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = shape._tokenizer.pre_tokenizer
    bpe.normalizer = shape._tokenizer.normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = WORDS.split()
    bpe.train_from_iterator([" ".join(words), *words, *(f" {w}" for w in words), "\n", "\n\n"], trainer)
    trained = json.loads(bpe.to_str())["model"]
    vocab, merges = trained["vocab"], [tuple(m) for m in trained["merges"]]
    tok = Qwen3_5Tokenizer(
        vocab=vocab, merges=merges, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    named = ("<|im_end|>", "<|endoftext|>", "<unk>")
    tok.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL if t not in named]})
    tok.padding_side = "left"  # an adapter must switch to right padding itself
    return tok


def tiny_processor():
    """Qwen3-VL's processor (transformers maps qwen3_5 to it) with 16 px patches merged 2 x 2."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(
        patch_size=PATCH,
        merge_size=MERGE,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    return Qwen3VLProcessor(
        image_processor=image_processor,
        video_processor=Qwen3VLVideoProcessor(),
        tokenizer=tiny_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    )


# Qwen3.5-MoE's sparse MLPs (every layer): 4 experts, top 2, and a sigmoid-gated shared expert.
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 32}


def tiny_config(tie: bool = False, moe: bool = False):
    """The tiny Qwen3.5 config; ``moe``: Qwen3.5-MoE's (the same decoder with MOE's sparse MLPs)."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    ids = {t: i for i, t in enumerate(SPECIAL)}
    text = {
        "vocab_size": len(tiny_tokenizer()),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": len(LAYER_TYPES),
        "layer_types": LAYER_TYPES,
        # full attention: 4 query heads over 2 key/value heads, d_head 32
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        # linear attention: 2 key heads each serving 2 of 4 value heads (as the released 16 / 32)
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": PARTIAL_ROTARY,
            "mrope_section": MROPE_SECTION,
            "mrope_interleaved": True,
        },
        "pad_token_id": ids["<|endoftext|>"],
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "out_hidden_size": 64,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "num_position_embeddings": 16,
    }
    if moe:
        text.update(MOE)
    config = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie,
    )
    config.architectures = [(Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration).__name__]
    return config


@torch.no_grad()
def _randomise_gains(model) -> None:
    """The init sets the decoder's RMSNorm offsets w to 0 (gain 1 + w = 1), the
    gated norm's gain and the vision LayerNorms' gains to 1, dt_bias to 1: make them count;
    and slow the linear-attention decays so that the recurrence remembers."""
    lm = model.model.language_model
    for layer in lm.layers:
        layer.input_layernorm.weight.normal_(0, 0.3)
        layer.post_attention_layernorm.weight.normal_(0, 0.3)
        if layer.block_type == "linear_attention":
            layer.linear_attn.norm.weight.normal_(1, 0.3)
            layer.linear_attn.dt_bias.normal_(1, 0.5)
            # A in [0.05, 0.5] (init: [0.01, 16]): per-token decays exp(g) ~ 0.5..0.97, a real memory
            layer.linear_attn.A_log.copy_(torch.empty_like(layer.linear_attn.A_log).uniform_(0.05, 0.5).log())
        else:
            layer.self_attn.q_norm.weight.normal_(0, 0.3)
            layer.self_attn.k_norm.weight.normal_(0, 0.3)
    lm.norm.weight.normal_(0, 0.3)
    for module in model.model.visual.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.weight.normal_(1, 0.3)
            module.bias.normal_(0, 0.1)


def tiny_model(tie: bool = False, seed: int = 0, moe: bool = False):
    """``(model, processor)``: a random float64 Qwen3.5 in eval mode, gains randomised;
    ``moe``: Qwen3.5-MoE, its experts run eagerly (transformers' default grouped_mm kernel
    refuses float64), router and experts drawn large enough to route decisively and to matter."""
    from transformers import AutoModelForImageTextToText

    config = tiny_config(tie, moe)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).double().eval()
    _randomise_gains(model)
    if moe:
        model.set_experts_implementation("eager")
        with torch.no_grad():
            for layer in model.model.language_model.layers:
                layer.mlp.gate.weight.normal_(0, 0.25)
                layer.mlp.experts.gate_up_proj.normal_(0, 0.15)
                layer.mlp.experts.down_proj.normal_(0, 0.15)
                for w in (*layer.mlp.shared_expert.parameters(), layer.mlp.shared_expert_gate.weight):
                    w.normal_(0, 0.15)
    return model, tiny_processor()


def tiny_inputs(processor, image, question: str = QUESTION, add_generation_prompt: bool = True):
    """The processor's tensors for one user turn (image, then question)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return processor(images=[image], text=[prompt], return_tensors="pt")
