"""Model and processor configurations that disagree, or would compute NaN,
never load; a model folder holding a FIFO never hangs the load; a forward
whose logits are not finite is never shown as a result.

Each bad folder is a copy of a built-in model (no MANIFEST.sha256: a user's
folder, so each problem is named as itself) or a family's tiny model saved into
tmp_path, with one field of config.json, processor_config.json or
open_clip_config.json edited; the load must refuse it in one line that starts
with the file and names the field and what was expected (core/models/config_check.py).
"""

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import warnings

import pytest
from safetensors.torch import load_file, save_file

from core import answer, capture, load_image, load_model
from core.analyze import analyze
from core.cli import main
from core.errors import ModelLoadError, NonFiniteError, ReadoutError
from core.generate import generate
from core.models.loading import MANIFEST, ModelLoadWarning, resources_dir

MODELS = resources_dir() / "models"
IMAGE = resources_dir() / "samples" / "sample_00.png"
QUESTION = "what shape is the blue object?"


def _copy(tmp_path, name: str = "shapes-llava"):
    d = tmp_path / name
    shutil.copytree(MODELS / name, d)
    (d / MANIFEST).unlink()
    return d


def _edit_json(path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))  # NaN / Infinity written as JSON's extension, as json.dumps does


def _refused(folder, starts: str, *needles: str) -> str:
    """``load_model(folder)`` raises one ModelLoadError line starting with ``starts``, holding every needle."""
    with pytest.raises(ModelLoadError) as e:
        load_model(folder)
    text = str(e.value)
    assert "\n" not in text and text.startswith(starts), text
    for needle in needles:
        assert needle in text, text
    return text


def _set(path: str, value):
    """An edit setting the dotted ``path`` of a JSON document to ``value``."""

    def edit(doc):
        *parents, last = path.split(".")
        for p in parents:
            doc = doc[p]
        doc[last] = value

    return edit


# ---------------------------------------------------------------- config.json: numbers that crash or compute NaN

NAN, INF = float("nan"), float("inf")

CONFIG_CASES = [
    # norm epsilons: NaN or negative printed "shape nan"; zero divides by zero on a zero row
    ("text_config.rms_norm_eps", NAN, "expected a finite number, got NaN"),
    ("text_config.rms_norm_eps", -1.0, "expected a finite number > 0, got -1.0"),
    ("text_config.rms_norm_eps", 0, "expected a finite number > 0, got 0"),
    ("text_config.rms_norm_eps", None, "expected a finite number > 0, got None"),
    ("text_config.rms_norm_eps", "1e-5", "expected a finite number > 0, got '1e-5'"),
    ("vision_config.layer_norm_eps", -INF, "expected a finite number, got -Infinity"),
    # RoPE: theta 0 printed "shape nan"
    ("text_config.rope_parameters.rope_theta", 0.0, "expected a finite number > 0, got 0.0"),
    ("text_config.rope_parameters.rope_theta", INF, "expected a finite number, got Infinity"),
    ("text_config.rope_parameters.factor", -2.0, "expected a finite number > 0, got -2.0"),
    # sizes: zero layers answered "one" at 0.26; patch 0 divided by zero
    ("text_config.num_hidden_layers", 0, "expected an integer from 1 to"),
    ("text_config.num_hidden_layers", 2.5, "got 2.5"),
    # found by the fuzzer: 19,245,064 tower layers, built one by one (a 20 s timeout before any weight is read)
    ("vision_config.num_hidden_layers", 19_245_064, "expected an integer from 1 to 1,024, got 19245064"),
    ("text_config.num_hidden_layers", True, "got True"),
    ("text_config.num_attention_heads", -4, "got -4"),
    ("text_config.hidden_size", [], "got []"),
    ("text_config.max_position_embeddings", 10**12, "got 1000000000000"),
    ("vision_config.patch_size", 0, "expected an integer from 1 to"),
    ("vision_config.image_size", "128", "got '128'"),
    ("vision_config.num_hidden_layers", {"n": 3}, "got {'n': 3}"),
    # the vision features the projector reads
    ("vision_feature_select_strategy", "crop", "expected 'default' or 'full', got 'crop'"),
    ("vision_feature_layer", "last", "expected a layer index or a non-empty list of them"),
    ("vision_feature_layer", [], "expected a layer index or a non-empty list of them"),
    ("vision_feature_layer", None, "expected a layer index or a non-empty list of them, got None"),
    ("tie_word_embeddings", "yes", "expected true or false, got 'yes'"),
]


