"""Coverage-guided fuzzing of the model-folder checks with atheris: a tiny
LLaVA or CoCa folder whose config.json / processor_config.json /
open_clip_config.json / chat template an input edits, then ``load_model``
and, when it loads, one ``answer`` (a forward of the tiny model).

Run (see tests/fuzz/README.md)::

    mkdir -p /tmp/fuzz-model_config
    .venv/bin/python tests/fuzz/fuzz_model_config.py /tmp/fuzz-model_config tests/fuzz/corpus/model_config \\
        -max_total_time=600 -rss_limit_mb=3072 -timeout=20 -artifact_prefix=/tmp/fuzz-model_config/

An input is either a JSON edit document (the seed corpus: readable, one class
of bad configuration each)::

    {"family": "llava", "edits": {"config.json": {"text_config.rms_norm_eps": NaN}},
     "files": {"chat_template.jinja": ""}, "fifo": ["tokenizer.json"]}

(``edits``: dotted field -> value, ``null`` and all; a value ``{"$delete": true}``
removes the field; ``files``: a file's whole new text; ``fifo``: files
replaced by a FIFO), or any other bytes, read by atheris' FuzzedDataProvider
as a few edits (:func:`_provided`: a file, a field of it, those the template
holds and the ones the checks read, and a value from a palette of hostile kinds:
0, -1, NaN, Infinity, 2**63, -0.0, strings, lists, objects, booleans, null).

A finding is any exception other than :class:`core.errors.ReadoutError`, a
ReadoutError message that is not one line, a load error that names no file
or field of the folder, an answer whose probability is not finite, a hang
(-timeout) or a memory blow-up (-rss_limit_mb). The suite replays the corpus
through the same :func:`TestOneInput` without atheris
(tests/fuzz/test_fuzz_model_config.py). ``--write-corpus`` (re)writes the seeds
(:func:`seeds`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
import tempfile
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `core` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FAMILIES = ("llava", "coca")
QUESTION = "what shape is the blue object?"
# The JSON files an edit may touch, per family.
FILES = {
    "llava": ("config.json", "processor_config.json", "tokenizer_config.json", "generation_config.json"),
    "coca": ("open_clip_config.json", "tokenizer_config.json"),
}
# Fields the checks read that the templates do not all hold (the fuzzer may add them).
EXTRA_FIELDS = {
    "config.json": (
        "vision_feature_layer",
        "image_seq_length",
        "text_config.rope_theta",
        "text_config.rope_parameters.factor",
        "text_config.partial_rotary_factor",
        "text_config.head_dim",
        "text_config.logit_scale",
        "vision_config.num_channels",
        "vision_config.model_type",
        "tie_word_embeddings",
    ),
    "processor_config.json": (
        "image_processor.do_center_crop",
        "image_processor.do_resize",
        "image_processor.size.height",
        "image_processor.size.width",
        "image_processor.size.longest_edge",
        "chat_template",
    ),
    "open_clip_config.json": ("model_cfg.vision_cfg.layers", "preprocess_cfg.size", "preprocess_cfg.fill_color"),
    "tokenizer_config.json": ("chat_template", "added_tokens_decoder"),
    "generation_config.json": ("eos_token_id", "bos_token_id"),
}
PALETTE = (
    0,
    -1,
    1,
    2,
    3,
    7,
    16,
    33,
    10**9,
    2**63,
    -(2**31),
    0.5,
    -0.0,
    1e-30,
    1e30,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "default",
    "full",
    "x",
    True,
    False,
    None,
    [],
    [0],
    [1, 2],
    [0.5, 0.5, 0.5],
    {},
    {"height": 0},
)
DELETE = {"$delete": True}

_TEMPLATES: dict[str, Path] = {}


# ---------------------------------------------------------------- the tiny templates


def _tiny_llava(folder: Path) -> None:
    """A LLaVA of two 32-wide layers a side reading 32 x 32 images as 2 x 2 patches
    (the built-in model's tokenizer, chat template and processor, resized)."""
    import torch
    from transformers import LlavaForConditionalGeneration

    from core.zoo import build

    config = build.llava_config()
    config.vision_config.update(
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32)
    )
    config.text_config.update(
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16)
    )
    config.text_config.num_key_value_heads = 1
    config.image_seq_length = 4
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(folder, safe_serialization=True)
    processor = build.llava_processor()
    processor.image_processor.size = {"shortest_edge": 32}
    processor.image_processor.crop_size = {"height": 32, "width": 32}
    processor.save_pretrained(folder)


