"""A tiny random float64 Gemma 3n (``Gemma3nForConditionalGeneration``) built offline
from transformers' own config and model classes, with a real ``Gemma3nProcessor``.

What the tiny model keeps of the real architecture:
  * 4 decoder layers, ``layer_types`` sliding / full / sliding / full (window 8, shorter
    than the prompt); ``num_kv_shared_layers = 2``: layer 2 (sliding) reuses layer 0's
    K/V, layer 3 (full) reuses layer 1's (their attention has no k_proj / v_proj);
  * AltUp with 4 streams, LAuReL (rank 8), per-layer inputs (8 per layer);
  * activation sparsity 0.95 on layers 0-1 (the real E2B / E4B: 0.95 on the first 10
    layers; the config default for <= 10 layers would be all dense), i.e. the
    "gaussian top-k" relu(g - (mean + 1.645 std)) before the GELU;
  * final logit softcapping 30 (the config default), tied lm_head;
  * the timm MobileNetV5 encoder (``mobilenetv5_300m_enc``, pretrained=False: built
    from its code, no download) with tiny ``block_args`` (edge-residual, universal
    inverted residual and multi-query attention blocks), its multi-scale fusion adapter
    (2048 channels: fixed in timm) pooled to a 4 x 4 grid = 16 soft tokens per image;
  * a 1-layer audio tower (never run here: no audio input);
  * the real vocabulary layout: text ids < ``vocab_size_per_layer_input``, then the
    vision vocabulary (``<end_of_image>``, ``<image_soft_token>``), then the audio one.

Norm gains (init 1), AltUp's ``correct_output_scale`` (init 0: it would switch the
per-layer-input path off) and AltUp's router / coefficients (init tiny) are randomised
so that every path counts.
"""

import functools

import torch

# ---- the tokenizer: ids laid out as in the real vocabulary
TEXT_SPECIAL = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",  # boi: a TEXT token (real id 255999)
    "<start_of_audio>",  # boa: a text token (real id 256000)
)
VISION_SPECIAL = ("<end_of_image>", "<image_soft_token>")  # real ids 262144, 262145: the vision vocab's first two
AUDIO_SPECIAL = ("<end_of_audio>", "<audio_soft_token>")  # real ids 262272, 262273: the audio vocab's first two
SPECIAL = TEXT_SPECIAL + VISION_SPECIAL + AUDIO_SPECIAL
WORDS = "user model is there a red blue circle square ? what color shape yes no of the"
TEXT_TOKENS = (*TEXT_SPECIAL, "\n", "\n\n", *dict.fromkeys(WORDS.split()))
N_TEXT = len(TEXT_TOKENS)  # = vocab_size_per_layer_input = vision vocab_offset
N_VISION, N_AUDIO = len(VISION_SPECIAL), len(AUDIO_SPECIAL)
VOCAB_SIZE = N_TEXT + N_VISION + N_AUDIO

# Gemma 3n's chat template, reduced to text and image items (an image item is the
# placeholder <image_soft_token>, which the processor expands).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<image_soft_token>"
    "{% elif content['type'] == 'text' %}{{ content['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
QUESTION = "is there a red circle?"

# ---- geometry: 128 x 128 input, stride-16 (8 x 8) and stride-32 (4 x 4) maps fused at
# 8 x 8, average-pooled 2 x 2 to 4 x 4 = 16 soft tokens (real: 768 px, 48 x 48 pooled
# 3 x 3 to 16 x 16 = 256), row-major.
IMAGE_SIDE = 128
GRID = 4
N_IMAGE_TOKENS = GRID * GRID
IMAGE_SIZE = (90, 60)  # (width, height), non-square: the resize stretches it
D_MODEL, SLIDING_WINDOW = 64, 8
# Picked so that greedy decoding of QUESTION on noise_image(IMAGE_SIZE) runs 6 tokens
# without <eos> and passes through an audio-vocabulary token (<end_of_audio>, embedded
# by embed_audio's hard-token path) but no <image_soft_token>.
SEED = 4
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
NUM_KV_SHARED = 2
SPARSITY = [0.95, 0.95, 0.0, 0.0]
VISION_WIDTH = 2048  # MobileNetV5Encoder.num_features: hard-coded in timm
ARCH = [  # timm block strings: er = edge residual, uir = universal inverted residual, mqa = multi-query attention
    ["er_r1_k3_s2_e2_c8"],
    ["uir_r1_a3_k5_s2_e2_c16"],
    ["uir_r1_a3_k3_s2_e2_c16", "mqa_r1_k3_h2_v2_s1_d8_c16", "uir_r1_a0_k0_s1_e2_c16"],
    ["uir_r1_a3_k3_s2_e2_c24", "mqa_r1_k3_h2_s1_d8_c24", "uir_r1_a0_k0_s1_e2_c24"],
]