@pytest.mark.parametrize("field,value,expected", CONFIG_CASES, ids=[f"{f}={v!r}" for f, v, _ in CONFIG_CASES])
def test_config_number_that_would_crash_or_compute_nan_is_refused(tmp_path, field, value, expected):
    d = _copy(tmp_path)
    _edit_json(d / "config.json", _set(field, value))
    _refused(d, f"{d / 'config.json'} {field}: ", expected)


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("vision_feature_layer", 99, "99 is not a hidden state of the 3-layer vision tower (expected -4 to 3)"),
        ("vision_feature_layer", -99, "-99 is not a hidden state of the 3-layer vision tower"),
        ("vision_feature_layer", [-1, 4], "4 is not a hidden state"),
        # found by the fuzzer: 0 is falsy, so transformers keeps no hidden state (a TypeError in the forward)
        ("vision_feature_layer", 0, "0 (the tower's embeddings) makes transformers keep no hidden state"),
        ("vision_config.image_size", 8, "8x8 is smaller than one 16x16 patch"),
    ],
)
def test_config_fields_that_disagree_with_each_other_are_refused(tmp_path, field, value, expected):
    d = _copy(tmp_path)
    _edit_json(d / "config.json", _set(field, value))
    _refused(d, f"{d / 'config.json'} {field.split('.')[0]}", expected)


@pytest.mark.parametrize(
    "edit,expected",
    [
        (_set("image_seq_length", 10), "image_seq_length: 10, but the vision tower gives 64 image features"),
        # "full" keeps the class token: 65 features for the 64 the length check counts
        (_set("vision_feature_select_strategy", "full"), "image_seq_length: 64, but the vision tower gives 65"),
    ],
)
def test_image_seq_length_must_be_what_the_tower_gives(tmp_path, edit, expected):
    d = _copy(tmp_path)
    _edit_json(d / "config.json", edit)
    _refused(d, "config.json image_seq_length: ", expected)


def test_config_with_fewer_layers_than_the_weights_is_refused(tmp_path):
    """Was: a warning about unexpected tensors, and a two-layer model answering."""
    d = _copy(tmp_path)
    _edit_json(d / "config.json", _set("text_config.num_hidden_layers", 2))
    _refused(
        d,
        f"{d / 'model.safetensors'}: ",
        "model.language_model.layers.2.* (9 tensors)",
        "describes fewer layers (num_hidden_layers) than the checkpoint",
    )


def test_deep_or_non_utf8_config_is_one_line(tmp_path):
    d = _copy(tmp_path)
    (d / "config.json").write_text("[" * 10_000 + "]" * 10_000)
    _refused(d, f"{d / 'config.json'}: JSON nested deeper than 64 levels")
    (d / "config.json").write_bytes(b'{"a": "\xff"}')
    _refused(d, f"{d / 'config.json'}: not UTF-8 text")
    (d / "config.json").write_text('{"text_config": {"rms_norm_eps": 1e999}}')
    _refused(d, f"{d / 'config.json'} text_config.rms_norm_eps: expected a finite number, got Infinity")


# ---------------------------------------------------------------- the processor: its own numbers


def _processor(field: str) -> str:
    return f"processor_config.json image_processor.{field}"


