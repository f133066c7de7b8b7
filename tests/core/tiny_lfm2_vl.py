"""A tiny random LFM2-VL (``Lfm2VlForConditionalGeneration``) in float64, built
offline from transformers' own config and model classes, with a real
``Lfm2VlProcessor`` (its ``Lfm2VlImageProcessor`` and a word-level tokenizer
holding LFM2-VL's special tokens).

The language model is LFM2: short-convolution ("conv") blocks beside
full-attention blocks (``text_config.layer_types``). The vision tower is a
SigLIP2 NaFlex encoder of 8 px patches; the projector pixel-unshuffles 2 x 2
patches into one visual token, so one token covers a 16 x 16 px cell of the
resized image (or of a 32 x 32 px tile when the image is split).

Geometry of the tiny processor (``encoder_patch_size`` 8, ``downsample_factor`` 2,
``min_image_tokens`` 4, ``max_image_tokens`` 16, ``tile_size`` 32, tiles 2..4,
thumbnail on):

* ``IMAGE_SIZE`` (100, 60) -> smart resize to 80 x 48 px (w x h), one tile,
  10 x 6 patches, 5 x 3 = 15 visual tokens (row-major, 3 rows of 5).
* ``TILED_SIZE`` (200, 120) is "too large": a 2 x 1 grid (cols x rows) of
  32 x 32 px tiles of the image resized to 64 x 32, 4 tokens each (2 x 2),
  then the thumbnail (the image smart-resized to 80 x 48: 15 tokens):
  23 visual tokens.
"""

import torch

SPECIAL = (
    "<|pad|>",
    "<|startoftext|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<image>",
    "<|image_start|>",
    "<|image_end|>",
    "<|img_thumbnail|>",
    "<unk>",
)
MAX_TILES = 4
# The tile-position markers the processor writes before each tile's tokens (rows, cols <= MAX_TILES).
TILE_TOKENS = tuple(f"<|img_row_{r}_col_{c}|>" for r in range(1, MAX_TILES + 1) for c in range(1, MAX_TILES + 1))
WORDS = "system user assistant you are a helpful . is there red blue circle square ? what color shape yes no of the"
# LFM2-VL's chat template (bos, ChatML turns, "<image>" per image item, no default system turn),
# reduced to text and image items.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<image>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = "is there a red circle?"

PATCH, DOWNSAMPLE = 8, 2  # SigLIP2 patch side; 2 x 2 patches unshuffled into one visual token
CELL = PATCH * DOWNSAMPLE  # 16 px of the resized image per visual token
MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS = 4, 16
TILE_SIZE = 32  # 4 x 4 patches per tile, 2 x 2 = 4 visual tokens per tile
MAX_NUM_PATCHES = max(MAX_IMAGE_TOKENS * DOWNSAMPLE**2, (TILE_SIZE // PATCH) ** 2)  # 64: pixel_values' padded length
IMAGE_SIZE = (100, 60)  # (width, height): one tile, 3 rows x 5 cols = 15 visual tokens
TILED_SIZE = (200, 120)  # 2 x 1 tiles of 4 tokens, then a 15-token thumbnail
D_MODEL = 64
LAYER_TYPES = ["conv", "full_attention", "full_attention", "conv"]
CONV_KERNEL = 3  # text_config.conv_L_cache


def tiny_tokenizer():
    """A word-level LFM2-style tokenizer built offline: bos ``<|startoftext|>``,
    eos ``<|im_end|>``, pad ``<|pad|>`` and LFM2-VL's image tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + TILE_TOKENS)}
    for w in WORDS.split():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL + TILE_TOKENS))
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|startoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token="<unk>",
        extra_special_tokens={
            "image_token": "<image>",
            "image_start_token": "<|image_start|>",
            "image_end_token": "<|image_end|>",
            "image_thumbnail_token": "<|img_thumbnail|>",
        },
        padding_side="left",  # the adapter must switch to right padding itself
    )


def tiny_image_processor():
    from transformers import Lfm2VlImageProcessor

    return Lfm2VlImageProcessor(
        encoder_patch_size=PATCH,
        downsample_factor=DOWNSAMPLE,
        min_image_tokens=MIN_IMAGE_TOKENS,
        max_image_tokens=MAX_IMAGE_TOKENS,
        tile_size=TILE_SIZE,
        min_tiles=2,
        max_tiles=MAX_TILES,
        use_thumbnail=True,
        do_image_splitting=True,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )


def tiny_processor():
    from transformers import Lfm2VlProcessor

    return Lfm2VlProcessor(
        image_processor=tiny_image_processor(), tokenizer=tiny_tokenizer(), chat_template=CHAT_TEMPLATE
    )


def tiny_config(processor=None, tie: bool = True):
    from transformers import Lfm2VlConfig

    tok = (processor or tiny_processor()).tokenizer
    text = {
        "vocab_size": len(tok),
        "hidden_size": D_MODEL,
        "intermediate_size": 96,
        "block_auto_adjust_ff_dim": False,  # else int(2 * 96 / 3) rounded up to a multiple of 256
        "num_hidden_layers": len(LAYER_TYPES),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # d_head 16, two queries per key head
        "layer_types": LAYER_TYPES,
        "conv_L_cache": CONV_KERNEL,
        "conv_bias": False,
        "max_position_embeddings": 512,
        "norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "tie_word_embeddings": tie,
        # 0.02 (the default) leaves the blocks' writes small beside the token's own (tied)
        # embedding: greedy decoding then repeats one token whatever the image
        "initializer_range": 0.2,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_channels": 3,
        "patch_size": PATCH,
        "num_patches": 16,  # a 4 x 4 position-embedding grid, resized to each image's patch grid
        "vision_use_head": False,
        "layer_norm_eps": 1e-6,
    }
    config = Lfm2VlConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tok.image_token_id,
        projector_hidden_size=48,
        projector_hidden_act="gelu",
        projector_bias=True,
        projector_use_layernorm=True,
        downsample_factor=DOWNSAMPLE,
        tie_word_embeddings=tie,
    )
    config.architectures = ["Lfm2VlForConditionalGeneration"]
    return config


def tiny_model(tie: bool = True, attn_implementation: str | None = None):
    """``(model, processor)``: a random LFM2-VL in float64, eval mode. Its RMSNorm gains
    (init 1), the projector's LayerNorm and the tower's LayerNorms (init 1 / 0) are
    randomised so that every norm counts."""
    from transformers import Lfm2VlForConditionalGeneration

    processor = tiny_processor()
    config = tiny_config(processor, tie)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model = Lfm2VlForConditionalGeneration(config).double().eval()
    with torch.no_grad():
        for module in model.modules():
            name = type(module).__name__
            if name == "Lfm2RMSNorm":
                module.weight.normal_(1, 0.3)
            elif isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1, 0.3)
                module.bias.normal_(0, 0.3)
    return model, processor


def prompt(processor, question: str = QUESTION) -> str:
    """The chat-templated prompt of one image and ``question``, generation prompt on."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