def tiny_tokenizer():
    """A word-level Gemma-style tokenizer built offline, with Gemma 3n's named special
    tokens at the real layout (text, then vision, then audio ids), "\\n" / "\\n\\n" as tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(TEXT_TOKENS)}
    for t in VISION_SPECIAL + AUDIO_SPECIAL:
        vocab[t] = len(vocab)
    assert len(vocab) == VOCAB_SIZE
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL))
    tok.add_tokens([AddedToken("\n\n", normalized=False), AddedToken("\n", normalized=False)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
            "boa_token": "<start_of_audio>",
            "eoa_token": "<end_of_audio>",
            "audio_token": "<audio_soft_token>",
        },
        padding_side="left",
    )


def tiny_processor():
    """Gemma 3n's processor: a SigLIP image processor resizing to 128 x 128, rescaling
    to [0, 1] and not normalising (MobileNetV5's mean 0 / std 1), the audio feature
    extractor (unused here) and the tiny tokenizer; 16 soft tokens per image."""
    from transformers import Gemma3nAudioFeatureExtractor, Gemma3nProcessor, SiglipImageProcessor

    image_processor = SiglipImageProcessor(
        size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}, do_normalize=False, do_rescale=True
    )
    return Gemma3nProcessor(
        feature_extractor=Gemma3nAudioFeatureExtractor(),
        image_processor=image_processor,
        tokenizer=tiny_tokenizer(),
        chat_template=CHAT_TEMPLATE,
        image_seq_length=N_IMAGE_TOKENS,
        audio_seq_length=4,
    )


def tiny_config(**text_extra):
    from timm.models._efficientnet_builder import decode_arch_def
    from transformers import Gemma3nConfig

    processor = tiny_processor()
    tok = processor.tokenizer
    text = {
        "vocab_size": VOCAB_SIZE,
        "vocab_size_per_layer_input": N_TEXT,
        "hidden_size": D_MODEL,
        "intermediate_size": 128,
        "num_hidden_layers": len(LAYER_TYPES),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_size_per_layer_input": 8,
        "laurel_rank": 8,
        "altup_num_inputs": 4,
        "num_kv_shared_layers": NUM_KV_SHARED,
        "activation_sparsity_pattern": SPARSITY,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": LAYER_TYPES,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
        **text_extra,
    }
    vision = {
        "architecture": "mobilenetv5_300m_enc",
        "model_args": {
            "block_args": decode_arch_def(ARCH),
            "stem_size": 8,
            "msfa_output_resolution": GRID,
        },
        "hidden_size": VISION_WIDTH,
        "vocab_size": N_VISION,
        "vocab_offset": N_TEXT,
        "num_labels": 1,  # no ImageNet label table is needed
    }
    audio = {
        "vocab_size": N_AUDIO,
        "vocab_offset": N_TEXT + N_VISION,
        "hidden_size": 16,
        "conf_num_attention_heads": 2,
        "conf_num_hidden_layers": 1,
        "sscp_conv_channel_size": [4, 4],
        "conf_attention_chunk_size": 4,
        "conf_attention_context_left": 5,
    }
    config = Gemma3nConfig(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        vision_soft_tokens_per_image=N_IMAGE_TOKENS,
        audio_soft_tokens_per_image=4,
        boi_token_id=tok.boi_token_id,
        eoi_token_id=tok.eoi_token_id,
        image_token_id=tok.image_token_id,
        boa_token_id=tok.boa_token_id,
        eoa_token_id=tok.eoa_token_id,
        audio_token_id=tok.audio_token_id,
    )
    config.architectures = ["Gemma3nForConditionalGeneration"]
    return config, processor


def restore_block_args(config) -> None:
    """timm's EfficientNetBuilder pops keys out of the ``block_args`` dicts it is given,
    i.e. out of ``config.vision_config.model_args``: put a fresh decoding back so the
    config can build (or be saved and reload) a model again."""
    from timm.models._efficientnet_builder import decode_arch_def

    config.vision_config.model_args["block_args"] = decode_arch_def(ARCH)


def randomise_(model, seed: int = 1) -> None:
    """Make every gain and gate of the language model and the multimodal embedders count:
    RMSNorm gains (init 1; Gemma 3n's RMSNorm multiplies by ``w``, not ``1 + w``) to
    N(1, 0.3); AltUp's ``correct_output_scale`` (init 0) to N(1, 0.3); AltUp's router
    (init N(0, 0.02), behind a 1 / d_model input scale) to N(0, 8) and its prediction /
    correction coefficients to N(0, 0.3); the (tied) token embeddings to N(0, 0.3), so
    that logits reach the softcap's curved range (|logit| of several units)."""
    g = torch.Generator().manual_seed(seed)

    def fill(p, mean, std):
        p.copy_(mean + std * torch.randn(p.shape, generator=g, dtype=p.dtype))

    with torch.no_grad():
        fill(model.model.language_model.embed_tokens.weight, 0.0, 0.3)
        for owner in (model.model.language_model, model.model.embed_vision, model.model.embed_audio):
            for module in owner.modules():
                if type(module).__name__ == "Gemma3nRMSNorm" and getattr(module, "with_scale", False):
                    fill(module.weight, 1.0, 0.3)
        for layer in model.model.language_model.layers:
            fill(layer.altup.correct_output_scale, 1.0, 0.3)
            fill(layer.altup.modality_router.weight, 0.0, 8.0)
            fill(layer.altup.prediction_coefs.weight, 0.0, 0.3)
            fill(layer.altup.correction_coefs.weight, 0.0, 0.3)


def tiny_gemma3n_float64(attn_implementation: str | None = None, **text_extra):
    """``(model, processor)``: a random Gemma 3n in float64, eval mode, with the
    library's default attention implementation (sdpa) unless one is named (the
    capture switches to eager itself)."""
    from transformers import Gemma3nForConditionalGeneration

    config, processor = tiny_config(**text_extra)
    torch.manual_seed(SEED)
    model = Gemma3nForConditionalGeneration(config).double().eval()
    restore_block_args(model.config)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    randomise_(model, SEED + 1)
    return model, processor


@functools.cache
def tiny_model():
    """``(model, processor)``, built once per session."""
    return tiny_gemma3n_float64()


def prompt(processor, question: str = QUESTION) -> str:
    """The chat prompt with one image item before the question, generation prompt on."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def tiny_inputs(processor, image, question: str = QUESTION):
    """``processor(images=[image], text=[prompt])`` as tensors."""
    return processor(images=[image], text=[prompt(processor, question)], return_tensors="pt")