PROCESSOR_CASES = [
    # a std of 0 or a NaN rescale factor printed "shape nan"
    ("image_processor.image_std", [0, 0, 0], "expected one or 3 numbers from 1.18e-38 to 3.4e+38 (one per channel)"),
    ("image_processor.image_std", [0.3, -0.3, 0.3], "expected one or 3 numbers from 1.18e-38 to 3.4e+38"),
    ("image_processor.image_std", [0.3, 0.3], "expected one or 3 numbers from 1.18e-38 to 3.4e+38"),
    ("image_processor.image_std", "wide", "got 'wide'"),
    ("image_processor.image_std", [0.3, NAN, 0.3], "expected a finite number, got NaN"),
    ("image_processor.image_mean", [0.5, INF, 0.5], "expected a finite number, got Infinity"),
    ("image_processor.image_mean", [0.5, "x", 0.5], "expected one or 3 finite numbers (one per channel)"),
    # found by the fuzzer: a step switched on without its setting (the processor's ValueError at the first image)
    ("image_processor.image_mean", None, "missing or null, but do_normalize is true"),
    ("image_processor.crop_size", None, "missing or null, but do_center_crop is true"),
    # found by the fuzzer: a switch that is not a boolean (a TypeError inside the processor)
    ("image_processor.do_rescale", {"height": 0}, "expected true or false, got {'height': 0}"),
    ("image_processor.do_normalize", "yes", "expected true or false, got 'yes'"),
    ("image_processor.rescale_factor", NAN, "expected a finite number, got NaN"),
    ("image_processor.rescale_factor", 0, "expected a number from 1.18e-38 to 3.4e+38, got 0"),
    ("image_processor.rescale_factor", 1e300, "expected a number from 1.18e-38 to 3.4e+38"),  # Infinity in float32
    ("image_processor.image_std", [0.3, 1e-300, 0.3], "expected one or 3 numbers from 1.18e-38 to 3.4e+38"),
    ("image_processor.rescale_factor", -1 / 255, "expected a number from 1.18e-38 to 3.4e+38"),
    ("image_processor.rescale_factor", "1/255", "got '1/255'"),
    # resample 99 was a KeyError
    ("image_processor.resample", 99, "expected a resampling filter code 0 to 5"),
    ("image_processor.resample", -1, "expected a resampling filter code 0 to 5"),
    ("image_processor.resample", 6, "expected a resampling filter code 0 to 5"),
    ("image_processor.resample", "bicubic", "expected a resampling filter code 0 to 5"),
    # crop size 0 was a ValueError of the tower
    ("image_processor.crop_size.height", 0, "expected an integer from 1 to"),
    ("image_processor.crop_size.width", -128, "expected an integer from 1 to"),
    ("image_processor.size.shortest_edge", 0, "expected an integer from 1 to"),
    ("image_processor.size.shortest_edge", 1.5, "expected an integer from 1 to"),
    # found by the fuzzer: a resize to 1 x 1 fails inside torch's antialiasing (an internal assert)
    ("image_processor.size", 1, "1 is smaller than one 16-pixel patch (config.json vision_config.patch_size)"),
    ("image_processor.size.shortest_edge", 8, "8 is smaller than one 16-pixel patch"),
]


@pytest.mark.parametrize("field,value,expected", PROCESSOR_CASES, ids=[f"{f}={v!r}" for f, v, _ in PROCESSOR_CASES])
def test_processor_setting_that_would_crash_or_compute_nan_is_refused(tmp_path, field, value, expected):
    d = _copy(tmp_path)
    _edit_json(d / "processor_config.json", _set(field, value))
    _refused(d, f"{d / 'processor_config.json'} {field}", expected)


def test_image_processor_that_fails_on_a_probe_image_is_refused_at_load(tmp_path):
    """A setting no rule names (here the device it computes on) fails on a probe
    image at load, in one line naming the processor config, not at the first read-out."""
    d = _copy(tmp_path)
    _edit_json(d / "processor_config.json", _set("image_processor.device", "nonsense"))
    _refused(d, f"{d / 'processor_config.json'}: the image processor fails on a 64x48 probe image (RuntimeError: ")


def test_processor_files_that_make_no_tokenizing_processor_are_refused(tmp_path):
    """Found by the fuzzer: an unknown processor_class made transformers load the
    image processor (or the tokenizer) alone, and the first question went to it."""
    d = _copy(tmp_path)
    _edit_json(d / "processor_config.json", _set("processor_class", "NoSuchProcessor"))
    _edit_json(d / "tokenizer_config.json", lambda c: c.pop("processor_class", None))
    _refused(
        d,
        f"{d / 'processor_config.json'} processor_class: the folder's processor files make a ",
        "not a processor holding a tokenizer and an image processor",
    )


def test_crop_that_would_allocate_without_bound_is_refused(tmp_path):
    d = _copy(tmp_path)
    _edit_json(d / "processor_config.json", _set("image_processor.crop_size", {"height": 60_000, "width": 60_000}))
    _refused(d, f"{d / _processor('crop_size')}: 60000x60000 is over the 40,000,000-pixel limit")


# ---------------------------------------------------------------- the processor against the model

