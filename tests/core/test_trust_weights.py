"""Weights, tokenizers and configs that are not the model's never load quietly.

Each bad folder is a copy of a built-in model (or a tiny model of a family)
with one thing broken; the load must refuse it with one line naming the
problem. Every family's tiny model and both built-in models must still load
with no error, no warning and nothing on stderr (tied weights and buffers the
library recomputes are not "missing").
"""

import copy
import json
import random
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from core import answer, load_model
from core.errors import ModelLoadError, UnsupportedArchitectureError
from core.models.loading import MANIFEST, ModelLoadWarning, resources_dir
from core.zoo import scenes

MODELS = resources_dir() / "models"
QUESTION = "what color is the circle?"


def _message(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def _copy(tmp_path, name: str = "shapes-llava", manifest: bool = True):
    """A copy of a built-in model; ``manifest=False`` makes it an ordinary
    user folder (no MANIFEST.sha256 pinning its files)."""
    d = tmp_path / name
    shutil.copytree(MODELS / name, d)
    if not manifest:
        (d / MANIFEST).unlink()
    return d


def _weights_file(folder):
    open_clip = (folder / "open_clip_config.json").is_file()
    return folder / ("open_clip_model.safetensors" if open_clip else "model.safetensors")


def _edit_weights(folder, edit) -> None:
    """Rewrite the folder's safetensors file with ``edit(tensors) -> tensors``."""
    f = _weights_file(folder)
    save_file(edit(load_file(f)), f, metadata={"format": "pt"})


def _edit_json(path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _refused(folder, *, match: str, kind=ModelLoadError) -> str:
    with pytest.raises(kind, match=match) as e:
        load_model(folder)
    return _message(e)


# ---------------------------------------------------------------- weights
# The copies keep their MANIFEST.sha256: each problem is still named as itself.


def test_missing_lm_head_is_refused(tmp_path):
    d = _copy(tmp_path)
    _edit_weights(d, lambda st: {k: v for k, v in st.items() if "lm_head" not in k})
    msg = _refused(d, match="missing")
    assert "model.safetensors" in msg and "lm_head.weight" in msg and "random" in msg


def test_missing_whole_layer_is_refused(tmp_path):
    d = _copy(tmp_path)
    _edit_weights(d, lambda st: {k: v for k, v in st.items() if ".layers.3." not in k})
    msg = _refused(d, match="missing")
    assert "9 tensors" in msg and "model.language_model.layers.3.*" in msg


def test_only_an_unrelated_tensor_is_refused(tmp_path):
    d = _copy(tmp_path)
    _edit_weights(d, lambda st: {"decoder.something_else": torch.zeros(3)})
    msg = _refused(d, match="98 tensors the model needs are missing")
    assert "unexpected" in msg and "decoder.something_else" in msg  # a file of another model, said so


def test_mis_shaped_tensor_is_refused(tmp_path):
    d = _copy(tmp_path)

    def shrink(st):
        st["language_model.lm_head.weight"] = st["language_model.lm_head.weight"][:40].clone()
        return st

    _edit_weights(d, shrink)
    msg = _refused(d, match="mis-shaped")
    assert "lm_head.weight is [40, 128] in the file, the model expects [46, 128]" in msg


@pytest.mark.parametrize("value,name", [(float("nan"), "NaN"), (float("inf"), "Inf"), (float("-inf"), "Inf")])
def test_non_finite_weights_are_refused(tmp_path, value, name):
    d = _copy(tmp_path)

    def poison(st):
        st["language_model.model.norm.weight"][3] = value
        return st

    _edit_weights(d, poison)
    msg = _refused(d, match="non-finite")
    assert f"model.language_model.norm.weight: {name}" in msg


def test_int32_weights_are_refused(tmp_path):
    d = _copy(tmp_path)
    _edit_weights(d, lambda st: {k: v.to(torch.int32) for k, v in st.items()})
    msg = _refused(d, match="non-floating")
    assert "98 tensors" in msg and "language_model.lm_head.weight: int32" in msg


def test_one_boolean_tensor_is_refused(tmp_path):
    d = _copy(tmp_path)

    def to_bool(st):
        st["vision_tower.embeddings.class_embedding"] = st["vision_tower.embeddings.class_embedding"] > 0
        return st

    _edit_weights(d, to_bool)
    msg = _refused(d, match="non-floating")
    assert "1 tensor" in msg and "vision_tower.embeddings.class_embedding: bool" in msg


def test_unexpected_extra_tensor_warns_but_loads(tmp_path):
    d = _copy(tmp_path, manifest=False)

    def add(st):
        st["extra.probe.weight"] = torch.ones(4, 4)
        return st

    _edit_weights(d, add)
    with pytest.warns(ModelLoadWarning, match=r"1 unexpected tensor .*extra\.probe\.weight.*ignored") as record:
        loaded = load_model(d)
    assert len(record) == 1 and "\n" not in str(record[0].message)
    assert loaded.info["warnings"] == [str(record[0].message)]
    s = scenes.make_sample("heldout", 0)
    assert answer(loaded, s.image, s.question).prob == pytest.approx(
        answer(load_model("shapes-llava"), s.image, s.question).prob, abs=1e-6
    )


def test_cli_prints_a_load_warning_as_one_line(tmp_path, capsys):
    from core.cli import main

    d = _copy(tmp_path, manifest=False)

    def add(st):
        st["extra.probe.weight"] = torch.ones(4, 4)
        return st

    _edit_weights(d, add)
    sample = resources_dir() / "samples" / "sample_00.png"
    assert (
        main(["answer", "--model", str(d), "--image", str(sample), "--question", "what shape is the blue object?"]) == 0
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: ") and "1 unexpected tensor" in err[0]
    assert "extra.probe.weight" in err[0] and "model.safetensors" in err[0]


@pytest.mark.parametrize(
    "edit,match",
    [
        ("drop", "1 tensor the model needs is missing from the weights \\(text_decoder.text_projection\\)"),
        ("shape", "visual.positional_embedding is \\[50, 128\\] in the file, the model expects \\[65, 128\\]"),
        ("int", "non-floating .*logit_scale: int32"),
        ("nan", "non-finite .*text.ln_final.weight: NaN"),
    ],
)
def test_open_clip_weights_get_the_same_refusals(tmp_path, edit, match):
    """open_clip's own load refuses extra tensors, casts integers silently and
    interpolates a positional embedding of another length: the CoCa path
    refuses what the Hugging Face path refuses, in the same words."""
    d = _copy(tmp_path, "shapes-coca")

    def damage(st):
        if edit == "drop":
            del st["text_decoder.text_projection"]
        elif edit == "shape":
            st["visual.positional_embedding"] = st["visual.positional_embedding"][:50].clone()
        elif edit == "int":
            st["logit_scale"] = st["logit_scale"].to(torch.int32)
        else:
            st["text.ln_final.weight"][0] = float("nan")
        return st

    _edit_weights(d, damage)
    assert "open_clip_model.safetensors" in _refused(d, match=match)


def test_open_clip_extra_tensor_warns_but_loads(tmp_path):
    d = _copy(tmp_path, "shapes-coca", manifest=False)
    _edit_weights(d, lambda st: {**st, "unused": torch.ones(1)})
    with pytest.warns(ModelLoadWarning, match="1 unexpected tensor .*unused"):
        loaded = load_model(d)
    assert loaded.family == "coca"


# ---------------------------------------------------------------- tokenizer


def _shuffle_vocabulary(folder, seed: int, words_only: bool = False) -> None:
    def shuffle(t):
        vocab = t["model"]["vocab"]
        keys = [k for k in vocab if not (words_only and k.startswith("<"))]
        ids = [vocab[k] for k in keys]
        random.Random(seed).shuffle(ids)
        vocab.update(zip(keys, ids))

    _edit_json(folder / "tokenizer.json", shuffle)


@pytest.mark.parametrize("name", ["shapes-llava", "shapes-coca"])
@pytest.mark.parametrize("seed", [0, 1])
def test_shuffled_tokenizer_vocabulary_is_refused(tmp_path, name, seed):
    """In a user's folder (no manifest) the tokenizer's files no longer agree
    with each other once the vocabulary is reordered."""
    d = _copy(tmp_path, name, manifest=False)
    _shuffle_vocabulary(d, seed)
    msg = _refused(d, match="reordered")
    assert "tokenizer.json" in msg


def test_shuffled_words_of_a_builtin_model_are_refused_by_its_manifest(tmp_path):
    """Swapping ordinary words keeps tokenizer.json self-consistent; the
    built-in's manifest names the edited file."""
    d = _copy(tmp_path)
    _shuffle_vocabulary(d, 0, words_only=True)
    msg = _refused(d, match="tokenizer.json: edited")
    assert MANIFEST in msg


def test_config_special_token_id_that_names_an_ordinary_word_is_refused(tmp_path):
    d = _copy(tmp_path)
    _edit_json(d / "config.json", lambda c: c["text_config"].update(bos_token_id=7))
    msg = _refused(d, match="text_config.bos_token_id is 7")
    assert "'<s>'" in msg and "does not belong to this model" in msg


def test_malformed_special_token_id_names_the_field(tmp_path):
    d = _copy(tmp_path)
    _edit_json(d / "generation_config.json", lambda c: c.update(eos_token_id={"id": 2}))
    _refused(d, match="generation_config.json eos_token_id: expected a token id")


def test_added_tokens_decoder_that_disagrees_is_refused(tmp_path):
    d = _copy(tmp_path)
    _edit_json(d / "tokenizer_config.json", lambda c: c.update(added_tokens_decoder={"1": {"content": "</s>"}}))
    msg = _refused(d, match="added_tokens_decoder gives '</s>' id 1")
    assert "tokenizer_config.json" in msg and "id 2" in msg


def test_post_processor_id_that_disagrees_is_refused(tmp_path):
    d = _copy(tmp_path)
    _edit_json(d / "tokenizer.json", lambda t: t["post_processor"]["special_tokens"]["<s>"].update(ids=[2]))
    _refused(d, match="post-processor inserts '<s>' as id 2, the vocabulary has it at id 1")


def test_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    d = _copy(tmp_path, manifest=False)
    _edit_json(d / "tokenizer.json", lambda t: t["model"]["vocab"].update({f"extra{i}": 46 + i for i in range(4)}))
    msg = _refused(d, match="ids reach 49")
    assert "embeds 46 tokens" in msg


# ---------------------------------------------------------------- built-in manifest


@pytest.fixture
def builtin_copy(tmp_path, monkeypatch):
    """The built-in models as installed, in a resources folder of the test's own."""
    root = tmp_path / "resources"
    for name in ("shapes-llava", "shapes-coca"):
        shutil.copytree(MODELS / name, root / "models" / name)
    monkeypatch.setenv("VLM_READOUT_RESOURCES", str(root))
    return root / "models"


def _other_image_std(processor_config):
    processor_config["image_processor"]["image_std"] = [0.3, 0.3, 0.3]


def _perturb_one_weight(st):
    key = next(k for k in sorted(st) if st[k].is_floating_point() and st[k].numel() > 1)
    st[key] = st[key].clone()
    st[key].view(-1)[0] += 1e-3  # same shape, finite: only the manifest can tell
    return st


@pytest.mark.parametrize(
    "name,file,edit",
    [
        ("shapes-llava", "chat_template.jinja", lambda p: p.write_text(p.read_text().replace("USER", "User"))),
        ("shapes-llava", "config.json", lambda p: _edit_json(p, lambda c: c.update(note="edited"))),
        ("shapes-llava", "processor_config.json", lambda p: _edit_json(p, _other_image_std)),
        ("shapes-llava", "model.safetensors", lambda p: _edit_weights(p.parent, _perturb_one_weight)),
        ("shapes-coca", "open_clip_model.safetensors", lambda p: _edit_weights(p.parent, _perturb_one_weight)),
        ("shapes-coca", "tokenizer_config.json", lambda p: _edit_json(p, lambda c: c.update(model_max_length=100))),
    ],
)
def test_edited_builtin_file_is_refused_by_name(builtin_copy, name, file, edit):
    edit(builtin_copy / name / file)
    with pytest.raises(ModelLoadError, match=f"{file}: edited") as e:
        load_model(name)
    assert MANIFEST in _message(e)


def test_builtin_file_added_or_removed_is_refused(builtin_copy):
    folder = builtin_copy / "shapes-llava"
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(ModelLoadError, match=f"special_tokens_map.json: not listed in {MANIFEST}"):
        load_model("shapes-llava")
    (folder / "special_tokens_map.json").unlink()
    (folder / "generation_config.json").unlink()
    with pytest.raises(ModelLoadError, match=f"generation_config.json: listed in {MANIFEST} but missing"):
        load_model("shapes-llava")


def test_builtin_without_manifest_or_with_a_bad_line_is_refused(builtin_copy):
    manifest = builtin_copy / "shapes-coca" / MANIFEST
    lines = manifest.read_text().splitlines()
    manifest.write_text("\n".join([lines[0], "not a checksum line", *lines[1:]]) + "\n")
    with pytest.raises(ModelLoadError, match=f"{MANIFEST}:2: expected"):
        load_model("shapes-coca")
    manifest.unlink()
    with pytest.raises(ModelLoadError, match="reinstall"):
        load_model("shapes-coca")


def test_shipped_manifests_match_what_write_manifest_writes(tmp_path):
    from core.models.loading import write_manifest

    for name in ("shapes-llava", "shapes-coca"):
        d = _copy(tmp_path, name, manifest=False)
        assert write_manifest(d).read_text() == (MODELS / name / MANIFEST).read_text()


# ---------------------------------------------------------------- config fields


@pytest.mark.parametrize("value", [{"LlavaForConditionalGeneration": 1}, 3, [], "LlavaForConditionalGeneration", [7]])
def test_malformed_architectures_is_one_line_naming_the_field(tmp_path, value):
    d = _copy(tmp_path)
    _edit_json(d / "config.json", lambda c: c.update(architectures=value))
    msg = _refused(d, match="config.json architectures: expected a non-empty list of class names")
    assert type(value).__name__ in msg


def test_absent_architectures_lists_the_supported_ones(tmp_path):
    d = _copy(tmp_path)
    _edit_json(d / "config.json", lambda c: c.pop("architectures"))
    assert "LlavaForConditionalGeneration" in _refused(d, match="no 'architectures'", kind=UnsupportedArchitectureError)


@pytest.mark.parametrize("section,value", [("text_cfg", [1, 2]), ("vision_cfg", "big")])
def test_malformed_open_clip_config_section_names_the_field(tmp_path, section, value):
    d = _copy(tmp_path, "shapes-coca")
    _edit_json(d / "open_clip_config.json", lambda c: c["model_cfg"].update({section: value}))
    _refused(d, match=f"model_cfg.{section}: expected an object")


def test_open_clip_tokenizer_outside_the_model_folder_is_refused(tmp_path):
    d = _copy(tmp_path, "shapes-coca")
    _edit_json(d / "open_clip_config.json", lambda c: c["model_cfg"]["text_cfg"].update(hf_tokenizer_name="../x"))
    _refused(d, match="hf_tokenizer_name: '../x' is outside the model folder")


# ---------------------------------------------------------------- command line, quiet loads


def test_cli_refuses_bad_weights_in_one_line(tmp_path, capsys):
    from core.cli import main

    d = _copy(tmp_path)
    _edit_weights(d, lambda st: {k: v for k, v in st.items() if "lm_head" not in k})
    image = resources_dir() / "samples" / "sample_00.png"
    assert main(["answer", "--model", str(d), "--image", str(image), "--question", QUESTION]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "lm_head.weight" in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


@pytest.mark.parametrize("name", ["shapes-llava", "shapes-coca"])
def test_builtin_models_load_quietly(name, capfd):
    """No progress bar, load report or warning reaches the terminal (``--quiet`` is quiet)."""
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning of the load fails the test
        loaded = load_model(name)
    assert capfd.readouterr().err == "" and "warnings" not in loaded.info


# ---------------------------------------------------------------- every family round-trips


def _tiny(family: str):
    """(model, processor) of the family's tiny random model from its own tests."""
    from core.zoo import build
    from tests.core import (
        test_aya_vision,
        test_blip,
        test_gemma3,
        test_gemma3n,
        test_glm4v,
        test_idefics2,
        test_idefics3,
        test_internvl,
        test_janus,
        test_lfm2_vl,
        test_llama4,
        test_llava_next,
        test_llava_onevision,
        test_mistral3,
        test_mllama,
        test_molmo2,
        test_paligemma,
        test_qwen2_vl,
        test_qwen3_5,
        test_qwen3_5_moe,
        test_qwen3_vl,
        test_qwen3_vl_moe,
    )

    if family == "llava":
        return build.build_llava(), build.llava_processor()
    m = {
        "aya_vision": test_aya_vision.tiny_aya_vision_float64,  # tied
        "blip": test_blip.tiny_blip_float64,  # LM head tied to the word embeddings
        "gemma3": test_gemma3.tiny_gemma3_float64,  # tied
        "glm4v": test_glm4v.tiny_glm4v_float64,
        "idefics2": test_idefics2.tiny_model_float64,
        "idefics3": lambda: test_idefics3.tiny_model_float64("idefics3"),
        "internvl": test_internvl.tiny_internvl_float64,  # tied
        "janus": test_janus.tiny_janus_float64,  # tied
        "smolvlm": lambda: test_idefics3.tiny_model_float64("smolvlm", tie=True, bias=False),
        "llava_next": test_llava_next.tiny_llava_next_float64,
        "llava_onevision": test_llava_onevision.tiny_onevision_float64,
        "mistral3": test_mistral3.tiny_mistral3_float64,
        "molmo2": test_molmo2.tiny_molmo2_float64,
        "mllama": test_mllama.tiny_mllama_float64,
        "paligemma": test_paligemma.tiny_paligemma_float64,  # tied
        "qwen2_vl": lambda: test_qwen2_vl.tiny_qwen_float64("qwen2_vl"),
        "qwen2_5_vl": lambda: test_qwen2_vl.tiny_qwen_float64("qwen2_5_vl", tie=True),
        "qwen3_vl": test_qwen3_vl.tiny_qwen3_float64,
        # issue 30: hybrid, mixture-of-experts and multi-stream decoders
        "qwen3_vl_moe": test_qwen3_vl_moe.tiny_qwen3_vl_moe_float64,
        "qwen3_5": test_qwen3_5.tiny_qwen3_5_float64,
        "qwen3_5_moe": test_qwen3_5_moe.tiny_qwen3_5_moe_float64,
        "lfm2_vl": test_lfm2_vl.tiny_lfm2_vl_float64,
        "llama4": test_llama4.tiny_llama4_float64,
        "gemma3n": test_gemma3n.tiny_gemma3n_float64,
    }[family]()
    return copy.deepcopy(m.model).float(), m.processor  # a builder may share its cached float64 model


@pytest.mark.parametrize(
    "family",
    [
        "llava",
        "llava_next",
        "llava_onevision",
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "paligemma",
        "gemma3",
        "glm4v",
        "idefics2",
        "idefics3",
        "smolvlm",
        "internvl",
        "janus",
        "mistral3",
        "molmo2",
        "aya_vision",
        "mllama",
        "blip",
        "qwen3_vl_moe",
        "qwen3_5",
        "qwen3_5_moe",
        "lfm2_vl",
        "llama4",
        "gemma3n",
    ],
)
def test_every_family_round_trips_with_no_error_and_no_warning(tmp_path, family, capfd):
    model, processor = _tiny(family)
    model.save_pretrained(tmp_path, safe_serialization=True)
    processor.save_pretrained(tmp_path)
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelLoadWarning)
        loaded = load_model(tmp_path)
    assert capfd.readouterr().err == "" and "warnings" not in loaded.info
    got, want = loaded.model.state_dict(), model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_coca_round_trips_through_the_zoo_writer(tmp_path):
    from core.zoo import build

    model = build.build_coca()
    build.save_coca(model, tmp_path)  # writes MANIFEST.sha256 too
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelLoadWarning)
        loaded = load_model(tmp_path)
    got, want = loaded.model.state_dict(), model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want) and (tmp_path / MANIFEST).is_file()


# ---------------------------------------------------------------- fingerprint


def test_fingerprint_covers_tokenizer_and_processor_files(tmp_path):
    d = _copy(tmp_path, manifest=False)
    base = load_model(d).fingerprint
    assert base == load_model("shapes-llava").fingerprint  # names and contents, not the folder's place
    (d / "CARD.md").write_text("edited card")  # not read by the load
    assert load_model(d).fingerprint == base
    original = (d / "tokenizer.json").read_text()
    _edit_json(d / "tokenizer.json", lambda t: t["decoder"].update(cleanup=False))
    assert load_model(d).fingerprint != base
    (d / "tokenizer.json").write_text(original)
    assert load_model(d).fingerprint == base
    _edit_json(d / "processor_config.json", _other_image_std)
    assert load_model(d).fingerprint != base


def test_lens_is_refused_on_a_model_whose_tokenizer_changed(tmp_path):
    from core.methods.tuned_lens import LensMismatchError, load_lens

    lens_dir = MODELS / "shapes-llava" / "tuned-lens"
    assert load_lens(lens_dir, load_model("shapes-llava")).meta["fingerprint"] == load_model("shapes-llava").fingerprint
    d = _copy(tmp_path, manifest=False)
    _edit_json(d / "tokenizer.json", lambda t: t["decoder"].update(cleanup=False))
    with pytest.raises(LensMismatchError, match="fingerprint"):
        load_lens(lens_dir, load_model(d))


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_reordered_bpe_or_unigram_vocabulary_is_refused(tmp_path, kind):
    """Real tokenizers' special tokens often sit outside the vocabulary, so a
    shuffle leaves them alone; a trained BPE vocabulary gives each merge the
    next id and a Unigram one sorts its pieces by score, which a shuffle breaks."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from core.models.loading import _check_tokenizer_json

    words = "a red circle sits left of the blue square while three green triangles count above one yellow ring".split()
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(500)]
    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<unk>"])
    else:
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=["<pad>", "<unk>"], unk_token="<unk>")
    tok.train_from_iterator(corpus, trainer)
    f = tmp_path / "tokenizer.json"
    tok.save(str(f))
    _check_tokenizer_json(f)  # as trained: in order

    def shuffle(t):
        vocab = t["model"]["vocab"]
        if kind == "bpe":  # specials keep their ids, every other token is reassigned
            keys = [k for k in vocab if not k.startswith("<")]
            ids = [vocab[k] for k in keys]
            random.Random(1).shuffle(ids)
            vocab.update(zip(keys, ids))
        else:
            head, rest = vocab[:2], vocab[2:]
            random.Random(1).shuffle(rest)
            t["model"]["vocab"] = head + rest

    _edit_json(f, shuffle)
    with pytest.raises(ModelLoadError, match="do not follow its (merges|scores).*reordered") as e:
        _check_tokenizer_json(f)
    _message(e)


def test_manifest_naming_a_file_outside_the_folder_is_refused(builtin_copy):
    manifest = builtin_copy / "shapes-llava" / MANIFEST
    manifest.write_text(manifest.read_text() + f"{'0' * 64}  ../../outside.json\n")
    with pytest.raises(ModelLoadError, match="'../../outside.json' is not a file inside the model folder"):
        load_model("shapes-llava")


@pytest.mark.parametrize(
    "name,file,edit",
    [
        ("shapes-llava", "config.json", lambda c: c.update(text_config=None)),  # transformers' default: a 7B Llama
        (
            "shapes-coca",
            "open_clip_config.json",
            lambda c: c["model_cfg"]["multimodal_cfg"].update(width=4096, layers=24),
        ),
    ],
)
def test_config_far_larger_than_its_weights_is_refused_before_allocating(tmp_path, name, file, edit):
    """The library would allocate, and fill with random values, gigabytes the
    files never provide (the process can be killed for memory first)."""
    d = _copy(tmp_path, name)
    _edit_json(d / file, edit)
    msg = _refused(d, match=f"{file} describes a model of [0-9,]+ weights but the weight files hold")
    assert "GiB would be random values" in msg
