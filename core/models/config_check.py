"""The one place for the numeric sanity of a model's configuration and its
processor's settings, and for their agreement: checked at load, before the
weights (config.json, open_clip_config.json) and before any forward (the
processor), so a config that would crash the forward (``patch_size`` 0,
``vision_feature_layer`` 99) or silently compute NaN (``rms_norm_eps`` NaN or
negative, ``rope_theta`` 0, an ``image_std`` of 0) is refused in one
:class:`core.errors.ModelLoadError` line naming the file and the field.

What is checked (docs/ARCHITECTURE.md, "Trust rules"):

* config.json, every section, by field name: norm epsilons (``*_eps``,
  ``*_epsilon``) finite and > 0; ``rope_theta`` and the other scales finite and
  > 0; layer counts, widths, heads, vocabulary, patch and image sizes integers
  from 1 to :data:`MAX_SIZE`; ``vision_feature_select_strategy`` "default" or
  "full"; ``tie_word_embeddings`` a boolean. Then across fields: the tower's
  image at least one patch, ``vision_feature_layer`` a hidden state the tower
  has (``-(n + 1)`` to ``n``).
* the processor: a processor holding a tokenizer and an image processor; the
  image processor's ``do_*`` switches booleans and each step's setting present;
  ``rescale_factor`` and ``image_std`` inside float32's positive range,
  ``image_mean`` finite (one value or one per channel); ``resample`` a filter
  the processor has; sizes and crop sizes integers of at least one tower patch
  (a crop of at most :data:`core.files.images.MAX_PIXELS`); the processor's own
  ``patch_size``, ``num_additional_image_tokens`` and
  ``vision_feature_select_strategy``; then one run on a small probe image
  (:func:`probe_image_processor`: any other setting the library trips on).
* processor against model: the same feature-select strategy; for LLaVA (a
  fixed-size tower) the crop is the tower's image size, the patch sizes agree
  and the image tokens the processor writes are the features the tower and
  projector give (:func:`llava_image_features`, also ``image_seq_length``).
* chat templates: a template that is present is not empty.
* open_clip: the model_cfg sizes (integers: a square tower), CoCa's decoder
  reading both towers' tokens and its context holding the text tower's,
  ``preprocess_cfg`` mean / std / interpolation / resize mode.

A forward the load-time arithmetic cannot foresee (another family's tiling)
still meets the model's own check; :func:`core.models.forward_checks.model_input_errors`
turns that into one line naming the configs that disagree.
"""

from __future__ import annotations

import math
from pathlib import Path

from core.errors import ModelLoadError
from core.files.images import MAX_PIXELS
from core.files.input_files import read_regular_bytes
from core.models.config_fields import config_value, size_value
from core.models.model_files import read_json

# Any size a config states (layers, widths, vocabulary, positions, a processor's
# pixel budget) is at most this: larger would have the library allocate without
# bound before any weight is read (real models stay below: 262,144-token
# vocabularies, 10M positions, Qwen3-VL's 16,777,216-pixel budget).
MAX_SIZE = 2**26
STRATEGIES = ("default", "full")

# config.json fields, in any section, that count or measure something: integers >= 1.
_SIZE_FIELDS = frozenset(
    {
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_size",
        "intermediate_size",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "patch_size",
        "image_size",
        "num_channels",
    }
)
# Counts of modules the library builds one by one (layers, experts): at most
# MAX_MODULES, since even on the meta device each is Python objects and time
# (real models: 126 decoder layers, 256 experts).
MAX_MODULES = 1024
_MODULE_COUNTS = frozenset(
    {"num_hidden_layers", "num_global_layers", "resampler_depth", "num_experts", "num_local_experts", "layers"}
)
# Sizes that may be a [height, width] pair (InternVL's tower).
_PAIR_FIELDS = ("image_size", "patch_size")
# Sizes that may be a list, one per layer (Gemma 3n's MLP widths).
_PER_LAYER_FIELDS = ("intermediate_size",)
# Scales a value is multiplied or divided by: finite and > 0 (None: not applied).
_POSITIVE_FIELDS = frozenset(
    {
        "rope_theta",
        "rope_local_base_freq",
        "logit_scale",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "query_pre_attn_scalar",
    }
)
# Image processor settings a step needs when its switch is on.
_SWITCHED_SETTINGS = {
    "rescale_factor": "do_rescale",
    "image_mean": "do_normalize",
    "image_std": "do_normalize",
    "size": "do_resize",
    "crop_size": "do_center_crop",
}
# float32's smallest normal and largest finite value: the processors normalise
# pixels in float32, where a smaller std is 0 and a larger one Infinity.
_FLOAT32_TINY = 1.1754943508222875e-38
_FLOAT32_MAX = 3.4028234663852886e38
# An open_clip tower's MLP is at most this many times its width (real ones: 2 to 4.4).
_MAX_MLP_RATIO = 64
# Sections of RoPE settings, whose ``factor`` scales the positions.
_ROPE_SECTIONS = ("rope_scaling", "rope_parameters")
# Vision towers of a LLaVA-style model: the tokens they add to the patches (CLIP's class token).
_TOWER_EXTRA_TOKENS = {"clip_vision_model": 1, "siglip_vision_model": 0}
# Messages transformers raises when the processor's image tokens and the model's
# image features or input size disagree (checked in the forward, not at load).
# A chat template file larger than this is refused (real ones are a few KB).
_MAX_TEMPLATE_BYTES = 1 << 20


