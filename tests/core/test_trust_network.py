"""No network connection without ``--allow-download`` (issue 27, part 1).

Every loader path runs in a fresh process whose Hugging Face endpoint and
HTTP(S) proxies point at a trap: a local HTTP server that records every
request (a client that honours neither still shows in the trap as nothing,
so the process's own offline state is checked too). Without
``--allow-download`` the trap must see no request, and a load that needs the
hub is one ``error:`` line naming the model and what it lacks. With
``--allow-download`` the same trap does see the requests, so these tests can
fail."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from safetensors.torch import save_file

from core.errors import ModelLoadError
from core.models.loading import load_model, resources_dir
from core.shell import offline

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = resources_dir() / "samples" / "sample_00.png"
QUESTION = "what color is the circle?"
COCA = resources_dir() / "models" / "shapes-coca"
LLAVA = resources_dir() / "models" / "shapes-llava"
HUB_TEXT_TOWER = "coca_roberta-ViT-B-32"  # open_clip's CoCa whose text tower and tokenizer are roberta-base


class Trap(http.server.ThreadingHTTPServer):
    """A local server that answers every request 404 and records it."""

    def __init__(self):
        self.requests: list[str] = []
        trap = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _record(self):
                trap.requests.append(f"{self.command} {self.path}")
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_HEAD = do_POST = do_PUT = do_CONNECT = _record

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def trap():
    server = Trap()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _env(trap: Trap, tmp_path: Path, **extra) -> dict:
    """The environment of a user who set nothing offline (the test session's
    own switches removed), an empty Hugging Face cache, and every endpoint and
    proxy the hub libraries and urllib read pointed at the trap."""
    env = {k: v for k, v in os.environ.items() if k not in offline.SWITCHES and not k.upper().endswith("_PROXY")}
    proxies = {name: trap.url for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")}
    env.update(proxies, **{k.lower(): v for k, v in proxies.items()})
    env.update(
        HF_ENDPOINT=trap.url,
        HF_HOME=str(tmp_path / "hf-home"),
        HOME=str(tmp_path / "home"),
        NO_PROXY="",
        no_proxy="",
        QT_QPA_PLATFORM="offscreen",
        **extra,
    )
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_ASSETS_CACHE"):
        env.pop(name, None)
    return env


def _run(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def _checkpoint(tmp_path: Path) -> Path:
    """A safetensors file for ``name:checkpoint`` specs (its tensors do not
    matter: the hub is needed before they are compared)."""
    import torch

    path = tmp_path / "coca.safetensors"
    save_file({"logit_scale": torch.zeros(())}, path)
    return path


def _open_clip_folder(tmp_path: Path, hf_model_name) -> Path:
    """A copy of shapes-coca whose open_clip_config.json builds its text tower
    from the Hugging Face model ``hf_model_name`` (no manifest: it is edited)."""
    folder = tmp_path / "hf-text-coca"
    shutil.copytree(COCA, folder, ignore=shutil.ignore_patterns("MANIFEST.sha256", "tuned-lens"))
    config_file = folder / "open_clip_config.json"
    config = json.loads(config_file.read_text())
    config["model_cfg"]["text_cfg"]["hf_model_name"] = hf_model_name
    config_file.write_text(json.dumps(config))
    return folder


def _answer(model: str, *more: str) -> list[str]:
    return ["-m", "core.cli", "answer", "--model", model, "--image", str(SAMPLE), "--question", QUESTION, *more]


# ---------------------------------------------------------------- loads that work offline: zero requests


@pytest.mark.parametrize("model", ["shapes-coca", str(LLAVA)], ids=["bundled open_clip", "HF folder"])
def test_local_models_answer_without_a_single_request(trap, tmp_path, model):
    done = _run(_answer(model, "--quiet"), _env(trap, tmp_path))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert len(done.stdout.splitlines()) == 1
    assert trap.requests == []


# ---------------------------------------------------------------- loads that need the hub: one line, zero requests


def test_uncached_repo_id_is_one_line_and_no_request(trap, tmp_path):
    done = _run(_answer("someone/not-cached-anywhere"), _env(trap, tmp_path))
    assert done.returncode == 2 and done.stdout == ""
    line = _one_error_line(done.stderr)
    assert line.startswith("error: someone/not-cached-anywhere: cannot load (not in the local cache;"), line
    assert "--allow-download" in line
    assert trap.requests == []


def test_open_clip_name_with_a_hub_text_tower_is_one_line_and_no_request(trap, tmp_path):
    """``coca_roberta-ViT-B-32:ckpt``: its tokenizer and text tower are roberta-base
    from the hub (ten requests before issue 27)."""
    spec = f"{HUB_TEXT_TOWER}:{_checkpoint(tmp_path)}"
    done = _run(_answer(spec), _env(trap, tmp_path))
    assert done.returncode == 2 and done.stdout == ""
    assert _one_error_line(done.stderr) == (
        f"error: {spec}: the tokenizer is the Hugging Face model 'roberta-base' (text_cfg.hf_tokenizer_name), "
        "not in the local cache; downloads need allow_download=True (--allow-download)"
    )
    assert trap.requests == []


def test_open_clip_folder_with_hf_model_name_is_one_line_and_no_request(trap, tmp_path):
    folder = _open_clip_folder(tmp_path, "roberta-base")
    done = _run(_answer(str(folder)), _env(trap, tmp_path))
    assert done.returncode == 2 and done.stdout == ""
    assert _one_error_line(done.stderr) == (
        f"error: {folder}: the text tower is the Hugging Face model 'roberta-base' (text_cfg.hf_model_name), "
        "not in the local cache; downloads need allow_download=True (--allow-download)"
    )
    assert trap.requests == []


def test_library_load_without_allow_download_makes_no_request(trap, tmp_path):
    """``core.load_model`` in a process no entry point set up (a notebook, a script)."""
    spec = f"{HUB_TEXT_TOWER}:{_checkpoint(tmp_path)}"
    probe = f"import core\ntry:\n    core.load_model({spec!r})\nexcept core.ModelLoadError as e:\n    print(e)\n"
    done = _run(["-c", probe], _env(trap, tmp_path))
    assert done.returncode == 0, done.stderr
    assert "'roberta-base' (text_cfg.hf_tokenizer_name), not in the local cache" in done.stdout
    assert trap.requests == []


def test_app_loader_makes_no_request(trap, tmp_path):
    """The app's loader path (vlm-readout-app, its worker's core.load_model):
    the failed load is shown in the window; the process asks nothing of the network."""
    spec = f"{HUB_TEXT_TOWER}:{_checkpoint(tmp_path)}"
    shot = tmp_path / "app.png"
    done = _run(["-m", "app", "--model", spec, "--screenshot", str(shot)], _env(trap, tmp_path))
    assert done.returncode == 0, done.stderr
    assert all(line.startswith(("error: ", "warning: ")) for line in done.stderr.splitlines()), done.stderr
    assert shot.is_file()
    assert trap.requests == []


# ---------------------------------------------------------------- with --allow-download the trap does see them


def test_allow_download_reaches_the_trap(trap, tmp_path):
    """The same trap sees the requests once downloads are allowed: the tests
    above would notice a loader that fetched."""
    done = _run(_answer("someone/not-cached-anywhere", "--allow-download"), _env(trap, tmp_path))
    assert done.returncode == 2
    assert _one_error_line(done.stderr).startswith("error: someone/not-cached-anywhere: cannot load (")
    assert any("someone/not-cached-anywhere" in request for request in trap.requests), trap.requests


def test_allow_download_keeps_the_users_own_offline_switch(trap, tmp_path):
    done = _run(_answer("someone/not-cached-anywhere", "--allow-download"), _env(trap, tmp_path, HF_HUB_OFFLINE="1"))
    assert done.returncode == 2
    assert "HF_HUB_OFFLINE is set in the environment" in _one_error_line(done.stderr)
    assert trap.requests == []


# ---------------------------------------------------------------- the switch itself


def test_entry_points_set_the_switches_before_any_hub_library_is_imported(tmp_path):
    """core.cli is imported (and the command line parsed) without importing a
    hub library, so main() going offline first is in time; the app and the
    bundle's launcher use the same switch."""
    probe = (
        "import sys, core.cli\n"
        "core.cli.build_parser().parse_args(['answer', '--top-k', '3'])\n"
        "print(sorted(m for m in ('huggingface_hub', 'transformers', 'open_clip') if m in sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in offline.SWITCHES}
    done = _run(["-c", probe], env)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    assert "offline.go_offline()" in (ROOT / "app" / "__main__.py").read_text()
    launcher = (ROOT / "installer" / "launcher.py").read_text()
    assert launcher.index("offline.go_offline()") < launcher.index("import torch")


def test_offline_switch_goes_and_comes_back(monkeypatch):
    """go_offline sets every switch (and huggingface_hub's constant, once
    imported); allow_network gives back exactly what the user had."""
    import huggingface_hub.constants as hub

    monkeypatch.setattr(offline, "_users_switches", None)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    offline.go_offline()
    assert all(os.environ[name] == "1" for name in offline.SWITCHES) and hub.HF_HUB_OFFLINE is True
    assert offline.is_offline()
    offline.allow_network()
    assert "HF_HUB_OFFLINE" not in os.environ and os.environ["TRANSFORMERS_OFFLINE"] == "0"
    assert "HF_DATASETS_OFFLINE" not in os.environ and hub.HF_HUB_OFFLINE is False
    assert not offline.is_offline() and offline.users_offline_switch() is None
    with offline.offline():
        assert hub.HF_HUB_OFFLINE is True and os.environ["HF_HUB_OFFLINE"] == "1"
    assert hub.HF_HUB_OFFLINE is False and "HF_HUB_OFFLINE" not in os.environ


def test_users_own_offline_switch_survives_allow_network(monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(offline, "_users_switches", None)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "yes")
    offline.go_offline()
    offline.allow_network()
    assert os.environ["HF_HUB_OFFLINE"] == "yes" and hub.HF_HUB_OFFLINE is True
    assert offline.users_offline_switch() == "HF_HUB_OFFLINE"


# ---------------------------------------------------------------- HF text towers from a local folder


def _tiny_roberta(folder: Path) -> Path:
    from transformers import RobertaConfig

    folder.mkdir()
    RobertaConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    ).save_pretrained(folder)
    return folder


