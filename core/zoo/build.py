"""Architectures of the two default models, built from configs.

``shapes-llava`` is transformers' LLaVA (CLIP vision tower, two-layer GELU
projector, Llama language model with RoPE, RMSNorm and grouped-query heads).
``shapes-coca`` is open_clip's CoCa whose multimodal decoder cross-attends
to the vision tower's patch tokens directly (no attentional pooler).
Both read 128 x 128 images as an 8 x 8 grid of 16 px patches. Saving a
model writes its ``MANIFEST.sha256`` last: the SHA-256 of every file
``load_model`` reads, so an edited file of a built-in model is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.models.loading import write_manifest
from core.zoo import scenes, vocab

IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]  # CLIP's normalisation
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
PATCH = scenes.IMAGE_SIZE // scenes.GRID


def vocab_size() -> int:
    return len(vocab.SPECIAL_TOKENS) + len(vocab.words())


# ------------------------------------------------------------------ LLaVA


def llava_config():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=scenes.IMAGE_SIZE,
        patch_size=PATCH,
        projection_dim=128,
    )
    text = LlamaConfig(
        vocab_size=vocab_size(),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=vocab.SPECIAL_TOKENS.index(vocab.IMAGE),
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=scenes.GRID * scenes.GRID,
        tie_word_embeddings=False,
    )
    return config


def build_llava(seed: int = 0):
    import torch
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(llava_config())
    return model


def llava_processor():
    from transformers import CLIPImageProcessor, LlavaProcessor

    image_processor = CLIPImageProcessor(
        size={"shortest_edge": scenes.IMAGE_SIZE},
        crop_size={"height": scenes.IMAGE_SIZE, "width": scenes.IMAGE_SIZE},
        image_mean=IMAGE_MEAN,
        image_std=IMAGE_STD,
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=vocab.build_hf_tokenizer(),
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=vocab.LLAVA_CHAT_TEMPLATE,
        image_token=vocab.IMAGE,
    )


def save_llava(model, out_dir: Path) -> None:
    """The model and its processor, then the folder's MANIFEST.sha256 (see :func:`write_manifest`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    llava_processor().save_pretrained(out_dir)

    write_manifest(out_dir)


# ------------------------------------------------------------------- CoCa

COCA_CONTEXT = 32


def coca_model_cfg() -> dict:
    width = 128
    return {
        "embed_dim": 64,
        "vision_cfg": {
            "image_size": scenes.IMAGE_SIZE,
            "patch_size": PATCH,
            "width": width,
            "layers": 3,
            "head_width": 32,
            "mlp_ratio": 4.0,
            "attentional_pool": False,
            "output_tokens": True,
        },
        "text_cfg": {
            "context_length": COCA_CONTEXT,
            "vocab_size": vocab_size(),
            "width": width,
            "heads": 4,
            "layers": 1,
            "mlp_ratio": 2.0,
            "embed_cls": True,
            "output_tokens": True,
            "pad_id": 0,
            "hf_tokenizer_name": ".",
        },
        "multimodal_cfg": {
            "context_length": COCA_CONTEXT,
            "vocab_size": vocab_size(),
            "width": width,
            "heads": 4,
            "layers": 4,
            "mlp_ratio": 2.0,
        },
        "custom_text": True,
    }


def build_coca(seed: int = 0):
    import torch
    from open_clip.coca_model import CoCa

    torch.manual_seed(seed)
    cfg = coca_model_cfg()
    model = CoCa(
        embed_dim=cfg["embed_dim"],
        multimodal_cfg=cfg["multimodal_cfg"],
        text_cfg=cfg["text_cfg"],
        vision_cfg=cfg["vision_cfg"],
        pad_id=0,
    )
    # open_clip leaves the decoder's vocabulary projection as torch.empty
    # (its init_parameters is never called for CoCa): initialise it here.
    decoder = model.text_decoder
    torch.nn.init.normal_(decoder.text_projection, std=decoder.width**-0.5)
    return model


def save_coca(model, out_dir: Path) -> None:
    """The weights, open_clip_config.json and the tokenizer, then the folder's MANIFEST.sha256."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / "open_clip_model.safetensors"))
    config = {
        "model_cfg": coca_model_cfg(),
        "preprocess_cfg": {
            "mean": IMAGE_MEAN,
            "std": IMAGE_STD,
            "interpolation": "bicubic",
            "resize_mode": "shortest",
        },
        "vlm_readout": {
            "family": "coca",
            "prompt": vocab.COCA_PROMPT,
            "answer_words": list(scenes.ANSWER_WORDS),
        },
    }
    (out_dir / "open_clip_config.json").write_text(json.dumps(config, indent=2))
    vocab.build_hf_tokenizer().save_pretrained(out_dir)

    write_manifest(out_dir)