def _shown(value) -> str:
    return repr(value)[:80]


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_eps(key: str) -> bool:
    return key in ("eps", "epsilon") or key.endswith(("_eps", "_epsilon"))


def _size_problem(value, pair: bool = False, most: int = MAX_SIZE) -> str | None:
    """Why ``value`` is not a size (an integer from 1 to ``most``; with ``pair``,
    also a list of one or two of them: an image or patch size as [height,
    width]); None if it is."""

    def one(v) -> bool:
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= most

    if one(value) or (pair and isinstance(value, list | tuple) and len(value) in (1, 2) and all(map(one, value))):
        return None
    pairs = " (or a [height, width] pair of them)" if pair else ""
    return f"expected an integer from 1 to {most:,}{pairs}, got {_shown(value)}"


def _positive_problem(value, lower: float | None = None, upper: float | None = None) -> str | None:
    """Why ``value`` is not a finite number > 0 (and from ``lower`` to ``upper``); None if it is."""
    if _is_number(value) and math.isfinite(value) and value > 0:
        if (lower is None or value >= lower) and (upper is None or value <= upper):
            return None
    if lower is not None:
        return f"expected a number from {lower:.3g} to {upper:.3g}, got {_shown(value)}"
    bound = f" and <= {upper}" if upper is not None else ""
    return f"expected a finite number > 0{bound}, got {_shown(value)}"


def check_config_json(config_file: Path, config: dict) -> None:
    """Every section of config.json as written, by field name (see the module
    docstring); before the library reads it, so its own failures (a division by
    a zero patch size) never come first. Non-finite numbers were refused by
    :func:`core.models.model_files.read_json`."""
    stack = [("", config, False)]
    while stack:
        prefix, section, in_rope = stack.pop()
        for key, value in section.items():
            problem = _field_problem(key, value, in_rope)
            if problem is not None:
                raise ModelLoadError(f"{config_file} {prefix}{key}: {problem}")
            if isinstance(value, dict):
                stack.append((f"{prefix}{key}.", value, in_rope or key in _ROPE_SECTIONS))


def _field_problem(key: str, value, in_rope: bool) -> str | None:
    """What is wrong with config.json's ``key: value`` by the field's name (None: nothing, or a field not checked)."""
    if _is_eps(key):
        return _positive_problem(value)
    if key == "vision_feature_layer" and not _layer_indices(value):  # None too: the model indexes with it
        return f"expected a layer index or a non-empty list of them, got {_shown(value)}"
    if value is None:  # an optional setting left unset
        return None
    if key in _POSITIVE_FIELDS or (in_rope and key == "factor"):
        return _positive_problem(value)
    if key == "partial_rotary_factor":
        return _positive_problem(value, upper=1)  # the fraction of each head rotated
    if key in _MODULE_COUNTS:
        return _size_problem(value, most=MAX_MODULES)
    if key in _PER_LAYER_FIELDS and isinstance(value, list) and value:
        return next((p for p in (_size_problem(v) for v in value) if p is not None), None)
    if key in _SIZE_FIELDS:
        return _size_problem(value, pair=key in _PAIR_FIELDS)
    if key == "vision_feature_select_strategy" and value not in STRATEGIES:
        return f"expected 'default' or 'full', got {_shown(value)}"
    if key == "tie_word_embeddings" and not isinstance(value, bool):
        return f"expected true or false, got {_shown(value)}"
    return None