def test_hf_text_tower_from_a_local_folder_is_built_offline(tmp_path):
    """``hf_model_name`` naming a local folder: the tower is built from its
    config alone (the library's own weights are never fetched), so what
    refuses the load is the checkpoint lacking the tower's tensors."""
    folder = _open_clip_folder(tmp_path, str(_tiny_roberta(tmp_path / "roberta")))
    with pytest.raises(ModelLoadError) as e:
        load_model(folder)
    message = str(e.value)
    assert "\n" not in message and "missing" in message and "text.transformer" in message, message


def test_hf_text_tower_folder_whose_config_is_a_fifo_is_refused(tmp_path):
    roberta = tmp_path / "roberta"
    roberta.mkdir()
    os.mkfifo(roberta / "config.json")
    folder = _open_clip_folder(tmp_path, str(roberta))
    with pytest.raises(ModelLoadError) as e:
        load_model(folder)
    assert str(e.value) == (
        f"{folder / 'open_clip_config.json'} model_cfg.text_cfg.hf_model_name: "
        f"{roberta / 'config.json'} is not a regular file"
    )


@pytest.mark.parametrize(
    ("value", "shown"),
    [(5, "int 5"), ("", 'str ""'), (["roberta-base"], 'list ["roberta-base"]'), ({"a": [[[]]]}, 'dict {"a": [[[]]]}')],
)
def test_hf_model_name_that_is_not_a_name_is_one_line(tmp_path, value, shown):
    folder = _open_clip_folder(tmp_path, value)
    with pytest.raises(ModelLoadError) as e:
        load_model(folder)
    assert str(e.value) == (
        f"{folder / 'open_clip_config.json'} model_cfg.text_cfg.hf_model_name: "
        f"expected a Hugging Face model name or folder, got {shown}"
    )


def test_checkpoint_that_is_not_a_regular_file_is_not_taken_for_a_tag(tmp_path):
    fifo = tmp_path / "weights.safetensors"
    os.mkfifo(fifo)
    for allow_download in (False, True):
        with pytest.raises(ModelLoadError) as e:
            load_model(f"coca_ViT-B-32:{fifo}", allow_download=allow_download)
        assert str(e.value) == f"{fifo}: not a regular file (a folder, FIFO, socket, device or broken link)"