AGREEMENT_CASES = [
    # each was "Image features and image tokens do not match" or "Input image size ... doesn't match model"
    (
        _set("num_additional_image_tokens", 0),
        "processor_config.json num_additional_image_tokens: 0, so the processor would write 63 image tokens, "
        "but the vision tower gives 64 image features",
    ),
    (_set("num_additional_image_tokens", 2), "would write 65 image tokens, but the vision tower gives 64"),
    (_set("num_additional_image_tokens", -1), "processor_config.json num_additional_image_tokens: expected"),
    (
        _set("vision_feature_select_strategy", "full"),
        "processor_config.json vision_feature_select_strategy: 'full', but config.json "
        "vision_feature_select_strategy is 'default'",
    ),
    (_set("vision_feature_select_strategy", "crop"), "vision_feature_select_strategy: expected 'default' or 'full'"),
    (_set("patch_size", 0), "processor_config.json patch_size: expected an integer >= 1, got 0"),
    (_set("patch_size", 8), "processor_config.json patch_size: 8, but config.json vision_config.patch_size is 16"),
    (
        _set("image_processor.crop_size", {"height": 64, "width": 64}),
        "processor_config.json image_processor.crop_size: 64x64, but the vision tower reads 128x128 images",
    ),
    (
        _set("image_processor.crop_size", {"height": 256, "width": 256}),
        "crop_size: 256x256, but the vision tower reads 128x128",
    ),
    (
        _set("image_processor.do_center_crop", False),
        "image_processor.do_center_crop: the processor neither crops nor resizes to a fixed size",
    ),
]


@pytest.mark.parametrize("edit,expected", AGREEMENT_CASES)
def test_processor_that_disagrees_with_the_model_is_refused_at_load(tmp_path, edit, expected):
    d = _copy(tmp_path)
    _edit_json(d / "processor_config.json", edit)
    _refused(d, f"{d}/", expected)


def test_a_disagreement_the_load_cannot_foresee_is_one_line_at_run_time(tmp_path):
    """Past the load-time arithmetic (here: the processor changed after the load),
    the model's own check in the forward becomes one line naming both configs."""
    loaded = load_model(_copy(tmp_path))
    loaded.processor.num_additional_image_tokens = 0
    with pytest.raises(ModelLoadError) as e:
        answer(loaded, IMAGE, QUESTION)
    text = str(e.value)
    assert text.startswith(f"{loaded.spec}: the processor and the model disagree (Image features and image tokens")
    assert "config.json" in text and "processor_config.json" in text and "\n" not in text
    with pytest.raises(ModelLoadError, match="the processor and the model disagree"):
        analyze(loaded, IMAGE, QUESTION)
    # the check sits in Adapter.run_model, where every forward goes: generation's cached prefill too
    for use_cache in (True, False):
        with pytest.raises(ModelLoadError, match="the processor and the model disagree"):
            generate(loaded, IMAGE, QUESTION, max_new_tokens=2, use_cache=use_cache)


# ---------------------------------------------------------------- chat templates


@pytest.mark.parametrize("text", ["", "  \n\t\n"])
def test_empty_chat_template_file_is_refused(tmp_path, text):
    """Was: the family's fallback prompt, silently."""
    d = _copy(tmp_path)
    (d / "chat_template.jinja").write_text(text)
    _refused(d, f"{d / 'chat_template.jinja'}: empty chat template")


@pytest.mark.parametrize(
    "file,value,field",
    [
        ("tokenizer_config.json", "", "chat_template"),
        ("processor_config.json", " ", "chat_template"),
        ("tokenizer_config.json", 7, "chat_template"),
        ("chat_template.json", "", "chat_template"),
        ("chat_template.json", None, "chat_template"),
        ("tokenizer_config.json", [{"name": "default", "template": ""}], "chat_template[0].template"),
        ("tokenizer_config.json", ["{{ messages }}"], "chat_template[0].template"),
    ],
)
def test_empty_chat_template_field_is_refused(tmp_path, file, value, field):
    d = _copy(tmp_path)
    f = d / file
    if not f.exists():
        f.write_text("{}")
    _edit_json(f, _set("chat_template", value))
    _refused(d, f"{f} {field}: expected a non-empty template string")


# ---------------------------------------------------------------- tied weights


def test_tie_word_embeddings_the_weights_contradict_loads_with_a_warning(tmp_path):
    """The checkpoint holds its own output layer: transformers keeps it (the
    model computes as the checkpoint) and the config's claim is named."""
    d = _copy(tmp_path)
    _edit_json(
        d / "config.json",
        lambda c: (c.update(tie_word_embeddings=True), c["text_config"].update(tie_word_embeddings=True)),
    )
    with pytest.warns(ModelLoadWarning) as record:
        loaded = load_model(d)
    (message,) = [str(w.message) for w in record]
    assert message.startswith(f"{d / 'config.json'} tie_word_embeddings and text_config.tie_word_embeddings are true")
    assert "lm_head.weight and model.language_model.embed_tokens.weight" in message and "not tied" in message
    assert loaded.info["warnings"] == [message]
    want = answer(load_model("shapes-llava"), IMAGE, QUESTION)
    assert answer(loaded, IMAGE, QUESTION).prob == pytest.approx(want.prob, abs=1e-6)