def _layer_indices(value) -> list[int]:
    """``vision_feature_layer`` as a list of ints ([] if it is not one int or a non-empty list of ints)."""
    values = value if isinstance(value, list | tuple) else [value]
    if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return list(values)
    return []


def _pair(value) -> tuple[int, int] | None:
    """An image or patch size as (height, width): an int, or a list of one or two."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if isinstance(value, list | tuple) and len(value) in (1, 2) and all(isinstance(v, int) for v in value):
        return (value[0], value[-1])
    return None


def check_config_consistency(config_file: Path, config) -> None:
    """Across fields of the library's config object (its defaults filled in):
    the tower's image holds at least one patch, and ``vision_feature_layer``
    names a hidden state the tower has (its ``n`` layers give ``n + 1``)."""
    size = _pair(config_value(config, "vision_config.image_size"))
    patch = _pair(config_value(config, "vision_config.patch_size"))
    if size and patch and (size[0] < patch[0] or size[1] < patch[1]):
        raise ModelLoadError(
            f"{config_file} vision_config.image_size: {size[0]}x{size[1]} is smaller than one "
            f"{patch[0]}x{patch[1]} patch (vision_config.patch_size): the tower would see no patch"
        )
    layer = config_value(config, "vision_feature_layer")
    n = config_value(config, "vision_config.num_hidden_layers")
    if layer is not None and isinstance(n, int):
        bad = [i for i in _layer_indices(layer) if not -(n + 1) <= i <= n]
        if layer == 0 and not isinstance(layer, bool):  # transformers asks the tower for hidden states only if truthy
            raise ModelLoadError(
                f"{config_file} vision_feature_layer: 0 (the tower's embeddings) makes transformers keep no hidden "
                f"state, so the forward fails; write {-(n + 1)}, the same state counted from the end"
            )
        if bad:
            raise ModelLoadError(
                f"{config_file} vision_feature_layer: {bad[0]} is not a hidden state of the {n}-layer vision tower "
                f"(expected {-(n + 1)} to {n})"
            )


def llava_image_features(config) -> tuple[int, str] | None:
    """``(features, how)``: how many image features a LLaVA-style model's tower
    and projector give for one image (the image tokens its prompt must hold),
    from config.json alone; None when the tower is not one whose class tokens
    are known (CLIP: one, SigLIP: none)."""
    extra = _TOWER_EXTRA_TOKENS.get(config_value(config, "vision_config.model_type"))
    size = config_value(config, "vision_config.image_size")
    patch = config_value(config, "vision_config.patch_size")
    strategy = config_value(config, "vision_feature_select_strategy")
    if extra is None or not isinstance(size, int) or not isinstance(patch, int) or patch < 1:
        return None
    side = size // patch
    dropped = 1 if strategy == "default" else 0
    how = f"({size}/{patch})^2 patches" + (f" + {extra} class token" if extra else "")
    how += f", {'less the first' if dropped else 'all kept'} under vision_feature_select_strategy {strategy!r}"
    return side * side + extra - dropped, how


def check_image_seq_length(config) -> None:
    """LLaVA's ``image_seq_length`` (what the length check counts for the image)
    must be the image features the tower gives (LLaVA 1.5's fixed count; the
    families built on LLaVA count their tiles otherwise)."""
    if config_value(config, "model_type") != "llava":
        return
    stated = config_value(config, "image_seq_length")
    features = llava_image_features(config)
    if stated is None or features is None or stated == features[0]:
        return
    raise ModelLoadError(
        f"config.json image_seq_length: {stated}, but the vision tower gives {features[0]} image features "
        f"({features[1]})"
    )


# ---------------------------------------------------------------- the processor


class _ProcessorFields:
    """Where a processor setting was written, for messages: the file (and
    section) holding it, else the processor's default. Image processor
    settings live in processor_config.json's ``image_processor`` or in
    preprocessor_config.json; the processor's own in processor_config.json
    (older folders: preprocessor_config.json)."""

    def __init__(self, folder: Path):
        self.image: list[tuple[Path, str, dict]] = []
        self.processor: list[tuple[Path, str, dict]] = []
        combined = folder / "processor_config.json"
        if combined.is_file():
            doc = read_json(combined)
            if isinstance(doc.get("image_processor"), dict):
                self.image.append((combined, "image_processor.", doc["image_processor"]))
            self.processor.append((combined, "", doc))
        older = folder / "preprocessor_config.json"
        if older.is_file():
            doc = read_json(older)
            self.image.append((older, "", doc))
            self.processor.append((older, "", doc))

    def label(self, field: str, image_processor: bool = True) -> str:
        for f, prefix, doc in self.image if image_processor else self.processor:
            if field in doc:
                return f"{f} {prefix}{field}"
        return f"the processor's {field} (its default)"


def check_processor(folder: Path, processor, config) -> None:
    """The processor's settings (see the module docstring), then its agreement
    with the model's config; after the processor is built, before any forward."""
    fields = _ProcessorFields(folder)
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None or not callable(getattr(getattr(processor, "tokenizer", None), "encode", None)):
        raise ModelLoadError(
            f"{fields.label('processor_class', False)}: the folder's processor files make a "
            f"{type(processor).__name__}, not a processor holding a tokenizer and an image processor"
        )
    if image_processor is not None:
        channels = config_value(config, "vision_config.num_channels")
        patch = _pair(config_value(config, "vision_config.patch_size"))
        _check_image_processor(
            fields, image_processor, channels if isinstance(channels, int) else 3, min(patch) if patch else 1
        )
    for name, minimum in (("patch_size", 1), ("num_additional_image_tokens", 0), ("image_seq_length", 1)):
        value = getattr(processor, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            raise ModelLoadError(f"{fields.label(name, False)}: expected an integer >= {minimum}, got {_shown(value)}")
    strategy = getattr(processor, "vision_feature_select_strategy", None)
    if strategy is not None and strategy not in STRATEGIES:
        raise ModelLoadError(
            f"{fields.label('vision_feature_select_strategy', False)}: expected 'default' or 'full', got {_shown(strategy)}"
        )
    model_strategy = config_value(config, "vision_feature_select_strategy")
    if strategy is not None and model_strategy is not None and strategy != model_strategy:
        raise ModelLoadError(
            f"{fields.label('vision_feature_select_strategy', False)}: {strategy!r}, but config.json "
            f"vision_feature_select_strategy is {model_strategy!r}: the processor would write a different number "
            "of image tokens than the model gives image features"
        )
    if config_value(config, "model_type") == "llava" and image_processor is not None:
        _check_llava_processor(fields, processor, image_processor, config)


def _normalization_problem(value, std: bool, channels: int) -> str | None:
    """Why a mean (``std`` False) or std setting is not one value or one per
    channel, each inside float32's range (the pixels are normalised in float32:
    a std of 1e-300 is 0 there, 1e300 is Infinity) and a std > 0; None if it is."""
    values = list(value) if isinstance(value, list | tuple) else [value]
    if values and len(values) in (1, channels) and all(_is_number(v) and math.isfinite(v) for v in values):
        low = _FLOAT32_TINY if std else -_FLOAT32_MAX
        if all(low <= v <= _FLOAT32_MAX for v in values):
            return None
    what = f"numbers from {_FLOAT32_TINY:.3g} to {_FLOAT32_MAX:.3g}" if std else "finite numbers"
    return f"expected one or {channels} {what} (one per channel), got {_shown(value)}"


def _check_image_processor(fields: _ProcessorFields, ip, channels: int, patch: int) -> None:
    """``patch``: the tower's patch side; an image resized or cropped smaller
    holds no patch (and a resize to 1 x 1 fails inside torch's antialiasing)."""
    for name, value in sorted(vars(ip).items()):  # the steps' switches (do_resize, do_rescale, ...)
        if name.startswith("do_") and value is not None and not isinstance(value, bool):
            raise ModelLoadError(f"{fields.label(name)}: expected true or false, got {_shown(value)}")
    for name, switch in _SWITCHED_SETTINGS.items():  # the processor's own check, at the first image otherwise
        if getattr(ip, switch, False) and getattr(ip, name, None) is None:
            raise ModelLoadError(f"{fields.label(name)}: missing or null, but {switch} is true (it needs this setting)")
    rescale = getattr(ip, "rescale_factor", None)
    if rescale is not None and (why := _positive_problem(rescale, _FLOAT32_TINY, _FLOAT32_MAX)) is not None:
        raise ModelLoadError(f"{fields.label('rescale_factor')}: {why}")
    for name, std in (("image_mean", False), ("image_std", True)):
        value = getattr(ip, name, None)
        if value is not None and (why := _normalization_problem(value, std, channels)) is not None:
            raise ModelLoadError(f"{fields.label(name)}: {why}")
    _check_resample(fields, getattr(ip, "resample", None))
    for name in ("size", "crop_size", "max_image_size", "patch_size"):
        value = getattr(ip, name, None)
        if value is None:
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            entries = {"": value}
        else:
            keys = ("height", "width", "shortest_edge", "longest_edge", "max_height", "max_width")
            entries = {f".{k}": size_value(value, k) for k in keys}
        for key, v in entries.items():
            if v is not None and _size_problem(v) is not None:
                raise ModelLoadError(f"{fields.label(name)}{key}: {_size_problem(v)}")
            if v is not None and name != "patch_size" and v < patch:
                raise ModelLoadError(
                    f"{fields.label(name)}{key}: {v} is smaller than one {patch}-pixel patch "
                    "(config.json vision_config.patch_size): the image would hold no patch"
                )
    for name in ("merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
        value = getattr(ip, name, None)
        if value is not None and _size_problem(value) is not None:
            raise ModelLoadError(f"{fields.label(name)}: {_size_problem(value)}")
    crop = getattr(ip, "crop_size", None)
    height, width = size_value(crop, "height"), size_value(crop, "width")
    if getattr(ip, "do_center_crop", False) and isinstance(height, int) and isinstance(width, int):
        if height * width > MAX_PIXELS:  # the crop pads a smaller image up to it
            raise ModelLoadError(
                f"{fields.label('crop_size')}: {height}x{width} is over the {MAX_PIXELS:,}-pixel limit"
            )


def _probe_could_exceed_budget(ip) -> bool:
    """Whether the size settings could resize the small probe image past
    :data:`core.files.images.MAX_PIXELS` (a shortest edge of 60,000 px makes a 64x48
    probe 60,000 x 80,000): the probe must not be what allocates the bomb."""
    sides = []
    for name in ("size", "crop_size", "max_image_size"):
        value = getattr(ip, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            sides.append(value)
        elif value is not None:
            # longest_edge only bounds the longer side (Qwen's is max_pixels, which smart_resize keeps)
            keys = ("height", "width", "shortest_edge", "max_height", "max_width")
            sides += [v for k in keys if isinstance(v := size_value(value, k), int | float)]
    for name in ("max_pixels", "min_pixels"):
        value = getattr(ip, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > MAX_PIXELS:
            return True
    # a side s gives at most s x (s * 4 / 3) pixels from the 4:3 probe (aspect kept) or s x s (stretched)
    return any(s * s * 4 / 3 > MAX_PIXELS for s in sides)


def probe_image_processor(folder: Path, processor) -> None:
    """Run the image processor (a Hugging Face processor's ``image_processor``,
    or open_clip's transform) once on a small probe image at load: a setting no
    check above names (a device, a data format, a type the library trips on)
    fails here, in one line naming the config, not at the first read-out; and
    the pixels it gives must be finite. Cheap: no model runs."""
    import numpy as np
    import torch
    from PIL import Image

    image_processor = getattr(processor, "image_processor", None)
    if image_processor is not None and _probe_could_exceed_budget(image_processor):
        return  # its resize alone could be the bomb: the per-image resize check refuses it, naming the setting
    if image_processor is not None:
        names = ("processor_config.json", "preprocessor_config.json")

        def run(image):
            return dict(image_processor(images=[image], return_tensors="pt"))
    elif callable(processor):  # open_clip: a torchvision transform of one image
        names = ("open_clip_config.json",)

        def run(image):
            return {"pixels": processor(image)}
    else:
        return
    y, x = np.mgrid[0:48, 0:64]
    probe = Image.fromarray(np.stack([x * 4, y * 5, (x + y) * 2], axis=-1).astype(np.uint8))
    where = " / ".join(str(folder / f) for f in names if (folder / f).is_file()) or f"{folder}: the image processor"
    try:
        out = run(probe)
    except Exception as e:  # the library's own failure on its settings, whatever its type
        first = (str(e).splitlines() or [""])[0][:200]
        raise ModelLoadError(
            f"{where}: the image processor fails on a 64x48 probe image ({type(e).__name__}: {first})"
        ) from None
    for key, value in out.items():
        if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ModelLoadError(
                f"{where}: the image processor turns a 64x48 probe image into non-finite {key} "
                "(its rescale factor, mean or std)"
            )


def _check_resample(fields: _ProcessorFields, resample) -> None:
    """A PIL filter code the processor can map (0 to 5), or torchvision's mode."""
    if resample is None:
        return
    try:
        from torchvision.transforms import InterpolationMode

        if isinstance(resample, InterpolationMode):
            return
    except ImportError:  # no torchvision: transformers resizes with PIL
        pass
    if isinstance(resample, int) and not isinstance(resample, bool) and 0 <= resample <= 5:
        return
    raise ModelLoadError(
        f"{fields.label('resample')}: expected a resampling filter code 0 to 5 (PIL's NEAREST, LANCZOS, "
        f"BILINEAR, BICUBIC, BOX, HAMMING), got {_shown(resample)}"
    )


def _check_llava_processor(fields: _ProcessorFields, processor, ip, config) -> None:
    """LLaVA's tower reads images of exactly ``vision_config.image_size`` (its
    position embeddings are fixed) and the processor writes
    ``(crop / patch_size)^2 + num_additional_image_tokens`` image tokens, less
    one under the "default" strategy: that must be what the tower gives."""
    size = config_value(config, "vision_config.image_size")
    patch = config_value(config, "vision_config.patch_size")
    if not isinstance(size, int) or not isinstance(patch, int):
        return
    crop = getattr(ip, "crop_size", None) if getattr(ip, "do_center_crop", False) else None
    resized = getattr(ip, "size", None)
    if crop is not None:
        shape, setting = (size_value(crop, "height"), size_value(crop, "width")), "crop_size"
    elif size_value(resized, "height") is not None:
        shape, setting = (size_value(resized, "height"), size_value(resized, "width")), "size"
    else:
        raise ModelLoadError(
            f"{fields.label('do_center_crop')}: the processor neither crops nor resizes to a fixed size, but "
            f"the vision tower reads {size}x{size} images only (config.json vision_config.image_size)"
        )
    if shape != (size, size):
        raise ModelLoadError(
            f"{fields.label(setting)}: {shape[0]}x{shape[1]}, but the vision tower reads {size}x{size} images "
            "(config.json vision_config.image_size)"
        )
    written_patch = getattr(processor, "patch_size", None)
    if written_patch != patch:
        raise ModelLoadError(
            f"{fields.label('patch_size', False)}: {written_patch}, but config.json vision_config.patch_size is "
            f"{patch}: the processor would count the image tokens on another grid"
        )
    features = llava_image_features(config)
    if features is None:
        return
    extra = int(getattr(processor, "num_additional_image_tokens", 0) or 0)
    written = (size // patch) ** 2 + extra - (1 if processor.vision_feature_select_strategy == "default" else 0)
    if written != features[0]:
        raise ModelLoadError(
            f"{fields.label('num_additional_image_tokens', False)}: {extra}, so the processor would write {written} "
            f"image tokens, but the vision tower gives {features[0]} image features ({features[1]})"
        )


def check_chat_templates(folder: Path) -> None:
    """A chat template that is present must hold a template: an empty one
    (chat_template.jinja, additional_chat_templates/*.jinja, or the
    ``chat_template`` field of chat_template.json, tokenizer_config.json or
    processor_config.json) would make the prompt fall back, silently, to the
    family's own."""
    files = [folder / "chat_template.jinja", *sorted((folder / "additional_chat_templates").glob("*.jinja"))]
    for f in files:
        if f.exists():
            text = read_regular_bytes(f, ModelLoadError, _MAX_TEMPLATE_BYTES)
            if not text.strip():
                raise ModelLoadError(f"{f}: empty chat template (expected the template's text, or no such file)")
    for name in ("chat_template.json", "tokenizer_config.json", "processor_config.json"):
        f = folder / name
        if not f.is_file():
            continue
        doc = read_json(f)
        if "chat_template" not in doc or (doc["chat_template"] is None and name != "chat_template.json"):
            continue
        template = doc["chat_template"]
        entries = template if isinstance(template, list) else [{"template": template}]
        for i, entry in enumerate(entries):
            text = entry.get("template") if isinstance(entry, dict) else None
            where = f"chat_template[{i}].template" if isinstance(template, list) else "chat_template"
            if not isinstance(text, str) or not text.strip():
                raise ModelLoadError(f"{f} {where}: expected a non-empty template string, got {_shown(text)}")


# ---------------------------------------------------------------- open_clip


def check_open_clip_config(config_file: Path, cfg: dict, model_cfg: dict) -> None:
    """open_clip_config.json: the towers' sizes, the multimodal decoder's
    context holding the text tower's (its causal mask is that long), and
    ``preprocess_cfg``'s normalisation and resize settings."""
    for section in ("vision_cfg", "text_cfg", "multimodal_cfg"):
        fields = model_cfg.get(section, {})
        for key in (
            "width",
            "layers",
            "heads",
            "head_width",
            "image_size",
            "patch_size",
            "context_length",
            "vocab_size",
        ):
            # integers only: the CoCa geometry maps a square tower image of square patches
            most = MAX_MODULES if key in _MODULE_COUNTS else MAX_SIZE
            if key in fields and (why := _size_problem(fields[key], most=most)) is not None:
                raise ModelLoadError(f"{config_file} model_cfg.{section}.{key}: {why}")
        if "mlp_ratio" in fields and (why := _positive_problem(fields["mlp_ratio"], upper=_MAX_MLP_RATIO)) is not None:
            raise ModelLoadError(f"{config_file} model_cfg.{section}.mlp_ratio: {why}")
    if "embed_dim" in model_cfg and (why := _size_problem(model_cfg["embed_dim"])) is not None:
        raise ModelLoadError(f"{config_file} model_cfg.embed_dim: {why}")
    vision = model_cfg.get("vision_cfg", {})
    size, patch = _pair(vision.get("image_size", 224)), _pair(vision.get("patch_size", 16))
    if size and patch and (size[0] < patch[0] or size[1] < patch[1]):
        raise ModelLoadError(
            f"{config_file} model_cfg.vision_cfg.image_size: {vision.get('image_size')} is smaller than one patch "
            f"(patch_size {vision.get('patch_size')}): the tower would see no patch"
        )
    if "multimodal_cfg" in model_cfg:
        for section in ("vision_cfg", "text_cfg"):  # CoCa's decoder reads both towers' tokens
            fields = model_cfg.get(section, {})
            if fields.get("output_tokens") is not True:
                got = (
                    _shown(fields["output_tokens"])
                    if "output_tokens" in fields
                    else "nothing (open_clip's default: false)"
                )
                raise ModelLoadError(
                    f"{config_file} model_cfg.{section}.output_tokens: expected true (the CoCa decoder reads the "
                    f"tower's tokens), got {got}"
                )
        text_length = model_cfg.get("text_cfg", {}).get("context_length", 77)
        decoder_length = model_cfg["multimodal_cfg"].get("context_length", 77)
        if decoder_length < text_length:
            raise ModelLoadError(
                f"{config_file} model_cfg.multimodal_cfg.context_length: {decoder_length}, shorter than "
                f"model_cfg.text_cfg.context_length {text_length}: the decoder could not hold the prompt"
            )
    _check_open_clip_preprocess(config_file, cfg.get("preprocess_cfg"))


def _check_open_clip_preprocess(config_file: Path, preprocess) -> None:
    if preprocess is None:
        return
    if not isinstance(preprocess, dict):
        raise ModelLoadError(f"{config_file} preprocess_cfg: expected an object, got {type(preprocess).__name__}")
    for name, std in (("mean", False), ("std", True)):
        if name in preprocess and (why := _normalization_problem(preprocess[name], std, 3)) is not None:
            raise ModelLoadError(f"{config_file} preprocess_cfg.{name}: {why}")
    choices = {"interpolation": ("bicubic", "bilinear", "random"), "resize_mode": ("shortest", "longest", "squash")}
    for name, allowed in choices.items():
        if name in preprocess and preprocess[name] not in allowed:
            raise ModelLoadError(
                f"{config_file} preprocess_cfg.{name}: expected one of {', '.join(allowed)}, got {_shown(preprocess[name])}"
            )
    if "size" in preprocess and (why := _size_problem(preprocess["size"], pair=True)) is not None:
        raise ModelLoadError(f"{config_file} preprocess_cfg.size: {why}")
