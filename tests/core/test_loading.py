"""load_model: built-ins, folders, and every refusal with its one-line reason."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from core import answer, load_model
from core.errors import ModelLoadError, UnsafeCheckpointError, UnsupportedArchitectureError
from core.models.loading import resources_dir
from core.zoo import scenes

LLAVA_DIR = resources_dir() / "models" / "shapes-llava"
COCA_DIR = resources_dir() / "models" / "shapes-coca"


def _one_line(exc_info):
    assert "\n" not in str(exc_info.value)
    return str(exc_info.value)


@pytest.fixture
def llava_copy(tmp_path):
    d = tmp_path / "llava"
    shutil.copytree(LLAVA_DIR, d)
    return d


@pytest.mark.parametrize("name", ["shapes-llava", "shapes-coca"])
def test_builtin_models_load_and_answer(name):
    m = load_model(name)
    assert m.adapter.n_layers >= 4 and m.adapter.n_heads >= 4
    s = scenes.make_sample("heldout", 0)
    a = answer(m, s.image, s.question)
    assert 0 < a.prob <= 1 and a.top[0][0] == a.answer
    assert len(m.fingerprint) == 16


def test_folder_path_equals_builtin_name():
    assert load_model(str(LLAVA_DIR)).fingerprint == load_model("shapes-llava").fingerprint


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(ModelLoadError, match="no such folder") as e:
        load_model(tmp_path / "nope")
    _one_line(e)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="empty") as e:
        load_model(tmp_path / "empty")
    _one_line(e)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="not a model folder"):
        load_model(tmp_path / "junk")


def test_unknown_architecture_lists_supported(llava_copy):
    cfg = json.loads((llava_copy / "config.json").read_text())
    cfg["architectures"] = ["FancyVLMForEverything"]
    (llava_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(llava_copy)
    msg = _one_line(e)
    assert "FancyVLMForEverything" in msg and "LlavaForConditionalGeneration" in msg and "open_clip:CoCa" in msg


def test_pickle_checkpoint_refused_unless_allowed(llava_copy):
    model = load_model(llava_copy).model
    torch.save(model.state_dict(), llava_copy / "pytorch_model.bin")
    (llava_copy / "model.safetensors").unlink()
    (llava_copy / "MANIFEST.sha256").unlink()  # a user's folder now, not the built-in it was copied from
    with pytest.raises(UnsafeCheckpointError, match="pickle") as e:
        load_model(llava_copy)
    _one_line(e)
    loaded = load_model(llava_copy, allow_pickle=True)
    s = scenes.make_sample("heldout", 1)
    # the same weights through the same forward: the same probability
    assert answer(loaded, s.image, s.question).prob == answer(load_model("shapes-llava"), s.image, s.question).prob


def test_pickle_open_clip_checkpoint_refused(tmp_path):
    ckpt = tmp_path / "weights.pt"
    torch.save({"a": torch.zeros(1)}, ckpt)
    with pytest.raises(UnsafeCheckpointError, match="pickle"):
        load_model(f"coca_ViT-B-32:{ckpt}")


def test_remote_code_refused_unless_opted_in(llava_copy):
    cfg = json.loads((llava_copy / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForImageTextToText": "modeling_evil.EvilModel"}
    (llava_copy / "config.json").write_text(json.dumps(cfg))
    (llava_copy / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(UnsafeCheckpointError, match="trust_remote_code") as e:
        load_model(llava_copy)
    _one_line(e)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_weights(llava_copy, damage):
    w = llava_copy / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) - 1000] if damage == "truncate" else b"\xff" * 64 + data[64:])
    with pytest.raises(ModelLoadError, match="corrupt or truncated") as e:
        load_model(llava_copy)
    _one_line(e)


def test_corrupt_open_clip_weights(tmp_path):
    d = tmp_path / "coca"
    shutil.copytree(COCA_DIR, d)
    w = d / "open_clip_model.safetensors"
    w.write_bytes(w.read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(d)


def test_uncached_repo_id_is_not_downloaded(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="allow_download") as e:
        load_model("someone/not-a-cached-model")
    _one_line(e)


def _cli_answer(model, image):
    """Run ``vlm-readout answer`` in a subprocess, as a user would."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "core.cli",
            "answer",
            "--model",
            str(model),
            "--image",
            str(image),
            "--question",
            "what color is the circle?",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_exits_nonzero_with_one_line(tmp_path):
    (tmp_path / "img.png").write_text("not an image")
    r = _cli_answer(tmp_path / "missing", tmp_path / "img.png")
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines == [lines[0]] and lines[0].startswith("error: ") and "not an image" in lines[0]
    r = _cli_answer(tmp_path / "missing", resources_dir() / "samples" / "sample_00.png")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: ") and "no such folder" in r.stderr
    assert "Traceback" not in r.stderr


def test_repo_id_already_in_local_cache_loads_offline(tmp_path, monkeypatch):
    """A repo id resolves through the local Hugging Face cache, never the network."""
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--readout-tests--shapes-llava"
    shutil.copytree(LLAVA_DIR, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    # huggingface_hub reads its cache location at import; point it here.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    loaded = load_model("readout-tests/shapes-llava")
    assert loaded.family == "llava"
    assert loaded.fingerprint == load_model("shapes-llava").fingerprint


def test_open_clip_takes_one_device_under_device_auto():
    """open_clip models are not sharded: "auto" is the GPU if any, else the CPU (without
    accelerate, "auto" is one line: tests/core/test_devices.py)."""
    from core import load_model

    coca = load_model("shapes-coca", device="auto")
    assert next(coca.model.parameters()).device.type in ("cpu", "cuda")