def test_tie_word_embeddings_the_weights_agree_with_loads_quietly(tmp_path):
    d = _copy(tmp_path)
    _edit_json(
        d / "config.json",
        lambda c: (c.update(tie_word_embeddings=True), c["text_config"].update(tie_word_embeddings=True)),
    )
    st = load_file(d / "model.safetensors")
    del st["language_model.lm_head.weight"]  # a tied model's checkpoint: the embedding is the output layer
    save_file(st, d / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelLoadWarning)
        loaded = load_model(d)
    assert loaded.model.get_output_embeddings().weight is loaded.model.get_input_embeddings().weight


# ---------------------------------------------------------------- open_clip (CoCa)

COCA_CASES = [
    # was: "The shape of the 2D attn_mask is torch.Size([2, 2])"
    (
        "model_cfg.multimodal_cfg.context_length",
        2,
        "2, shorter than model_cfg.text_cfg.context_length 32: the decoder could not hold the prompt",
    ),
    ("model_cfg.text_cfg.context_length", 0, "expected an integer from 1 to"),
    ("model_cfg.text_cfg.layers", 0, "expected an integer from 1 to"),
    ("model_cfg.multimodal_cfg.width", -128, "expected an integer from 1 to"),
    ("model_cfg.vision_cfg.patch_size", 0, "expected an integer from 1 to"),
    ("model_cfg.vision_cfg.image_size", 8, "8 is smaller than one patch"),
    ("model_cfg.vision_cfg.image_size", [54, 28], "expected an integer from 1 to"),  # found by the fuzzer
    ("model_cfg.vision_cfg.mlp_ratio", 0, "expected a finite number > 0"),
    ("model_cfg.multimodal_cfg.mlp_ratio", 1.6e283, "expected a finite number > 0 and <= 64"),  # found by the fuzzer
    ("model_cfg.embed_dim", "64", "expected an integer from 1 to"),
    # found by the fuzzer: without the towers' tokens the decoder has nothing to read (a ValueError in the forward)
    (
        "model_cfg.vision_cfg.output_tokens",
        False,
        "expected true (the CoCa decoder reads the tower's tokens), got False",
    ),
    ("model_cfg.text_cfg.output_tokens", 1, "expected true (the CoCa decoder reads the tower's tokens), got 1"),
    # was: "std evaluated to zero after conversion to torch.float32"
    ("preprocess_cfg.std", [0, 0, 0], "expected one or 3 numbers from 1.18e-38 to 3.4e+38 (one per channel)"),
    ("preprocess_cfg.std", [0.3, NAN, 0.3], "expected a finite number, got NaN"),
    # found by the fuzzer: a std > 0 that float32 holds as 0 (torchvision's ValueError at the first image)
    ("preprocess_cfg.std", 3.6e-317, "expected one or 3 numbers from 1.18e-38 to 3.4e+38"),
    ("preprocess_cfg.mean", "grey", "expected one or 3 finite numbers"),
    # found by the fuzzer: a NUL in the tokenizer's folder name (a ValueError of pathlib)
    ("model_cfg.text_cfg.hf_tokenizer_name", "tok\x00", "'tok\\x00' is not a folder name (embedded null byte)"),
    ("preprocess_cfg.interpolation", "cubic", "expected one of bicubic, bilinear, random"),
    ("preprocess_cfg.resize_mode", 3, "expected one of shortest, longest, squash"),
]


@pytest.mark.parametrize("field,value,expected", COCA_CASES, ids=[f"{f}={v!r}" for f, v, _ in COCA_CASES])
def test_open_clip_config_that_would_crash_or_compute_nan_is_refused(tmp_path, field, value, expected):
    d = _copy(tmp_path, "shapes-coca")
    _edit_json(d / "open_clip_config.json", _set(field, value))
    _refused(d, f"{d / 'open_clip_config.json'} {field}", expected)


def test_open_clip_folder_naming_no_tokenizer_is_refused(tmp_path):
    """Found by the fuzzer: open_clip's own tokenizer (49,408 ids) then reads
    the prompt into ids the 46-token model has no row for (an IndexError)."""
    d = _copy(tmp_path, "shapes-coca")
    _edit_json(d / "open_clip_config.json", lambda c: c["model_cfg"]["text_cfg"].pop("hf_tokenizer_name"))
    _refused(d, f"{d}: the tokenizer (SimpleTokenizer, open_clip's own) has 49408 tokens but the model embeds 46")


