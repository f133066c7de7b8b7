"""A tiny random float64 Llama 4 (``Llama4ForConditionalGeneration``) built offline
from transformers' own config and model classes, with a real ``Llama4Processor``
(its image processor and a word-level tokenizer carrying Llama 4's special tokens).

Four decoder layers: the MoE / dense interleave of Maverick (128E, ``interleave_moe_layer_step=2``),
the q/k norm of Scout (16E), NoPE every fourth layer (the default ``no_rope_layer_interval``):

=====  =========  ==================  ===============
layer  RoPE       mask                feed-forward
=====  =========  ==================  ===============
0      RoPE       chunked (8 tokens)  dense MLP
1      RoPE       chunked (8 tokens)  MoE (4 experts, top 2, + shared expert)
2      RoPE       chunked (8 tokens)  dense MLP
3      NoPE       full causal         MoE
=====  =========  ==================  ===============

RoPE layers RMS-normalise q and k over d_head, no gain (transformers: Llama4TextL2Norm); the NoPE layer scales
its queries by the attention temperature ``1 + ATTN_SCALE * log1p(floor((pos + 1) /
FLOOR_SCALE))``, which with ``FLOOR_SCALE = 4`` is already > 1 from position 3 on.
Images are one 32 x 32 tile (``max_patches=1``): 8 x 8 patches of 4 px, pixel-shuffled
2 x 2 into a 4 x 4 grid of 16 visual tokens; the prompt of QUESTION is 35 tokens long.
"""

import torch

SPECIAL = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|finetune_right_pad|>",
    "<|header_start|>",
    "<|header_end|>",
    "<|eom|>",
    "<|eot|>",
    "<|image_start|>",
    "<|image_end|>",
    "<|image|>",
    "<|patch|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
    "<unk>",
)
WORDS = "system user assistant you are a helpful . is there red blue circle square ? what color shape yes no of the"
# Llama 4's chat template, reduced to text and image items (no system turn of its own).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|header_start|>{{ message['role'] }}<|header_end|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|image|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)
QUESTION = "is there a red circle?"
IMAGE_SIZE = (60, 40)  # (width, height), non-square: resized to 32 x 21 and padded below to one 32 x 32 tile

TILE, PATCH, SHUFFLE = 32, 4, 0.5
GRID = int(TILE // PATCH * SHUFFLE)  # 4 x 4 visual tokens per tile
TOKENS_PER_TILE = GRID * GRID
D_MODEL, D_HEAD, N_HEADS, N_KV_HEADS = 64, 16, 4, 2
N_LAYERS = 4
NO_ROPE_LAYERS = [1, 1, 1, 0]  # 1: RoPE (and chunked), 0: NoPE (full attention, temperature)
MOE_LAYERS = [1, 3]  # interleave_moe_layer_step = 2
N_EXPERTS, TOP_K = 4, 2
CHUNK = 8
FLOOR_SCALE, ATTN_SCALE = 4, 0.5
INIT_STD = 0.1  # larger than the default 0.02, so the attention patterns are far from uniform


def tiny_tokenizer():
    """A word-level Llama-4-style tokenizer built offline: BOS ``<|begin_of_text|>``,
    Llama 4's header / image / tile special tokens, ``"\\n\\n"`` as a token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for w in ["\n\n", *WORDS.split()]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL))
    tok.add_tokens([AddedToken("\n\n", normalized=False)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot|>",
        pad_token="<|finetune_right_pad|>",
        unk_token="<unk>",
        padding_side="left",  # Llama4Processor's default too; the adapter must switch to right padding itself
    )


def tiny_processor(max_patches: int = 1):
    """Llama 4's processor: 32 px tiles of 4 px patches (``max_patches=1``: always one tile)."""
    from transformers import Llama4ImageProcessor, Llama4Processor

    image_processor = Llama4ImageProcessor(size={"height": TILE, "width": TILE}, max_patches=max_patches)
    return Llama4Processor(
        image_processor=image_processor,
        tokenizer=tiny_tokenizer(),
        patch_size=PATCH,
        pixel_shuffle_ratio=SHUFFLE,
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(**text_extra):
    from transformers import Llama4Config

    ids = {t: i for i, t in enumerate(SPECIAL)}
    n_vocab = len(tiny_tokenizer())
    text = {
        "vocab_size": n_vocab,
        "hidden_size": D_MODEL,
        "intermediate_size": 32,  # each expert's and the shared expert's width
        "intermediate_size_mlp": 96,  # the dense layers' MLP width
        "num_hidden_layers": N_LAYERS,
        "num_attention_heads": N_HEADS,
        "num_key_value_heads": N_KV_HEADS,
        "head_dim": D_HEAD,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "num_local_experts": N_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "interleave_moe_layer_step": 2,
        "no_rope_layers": NO_ROPE_LAYERS,
        "attention_chunk_size": CHUNK,
        "use_qk_norm": True,
        "attn_temperature_tuning": True,
        "floor_scale": FLOOR_SCALE,
        "attn_scale": ATTN_SCALE,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "initializer_range": INIT_STD,
        "pad_token_id": ids["<|finetune_right_pad|>"],
        "bos_token_id": ids["<|begin_of_text|>"],
        "eos_token_id": [ids["<|end_of_text|>"], ids["<|eom|>"], ids["<|eot|>"]],
        **text_extra,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 128,  # = hidden_size / SHUFFLE**2: also the pixel-shuffled width fc1 reads
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": TILE,
        "patch_size": PATCH,
        "pixel_shuffle_ratio": SHUFFLE,
        "projector_input_dim": 48,
        "projector_output_dim": 48,
        "vision_output_dim": 48,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "initializer_range": INIT_STD,
    }
    config = Llama4Config(
        text_config=text,
        vision_config=vision,
        image_token_index=ids["<|patch|>"],  # the model scatters features into <|patch|>, not <|image|>
        boi_token_index=ids["<|image_start|>"],
        eoi_token_index=ids["<|image_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Llama4ForConditionalGeneration"]
    return config


def tiny_model(max_patches: int = 1, seed: int = 5, **text_extra):
    """``(model, processor)``: a random Llama 4 in float64, eval mode, norm gains randomised."""
    from transformers import Llama4ForConditionalGeneration

    config = tiny_config(**text_extra)
    torch.manual_seed(seed)
    model = Llama4ForConditionalGeneration(config).double().eval()
    with torch.no_grad():  # the init sets norm gains to 1 (biases to 0): make them count
        lm = model.language_model.model
        for layer in lm.layers:
            layer.input_layernorm.weight.normal_(1, 0.3)
            layer.post_attention_layernorm.weight.normal_(1, 0.3)
        lm.norm.weight.normal_(1, 0.3)
        vm = model.vision_model
        norms = [vm.layernorm_pre, vm.layernorm_post]
        for layer in vm.model.layers:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
        for norm in norms:
            norm.weight.normal_(1, 0.3)
            norm.bias.normal_(0, 0.1)
    return model, tiny_processor(max_patches)


def prompt(processor, question: str = QUESTION) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True)


def model_inputs(model, processor, image, question: str = QUESTION):
    """The processor's tensors with ``pixel_values`` (bfloat16 from the processor) cast to the model's dtype."""
    inputs = processor(images=[image], text=[prompt(processor, question)], return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    return inputs