def _tiny_coca(folder: Path) -> None:
    import torch
    from open_clip.coca_model import CoCa
    from safetensors.torch import save_file

    from core.zoo import build, vocab

    cfg = build.coca_model_cfg()
    cfg["embed_dim"] = 16
    cfg["vision_cfg"].update(image_size=32, width=32, layers=1, head_width=16)
    cfg["text_cfg"].update(width=32, heads=2)
    cfg["multimodal_cfg"].update(width=32, heads=2, layers=1)
    torch.manual_seed(0)
    model = CoCa(cfg["embed_dim"], cfg["multimodal_cfg"], cfg["text_cfg"], cfg["vision_cfg"], pad_id=0)
    torch.nn.init.normal_(model.text_decoder.text_projection, std=0.2)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(folder / "open_clip_model.safetensors")
    )
    config = {
        "model_cfg": cfg,
        "preprocess_cfg": {
            "mean": build.IMAGE_MEAN,
            "std": build.IMAGE_STD,
            "interpolation": "bicubic",
            "resize_mode": "shortest",
        },
        "vlm_readout": {"family": "coca", "prompt": vocab.COCA_PROMPT, "answer_words": ["circle", "square"]},
    }
    (folder / "open_clip_config.json").write_text(json.dumps(config, indent=2))
    vocab.build_hf_tokenizer().save_pretrained(folder)