@pytest.mark.parametrize(
    "name,field,value,expected",
    [
        # found by the fuzzer: a string limit loads, then every prompt's length is compared with it (a TypeError)
        ("shapes-coca", "model_max_length", "x", "expected a number >= 1, got 'x'"),
        ("shapes-coca", "model_max_length", [512], "expected a number >= 1, got [512]"),
        ("shapes-llava", "model_max_length", -5, "expected a number >= 1, got -5"),
        ("shapes-llava", "model_max_length", INF, "expected a finite number, got Infinity"),
        # found by the fuzzer: special tokens the vocabulary lacks (endless recursion looking the unknown token up)
        ("shapes-llava", "unk_token", "", "'' is not in the tokenizer's vocabulary"),
        ("shapes-llava", "eos_token", "", "'' is not in the tokenizer's vocabulary"),
        # found by the fuzzer: no padding token, and the processor pads every batch (a ValueError at every read-out)
        ("shapes-llava", "pad_token", None, "the tokenizer has no padding token, and the processor pads every batch"),
    ],
)
def test_tokenizer_settings_every_encoding_reads_are_checked(tmp_path, name, field, value, expected):
    d = _copy(tmp_path, name)
    _edit_json(d / "tokenizer_config.json", _set(field, value))
    _refused(d, f"{d / 'tokenizer_config.json'} {field}: ", expected)


# ---------------------------------------------------------------- other families: the same rules


def _tiny_folder(tmp_path, family: str):
    from tests.core.test_trust_weights import _tiny

    model, processor = _tiny(family)
    model.save_pretrained(tmp_path, safe_serialization=True)
    processor.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("family", ["qwen2_vl", "paligemma", "idefics3"])
def test_other_families_get_the_same_refusals(tmp_path, family):
    d = _tiny_folder(tmp_path, family)
    config, processor = d / "config.json", d / "processor_config.json"
    original = config.read_text()
    _edit_json(config, _set("text_config.rms_norm_eps", -1e-6))
    _refused(d, f"{config} text_config.rms_norm_eps: expected a finite number > 0")
    config.write_text(original)
    _edit_json(config, _set("text_config.num_hidden_layers", 0))
    _refused(d, f"{config} text_config.num_hidden_layers: expected an integer from 1 to")
    config.write_text(original)
    original = processor.read_text()
    _edit_json(processor, _set("image_processor.image_std", [0.5, 0, 0.5]))
    _refused(d, f"{processor} image_processor.image_std: expected one or 3 numbers from 1.18e-38 to 3.4e+38")
    processor.write_text(original)
    _edit_json(processor, _set("image_processor.resample", 99))
    _refused(d, f"{processor} image_processor.resample: expected a resampling filter code")
    processor.write_text(original)
    load_model(d)  # restored: loads


# ---------------------------------------------------------------- files that are not regular files


def _load_within(folder, seconds: float = 60) -> str:
    """The one-line ModelLoadError of loading ``folder``, failing (not hanging) if the load blocks."""
    outcome = {}

    def attempt():
        try:
            load_model(folder)
            outcome["message"] = "loaded"
        except ReadoutError as e:
            outcome["message"] = str(e)
        except Exception as e:  # reported below: any other failure is a finding
            outcome["message"] = f"{type(e).__name__}: {e}"

    reader = threading.Thread(target=attempt, daemon=True)
    reader.start()
    reader.join(timeout=seconds)
    if reader.is_alive():  # unblock it: open every FIFO for writing once
        for f in folder.rglob("*"):
            if f.is_fifo():
                fd = os.open(f, os.O_WRONLY | os.O_NONBLOCK)
                os.close(fd)
        pytest.fail(f"load_model blocked on {folder}")
    assert "\n" not in outcome["message"]
    return outcome["message"]