def template(family: str) -> Path:
    """The tiny model folder of ``family``, built once per process."""
    if family not in _TEMPLATES:
        folder = Path(tempfile.mkdtemp(prefix=f"fuzz-{family}-template-"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (_tiny_llava if family == "llava" else _tiny_coca)(folder)
        _TEMPLATES[family] = folder
    return _TEMPLATES[family]


# ---------------------------------------------------------------- inputs into folders


def _fields(doc, prefix: str = "") -> list[str]:
    """Every dotted field path of a JSON document (objects only; lists are leaves)."""
    out = []
    for key, value in doc.items():
        path = f"{prefix}{key}"
        out.append(path)
        if isinstance(value, dict):
            out += _fields(value, f"{path}.")
    return out


def _set(doc: dict, path: str, value) -> None:
    """``doc[path] = value`` along the dotted ``path`` (objects made on the way, a
    non-object in the way replaced); ``DELETE`` removes the field."""
    *parents, last = path.split(".")
    for p in parents:
        if not isinstance(doc.get(p), dict):
            doc[p] = {}
        doc = doc[p]
    if value == DELETE:
        doc.pop(last, None)
    else:
        doc[last] = value


def _decoded(data: bytes) -> dict | None:
    """The JSON edit document ``data`` holds, or None."""
    if not data.startswith(b"{"):
        return None
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and doc.get("family") in FAMILIES else None


class _Bytes:
    """Reads choices off arbitrary bytes, deterministically (zeros past the end),
    as atheris' FuzzedDataProvider would: the replay needs no atheris."""

    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        chunk = self.data[self.at : self.at + n]
        self.at += n
        return chunk.ljust(n, b"\0")

    def int_in(self, lo: int, hi: int) -> int:
        span = hi - lo + 1
        width = max(1, (span.bit_length() + 7) // 8)
        return lo + int.from_bytes(self.take(width), "little") % span

    def float(self) -> float:
        return struct.unpack("<d", self.take(8))[0]  # any double: NaN, Infinity, subnormals

    def text(self) -> str:
        return self.take(self.int_in(0, 12)).decode("utf-8", errors="replace")


def _provided(data: bytes) -> dict:
    """A few edits read from arbitrary bytes: a file of the family, a field of it
    (those the template holds and :data:`EXTRA_FIELDS`) and a value."""
    read = _Bytes(data)
    family = FAMILIES[read.int_in(0, len(FAMILIES) - 1)]
    edits: dict[str, dict] = {}
    files = FILES[family]
    for _ in range(read.int_in(1, 4)):
        name = files[read.int_in(0, len(files) - 1)]
        f = template(family) / name
        fields = (_fields(json.loads(f.read_text())) if f.is_file() else []) + list(EXTRA_FIELDS.get(name, ()))
        field = fields[read.int_in(0, len(fields) - 1)]
        kind = read.int_in(0, 7)
        if kind == 0:
            value = read.int_in(-(2**31), 2**31)
        elif kind == 1:
            value = read.float()
        elif kind == 2:
            value = read.text()
        elif kind == 3:
            value = [read.int_in(-4, 64) for _ in range(read.int_in(0, 3))]
        elif kind == 4:
            value = DELETE
        else:
            value = PALETTE[read.int_in(0, len(PALETTE) - 1)]
        edits.setdefault(name, {})[field] = value
    return {"family": family, "edits": edits}


def build_folder(spec: dict, root: Path) -> Path:
    """A copy of the family's template under ``root`` with ``spec``'s edits made
    (an edit the file system cannot make, such as a file inside a file, is skipped)."""
    folder = root / "model"
    shutil.copytree(template(spec["family"]), folder, copy_function=os.link)  # weights hard-linked, never edited
    edits, files, fifos = (spec.get(key) for key in ("edits", "files", "fifo"))
    for name, fields in edits.items() if isinstance(edits, dict) else ():
        if isinstance(fields, dict):
            doc = _json_object(folder / name) if _plain_name(name) else {}
            for path, value in fields.items():
                _set(doc, str(path), value)
            _replace(folder, name, lambda f, doc=doc: f.write_text(json.dumps(doc)))
    for name, text in files.items() if isinstance(files, dict) else ():
        if isinstance(text, str):
            _replace(folder, name, lambda f, text=text: f.write_text(text))
    for name in fifos if isinstance(fifos, list) and hasattr(os, "mkfifo") else ():
        _replace(folder, name, os.mkfifo)
    return folder


def _json_object(f: Path) -> dict:
    """The template's JSON object in ``f`` ({} for a file that is none)."""
    try:
        doc = json.loads(f.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _replace(folder: Path, name, make) -> None:
    """``make(path)`` for a new file ``name`` of ``folder`` (the template's hard
    link removed first, so the template is never edited)."""
    if not _plain_name(name):
        return
    f = folder / name
    try:
        f.unlink(missing_ok=True)
        f.parent.mkdir(parents=True, exist_ok=True)
        make(f)
    except (OSError, ValueError):  # a name inside a file, a folder in the way, a NUL byte
        pass


def _plain_name(name) -> bool:
    """A file name inside the folder (a seed may name a subfolder's file, never one outside)."""
    return isinstance(name, str) and bool(name) and not name.startswith("/") and ".." not in name.split("/")


# ---------------------------------------------------------------- the seed corpus

CORPUS = Path(__file__).parent / "corpus" / "model_config"
NAN, INF = math.nan, math.inf


def _edit(file: str, **fields) -> dict:
    """``{file: {field: value}}``, a field's dots spelled ``__`` in the keyword."""
    return {file: {k.replace("__", "."): v for k, v in fields.items()}}


def seeds() -> dict[str, dict]:
    """The seed inputs by file name: the tiny models as built, and one of each
    class of bad configuration issue 27 names (and a few more of each class)."""
    llava = {
        "llava-good": {},
        "llava-rms-eps-nan": _edit("config.json", text_config__rms_norm_eps=NAN),
        "llava-rms-eps-negative": _edit("config.json", text_config__rms_norm_eps=-1e-5),
        "llava-layer-norm-eps-inf": _edit("config.json", vision_config__layer_norm_eps=INF),
        "llava-rope-theta-zero": _edit("config.json", **{"text_config__rope_parameters__rope_theta": 0.0}),
        "llava-layers-zero": _edit("config.json", text_config__num_hidden_layers=0),
        "llava-layers-fewer": _edit("config.json", text_config__num_hidden_layers=1),
        "llava-image-seq-length-10": _edit("config.json", image_seq_length=10),
        "llava-tie": _edit("config.json", tie_word_embeddings=True),
        "llava-strategy-full": _edit("config.json", vision_feature_select_strategy="full"),
        "llava-feature-layer-99": _edit("config.json", vision_feature_layer=99),
        "llava-feature-layer-minus-99": _edit("config.json", vision_feature_layer=-99),
        # found by the fuzzer: 0 is falsy, so transformers keeps no hidden state (a TypeError in the forward)
        "llava-feature-layer-0": _edit("config.json", vision_feature_layer=0),
        "llava-patch-zero": _edit("config.json", vision_config__patch_size=0),
        "llava-hidden-huge": _edit("config.json", text_config__hidden_size=2**40),
        # found by the fuzzer: 19,245,064 tower layers, built one by one (a timeout before any weight is read)
        "llava-layers-millions": _edit("config.json", vision_config__num_hidden_layers=19_245_064),
        "llava-processor-strategy-full": _edit("processor_config.json", vision_feature_select_strategy="full"),
        "llava-additional-tokens-0": _edit("processor_config.json", num_additional_image_tokens=0),
        "llava-processor-patch-zero": _edit("processor_config.json", patch_size=0),
        "llava-crop-zero": _edit("processor_config.json", image_processor__crop_size={"height": 0, "width": 0}),
        "llava-crop-small": _edit("processor_config.json", image_processor__crop_size={"height": 16, "width": 16}),
        "llava-crop-huge": _edit(
            "processor_config.json", image_processor__crop_size={"height": 100000, "width": 100000}
        ),
        "llava-resample-99": _edit("processor_config.json", image_processor__resample=99),
        "llava-std-zero": _edit("processor_config.json", image_processor__image_std=[0, 0, 0]),
        "llava-rescale-nan": _edit("processor_config.json", image_processor__rescale_factor=NAN),
        "llava-template-field-empty": _edit("tokenizer_config.json", chat_template=""),
        "llava-eos-list": _edit("generation_config.json", eos_token_id=[2, "x"]),
        # found by the fuzzer: normalising without a mean (the processor's ValueError at the first image)
        "llava-mean-null": _edit("processor_config.json", image_processor__image_mean=None),
        # found by the fuzzer: a switch that is not a boolean (a TypeError inside the processor)
        "llava-switch-object": _edit("processor_config.json", image_processor__do_rescale={"height": 0}),
        # found by the fuzzer: an unknown processor_class, the image processor alone taken for the tokenizer
        "llava-processor-class": _edit("processor_config.json", processor_class="NoSuchProcessor"),
        # found by the fuzzer: size 1, a resize to 1 x 1 (an internal assert in torch's antialiasing)
        "llava-size-one": _edit("processor_config.json", image_processor__size=1),
        "llava-max-length-negative": _edit("tokenizer_config.json", model_max_length=-5),
        # found by the fuzzer: an unknown token the vocabulary lacks (endless recursion looking its id up)
        "llava-unk-token-unknown": _edit("tokenizer_config.json", pad_token="emmaTo", unk_token=""),
        # found by the fuzzer: no padding token, and the processor pads every batch (a ValueError at every read-out)
        "llava-pad-token-unset": _edit("tokenizer_config.json", pad_token=DELETE),
        "llava-padding-side": _edit("tokenizer_config.json", padding_side="up"),
    }
    out = {name: {"family": "llava", "edits": edits} for name, edits in llava.items()}
    out["llava-template-empty"] = {"family": "llava", "files": {"chat_template.jinja": ""}}
    out["llava-config-nested"] = {"family": "llava", "files": {"config.json": "[" * 100 + "]" * 100}}
    out["llava-config-overflow"] = {
        "family": "llava",
        "files": {"config.json": '{"text_config": {"rms_norm_eps": 1e999}}'},
    }
    out["llava-fifo-config"] = {"family": "llava", "fifo": ["config.json"]}
    out["llava-fifo-weights"] = {"family": "llava", "fifo": ["model.safetensors"]}
    out["llava-fifo-other"] = {"family": "llava", "fifo": ["notes.txt"]}
    coca = {
        "coca-good": {},
        "coca-context-2": _edit("open_clip_config.json", model_cfg__multimodal_cfg__context_length=2),
        "coca-std-zero": _edit("open_clip_config.json", preprocess_cfg__std=[0, 0, 0]),
        "coca-interpolation": _edit("open_clip_config.json", preprocess_cfg__interpolation="cubic"),
        "coca-image-smaller-than-patch": _edit("open_clip_config.json", model_cfg__vision_cfg__image_size=8),
        "coca-width-zero": _edit("open_clip_config.json", model_cfg__text_cfg__width=0),
        # found by the fuzzer: a list of layers reached the memory plan's int() (a TypeError)
        "coca-layers-list": _edit("open_clip_config.json", model_cfg__multimodal_cfg__layers=[0]),
        # found by the fuzzer: an image size as [height, width] reached the memory plan's int() (a TypeError)
        "coca-image-size-pair": _edit("open_clip_config.json", model_cfg__vision_cfg__image_size=[54, 28]),
        # found by the fuzzer: a string model_max_length, compared with each prompt's length (a TypeError)
        "coca-max-length-string": _edit("tokenizer_config.json", model_max_length="x"),
        # found by the fuzzer: an mlp_ratio of 1.6e283 planned as 6.8e276 GB (a bound now)
        "coca-mlp-ratio-huge": _edit("open_clip_config.json", model_cfg__multimodal_cfg__mlp_ratio=1.6e283),
        # found by the fuzzer: a std float32 holds as 0 (torchvision's ValueError at the first image)
        "coca-std-subnormal": _edit("open_clip_config.json", preprocess_cfg__std=3.6e-317),
        # found by the fuzzer: no output_tokens, the tower gives the decoder nothing (a ValueError in the forward)
        "coca-output-tokens-unset": _edit("open_clip_config.json", model_cfg__vision_cfg__output_tokens=DELETE),
        # found by the fuzzer: a NUL in the tokenizer's folder name (a ValueError of pathlib)
        "coca-tokenizer-nul": _edit("open_clip_config.json", model_cfg__text_cfg__hf_tokenizer_name="\x00\x00"),
        # found by the fuzzer: no tokenizer named, open_clip's own (49,408 ids) fed a 46-token model (an IndexError)
        "coca-tokenizer-unnamed": _edit("open_clip_config.json", model_cfg__text_cfg__hf_tokenizer_name=DELETE),
    }
    out.update({name: {"family": "coca", "edits": edits} for name, edits in coca.items()})
    out["coca-fifo-tokenizer"] = {"family": "coca", "fifo": ["tokenizer.json"]}
    return out


def write_corpus() -> None:
    """Write :func:`seeds` into :data:`CORPUS` (``<name>.json``), plus two raw-byte
    inputs read by :func:`_provided`; the fuzzer's own finds there are kept."""
    CORPUS.mkdir(parents=True, exist_ok=True)
    for name, spec in seeds().items():
        (CORPUS / f"{name}.json").write_text(json.dumps(spec, sort_keys=True) + "\n")
    (CORPUS / "bytes-llava").write_bytes(bytes([0, 1, 0, 0, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0]))
    (CORPUS / "bytes-coca").write_bytes(bytes([1, 2, 0, 3, 7, 9, 1, 255, 255, 255, 255, 255, 255, 255, 127]))


# ---------------------------------------------------------------- the check


def TestOneInput(data: bytes) -> None:
    """Build the folder ``data`` describes, load it and, if it loads, answer
    once; raise AssertionError (or let any other exception through) on a finding."""
    from core import answer, load_model
    from core.errors import ModelLoadError, ReadoutError
    from core.models.loading import resources_dir

    spec = _decoded(data) or _provided(data)
    with tempfile.TemporaryDirectory(prefix="fuzz-model-config-") as root:
        folder = build_folder(spec, Path(root))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # ModelLoadWarning: one line each, checked by the tests
                loaded = load_model(folder)
                result = answer(loaded, resources_dir() / "samples" / "sample_00.png", QUESTION)
        except ReadoutError as e:
            message = str(e)
            assert message and "\n" not in message, f"bad error message: {message!r}"
            if isinstance(e, ModelLoadError):
                assert _names_the_folder(message, folder), f"the message names no file or field: {message!r}"
            return
        assert math.isfinite(result.prob), f"a non-finite answer was shown: {result}"


def _names_the_folder(message: str, folder: Path) -> bool:
    """Whether a load error says where: the folder or a file of it (by path, or
    by name as the config and tokenizer checks spell it: ``config.json
    text_config.eos_token_id``), or the processor's or the prompt's setting."""
    names = tuple(f.name for f in folder.iterdir())
    return str(folder) in message or message.startswith(
        (
            *names,
            "the processor",
            "chat_template",
            "vlm_readout",
            "no adapter supports",
            "adapter config",
        )
    )


def main() -> None:
    import atheris
    import torch

    torch.set_num_threads(1)  # a tiny model: threads cost more than they give
    # The engine's loader and checks, and the library code the configs steer
    # (LLaVA's config, model and processor, CLIP's image processor, open_clip's
    # transforms); not torch or the rest of transformers.
    modules = ["core", "transformers.models.llava", "transformers.models.clip", "open_clip.transform"]
    with atheris.instrument_imports(include=modules):
        import open_clip.transform  # noqa: F401
        import transformers.models.clip.image_processing_clip  # noqa: F401
        import transformers.models.llava.modeling_llava  # noqa: F401
        import transformers.models.llava.processing_llava  # noqa: F401

        import core.analyze  # noqa: F401
        import core.answer  # noqa: F401
        import core.models.loading  # noqa: F401
        from core.models import registry

        registry.supported()  # every family's module, imported (and instrumented) now
    for family in FAMILIES:
        template(family)
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-corpus"]:
        write_corpus()
    else:
        main()