FIFO_FILES = [
    ("shapes-llava", "config.json"),
    ("shapes-llava", "model.safetensors"),
    ("shapes-llava", "tokenizer.json"),
    ("shapes-llava", "tokenizer_config.json"),
    ("shapes-llava", "processor_config.json"),
    ("shapes-llava", "preprocessor_config.json"),  # not in the folder: a FIFO the library would open by name
    ("shapes-llava", "chat_template.jinja"),
    ("shapes-llava", "generation_config.json"),
    ("shapes-llava", "additional_chat_templates/tool_use.jinja"),
    ("shapes-llava", "notes.txt"),  # a name the load never reads: still not a model folder's
    ("shapes-llava", MANIFEST),
    ("shapes-coca", "open_clip_config.json"),
    ("shapes-coca", "open_clip_model.safetensors"),
    ("shapes-coca", "tokenizer.json"),
]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("name,file", FIFO_FILES, ids=[f"{n}/{f}" for n, f in FIFO_FILES])
def test_fifo_in_a_model_folder_is_refused_without_blocking(tmp_path, name, file):
    d = _copy(tmp_path, name)
    f = d / file
    f.parent.mkdir(exist_ok=True)
    if f.exists():
        f.unlink()
    os.mkfifo(f)
    assert _load_within(d) == (
        f"{f}: not a regular file (a FIFO, socket or device); a model folder holds regular files only"
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_links_to_regular_files_load_and_other_links_are_refused(tmp_path):
    """A Hugging Face cache snapshot links every file to a blob: that loads. A
    link to a FIFO, a broken link and a socket do not."""
    d = _copy(tmp_path)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (d / name).rename(blobs / name)
        (d / name).symlink_to(blobs / name)
    assert _load_within(d) == "loaded"
    os.mkfifo(blobs / "pipe")
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to(blobs / "pipe")
    assert _load_within(d).startswith(f"{d / 'tokenizer.json'}: not a regular file (a FIFO")
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to(blobs / "gone.json")
    assert _load_within(d) == f"{d / 'tokenizer.json'}: a broken symbolic link (what it names does not exist)"
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to(blobs / "tokenizer.json")
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # a socket's path must be short
        sock_path = os.path.join(short, "s")
        server = socket.socket(socket.AF_UNIX)
        try:
            server.bind(sock_path)
            (d / "socket").symlink_to(sock_path)
            assert _load_within(d).startswith(f"{d / 'socket'}: not a regular file")
        finally:
            server.close()


def test_an_open_clip_name_checkpoint_config_is_checked_as_a_folders_is(tmp_path, monkeypatch):
    """``name:checkpoint`` builds from open_clip's own config for ``name``: its
    sizes plan the memory, so they are checked as a folder's are (was: int() of
    whatever the config held)."""
    import copy

    import open_clip
    import torch

    cfg = copy.deepcopy(open_clip.get_model_config("coca_ViT-B-32"))
    cfg["multimodal_cfg"]["layers"] = -1
    monkeypatch.setattr(open_clip, "get_model_config", lambda name: cfg)
    ckpt = tmp_path / "c.safetensors"
    save_file({"x": torch.zeros(1)}, ckpt)
    with pytest.raises(ModelLoadError) as e:
        load_model(f"coca_ViT-B-32:{ckpt}")
    assert str(e.value).startswith("open_clip's coca_ViT-B-32 config model_cfg.multimodal_cfg.layers: "), e.value


def test_fifo_in_an_open_clip_tokenizer_folder_is_refused(tmp_path):
    d = _copy(tmp_path, "shapes-coca")
    (d / "tok").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).rename(d / "tok" / name)
    _edit_json(d / "open_clip_config.json", _set("model_cfg.text_cfg.hf_tokenizer_name", "tok"))
    os.mkfifo(d / "tok" / "special_tokens_map.json")
    assert _load_within(d).startswith(f"{d / 'tok' / 'special_tokens_map.json'}: not a regular file")


# ---------------------------------------------------------------- non-finite logits


def _overflowing_copy(tmp_path):
    """A folder whose weights are finite but whose logits overflow to Inf (a
    float16 overflow's float32 twin): every load-time check passes."""
    d = _copy(tmp_path)
    st = load_file(d / "model.safetensors")
    st["language_model.lm_head.weight"] = st["language_model.lm_head.weight"].sign() * 3e38
    save_file(st, d / "model.safetensors", metadata={"format": "pt"})
    return d


def test_non_finite_logits_are_never_an_answer(tmp_path):
    loaded = load_model(_overflowing_copy(tmp_path))
    for run in (lambda: answer(loaded, IMAGE, QUESTION), lambda: analyze(loaded, IMAGE, QUESTION)):
        with pytest.raises(NonFiniteError) as e:
            run()
        text = str(e.value)
        assert text.startswith(f"{loaded.spec}: the forward gave non-finite logits at the answer position (")
        assert text.endswith(
            "so there is no result: check the model's config and processor config (norm epsilons, "
            "rope_theta, image_std, rescale_factor) or, in float16, load it in float32"
        )
        assert " of 46)" in text and "\n" not in text


def test_every_forward_path_refuses_non_finite_logits(tmp_path):
    """Not only answer and analyze: the check sits where the forwards run
    (Adapter.next_token_logits, the decoding steps, capture), so generation,
    counterfactuals, interventions, the dataset audit and validation, which
    call those and not answer, refuse the same way."""
    loaded = load_model(_overflowing_copy(tmp_path))
    adapter = loaded.adapter
    inputs = adapter.prepare([load_image(IMAGE)], [QUESTION])
    runs = {
        "next_token_logits": lambda: adapter.next_token_logits(inputs),
        "capture": lambda: capture(loaded, None, "", inputs=inputs, pattern_layers=[]),
        "cached prefill": lambda: adapter.start_decoding(inputs),
        "re-run decoding": lambda: adapter.start_decoding(inputs, use_cache=False),
        "generate": lambda: generate(loaded, IMAGE, QUESTION, max_new_tokens=2),
    }
    for name, run in runs.items():
        with pytest.raises(
            NonFiniteError, match=r"non-finite logits at the answer position \(0 NaN, 46 Inf of 46\)"
        ) as e:
            run()
        assert str(e.value).startswith(f"{loaded.spec}: ") and "\n" not in str(e.value), name


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--max-new-tokens", "2"],
        ["counterfactual", "--mask", str(IMAGE.with_name("sample_00_obj1.png"))],
        ["nonunique", "--head", "L1.H2"],
    ],
    ids=lambda c: c[0],
)
def test_commands_past_answer_refuse_non_finite_logits(tmp_path, capsys, command):
    d = _overflowing_copy(tmp_path)
    out = tmp_path / "out.json"
    out.write_text('{"kept": true}')
    argv = [command[0], "--model", str(d), "--image", str(IMAGE), "--question", QUESTION, *command[1:]]
    assert main([*argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {d}: the forward gave non-finite logits"), err
    assert out.read_text() == '{"kept": true}'


def test_cli_refuses_non_finite_logits_and_keeps_the_old_output(tmp_path, capsys):
    d = _overflowing_copy(tmp_path)
    out = tmp_path / "analyze.json"
    out.write_text('{"kept": true}')
    argv = ["analyze", "--model", str(d), "--image", str(IMAGE), "--question", QUESTION, "--json", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {d}: the forward gave non-finite logits"), err
    assert "Traceback" not in err and out.read_text() == '{"kept": true}'


# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    "file,edit,needle",
    [
        ("config.json", _set("text_config.rms_norm_eps", NAN), "config.json text_config.rms_norm_eps: expected"),
        ("config.json", _set("vision_feature_layer", 99), "config.json vision_feature_layer: 99 is not"),
        ("processor_config.json", _set("image_processor.resample", 99), "image_processor.resample: expected"),
        ("processor_config.json", _set("image_processor.image_std", [0, 0, 0]), "image_processor.image_std"),
        ("processor_config.json", _set("num_additional_image_tokens", 0), "num_additional_image_tokens: 0"),
    ],
)
def test_cli_answers_each_class_with_one_error_line(tmp_path, capsys, file, edit, needle):
    d = _copy(tmp_path)
    _edit_json(d / file, edit)
    assert main(["answer", "--model", str(d), "--image", str(IMAGE), "--question", QUESTION]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {d}") and needle in lines[0], captured.err
    assert "Traceback" not in captured.err and captured.out == ""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_cli_process_refuses_a_fifo_weights_file_without_hanging(tmp_path):
    d = _copy(tmp_path)
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")
    argv = ["answer", "--model", str(d), "--image", str(IMAGE), "--question", QUESTION]
    run = subprocess.run([sys.executable, "-m", "core.cli", *argv], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stdout == "", run
    assert run.stderr.splitlines() == [
        f"error: {d / 'model.safetensors'}: not a regular file (a FIFO, socket or device); "
        "a model folder holds regular files only"
    ]


def test_cli_prints_the_tie_warning_as_one_line_and_answers(tmp_path, capsys):
    d = _copy(tmp_path)
    _edit_json(d / "config.json", _set("tie_word_embeddings", True))
    assert main(["answer", "--model", str(d), "--image", str(IMAGE), "--question", QUESTION]) == 0
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: {d / 'config.json'} tie_word_embeddings is true")
    assert captured.out.startswith("square\t")


def test_the_shipped_models_pass_every_check():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelLoadWarning)
        for name in ("shapes-llava", "shapes-coca"):
            assert math.isfinite(answer(load_model(name), IMAGE, QUESTION).prob)
