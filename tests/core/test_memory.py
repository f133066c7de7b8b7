"""The memory check before any allocation and the ``auto`` dtype (core/models/memory.py):
a model or a read-out too large for the memory available is refused in one line
naming both figures and the dtype that would fit; VLM_READOUT_MEMORY_AVAILABLE
lowers the reported figure, so no test needs a large file."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import core
from core.errors import ModelTooLargeError
from core.models.loading import resources_dir
from core.models.memory import (
    GB,
    LARGE_MODEL_PARAMETERS,
    MEMORY_ENV,
    MemoryPlan,
    ModelSizes,
    available_bytes,
    check_working_set,
    parameter_counts,
    parse_bytes,
    resolve_dtype,
    weights_bytes,
    working_set_bytes,
)
from core.models.weights_check import check_safetensors

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "resources" / "samples" / "sample_00.png"
QUESTION = "what shape is the blue object?"
SIZE = r"\d+\.\d (GB|MB)"
# a load names the folder it read; a read-out, what the user named
LLAVA_DIR = re.escape(str(resources_dir() / "models" / "shapes-llava"))


@pytest.fixture(scope="module")
def shapes_llava():
    return core.load_model("shapes-llava")


def test_the_message_reads_as_the_issue_says():
    plan = MemoryPlan(
        weights=int(27.0 * GB), working_set=int(1.1 * GB), available=int(21.7 * GB), dtype=torch.float32,
        smaller=(torch.bfloat16, int(14.1 * GB)),
    )  # fmt: skip
    with pytest.raises(ModelTooLargeError) as e:
        plan.check()
    assert (
        str(e.value) == "the model: needs ~28.1 GB in float32 and 21.7 GB is available; --dtype bfloat16 needs ~14.1 GB"
    )
    tight = MemoryPlan(int(28.1 * GB), 0, int(10 * GB), torch.float32, (torch.bfloat16, int(14.1 * GB)))
    assert tight.message().endswith("; even bfloat16 needs ~14.1 GB") and tight.fitting_dtype is None
    assert MemoryPlan(int(GB), 0, int(2 * GB), torch.float32).check().fits


@pytest.mark.parametrize(
    ("text", "expected"),
    [("123456", 123456), ("21.7GB", 21_700_000_000), ("8GiB", 8 * 2**30), ("1MB", 10**6), ("2 mib", 2 * 2**20)],
)
def test_the_override_takes_bytes_or_a_unit(text, expected, monkeypatch):
    assert parse_bytes(text) == expected
    monkeypatch.setenv(MEMORY_ENV, text)
    assert available_bytes("cpu") == expected


def test_a_malformed_override_is_one_line(monkeypatch):
    monkeypatch.setenv(MEMORY_ENV, "lots")
    with pytest.raises(ModelTooLargeError, match=f"^{MEMORY_ENV}: 'lots': expected a number of bytes"):
        available_bytes("cpu")


def test_the_reported_figure_is_memavailable_without_the_override(monkeypatch):
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    meminfo = Path("/proc/meminfo").read_text()
    kib = int(re.search(r"MemAvailable:\s+(\d+) kB", meminfo).group(1))
    assert abs(available_bytes("cpu") - kib * 1024) < 2**30  # the machine's other work moves it a little


def test_a_model_too_large_is_refused_before_any_allocation(monkeypatch):
    """The plan runs on the headers and the config: the library's from_pretrained is never reached."""
    from transformers import AutoModelForImageTextToText

    def never(*args, **kwargs):
        raise AssertionError("the model was allocated before the memory check")

    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", never)
    monkeypatch.setenv(MEMORY_ENV, "3MB")
    with pytest.raises(ModelTooLargeError) as e:  # auto: float32 does not fit, bfloat16 neither
        core.load_model("shapes-llava")
    smallest = rf"{LLAVA_DIR}: needs ~{SIZE} in bfloat16 and 3\.0 MB is available; bfloat16 is the smallest --dtype"
    assert re.fullmatch(smallest, str(e.value))
    with pytest.raises(ModelTooLargeError) as e:
        core.load_model("shapes-llava", dtype="float32")
    none_fits = rf"{LLAVA_DIR}: needs ~{SIZE} in float32 and 3\.0 MB is available; even bfloat16 needs ~{SIZE}"
    assert re.fullmatch(none_fits, str(e.value))
    monkeypatch.setenv(MEMORY_ENV, "8MB")  # bfloat16 fits, float32 does not
    with pytest.raises(ModelTooLargeError) as e:
        core.load_model("shapes-llava", dtype=torch.float32)
    half_fits = rf"{LLAVA_DIR}: needs ~{SIZE} in float32 and 8\.0 MB is available; --dtype bfloat16 needs ~{SIZE}"
    assert re.fullmatch(half_fits, str(e.value))


def test_open_clip_models_are_checked_from_their_header(monkeypatch):
    import open_clip

    def never(*args, **kwargs):
        raise AssertionError("the model was built before the memory check")

    monkeypatch.setattr(open_clip, "create_model_and_transforms", never)
    monkeypatch.setenv(MEMORY_ENV, "1MB")
    with pytest.raises(ModelTooLargeError, match=r"^.*/shapes-coca: needs ~.* and 1\.0 MB is available"):
        core.load_model("shapes-coca", dtype="float32")


def test_auto_loads_in_bfloat16_where_float32_does_not_fit(monkeypatch):
    monkeypatch.setenv(MEMORY_ENV, "8MB")
    loaded = core.load_model("shapes-llava")
    assert loaded.info["dtype"] == "bfloat16" and loaded.info["device"] == "cpu"
    assert loaded.adapter.parameters_dtype == torch.bfloat16
    monkeypatch.delenv(MEMORY_ENV)
    assert core.load_model("shapes-llava", dtype=None).info["dtype"] == "float32"  # None is "auto"
    assert core.load_model("shapes-llava", dtype="float16").info["dtype"] == "float16"


def test_the_cli_refuses_in_one_line_with_status_2(monkeypatch):
    cli = Path(sys.executable).parent / "vlm-readout"
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "core.cli"]
    done = subprocess.run(
        [*command, "answer", "--model", "shapes-llava", "--image", str(SAMPLE), "--question", QUESTION],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**__import__("os").environ, MEMORY_ENV: "1MB"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert re.fullmatch(rf"error: {LLAVA_DIR}: needs ~{SIZE} in bfloat16 and 1\.0 MB is available; .*", lines[0])


def test_auto_rule():
    fp32, bf16 = torch.float32, torch.bfloat16
    need = {fp32: 20 * 10**9}
    # CPU: float32 when it fits, else bfloat16
    assert resolve_dtype("auto", device="cpu", need_bytes_by_dtype=need, available=30 * 10**9) == fp32
    assert resolve_dtype("auto", device="cpu", need_bytes_by_dtype=need, available=15 * 10**9) == bf16
    assert resolve_dtype(None, device=None, need_bytes_by_dtype=need, available=15 * 10**9) == bf16
    # CUDA: the checkpoint's own dtype; bfloat16 for a float32 checkpoint over 1B parameters
    big, small = LARGE_MODEL_PARAMETERS + 1, 10**8
    assert resolve_dtype("auto", device="cuda", config_dtype="float16", n_params=big) == torch.float16
    assert resolve_dtype("auto", device="cuda:0", config_dtype="bfloat16", n_params=small) == bf16
    assert resolve_dtype("auto", device="cuda", config_dtype="float32", n_params=big) == bf16
    assert resolve_dtype("auto", device="cuda", config_dtype=torch.float32, n_params=small) == fp32
    # a dtype asked for is taken as given, whatever fits
    assert resolve_dtype("float32", device="cpu", need_bytes_by_dtype=need, available=1) == fp32
    assert resolve_dtype(torch.float16, device="cuda", config_dtype="float32", n_params=big) == torch.float16


def test_weights_bytes_from_the_headers(tmp_path):
    """Floating tensors take the chosen dtype's size, integer and boolean buffers keep theirs."""
    from safetensors.torch import load_file, save_file

    tensors = {
        "w": torch.randn(7, 5),
        "h": torch.randn(3, 4, dtype=torch.bfloat16),
        "d": torch.randn(2, dtype=torch.float64),
        "ids": torch.arange(11),
        "mask": torch.ones(6, dtype=torch.bool),
        "count": torch.zeros(3, dtype=torch.int32),
    }
    f = tmp_path / "model.safetensors"
    save_file(tensors, str(f))
    counts = parameter_counts(check_safetensors([f]))
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        expected = sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.itemsize) for t in tensors.values())
        assert weights_bytes(counts, dtype) == expected
    shipped = resources_dir() / "models" / "shapes-llava" / "model.safetensors"
    state = load_file(str(shipped))
    counts = parameter_counts(check_safetensors([shipped]))
    assert weights_bytes(counts, torch.bfloat16) == sum(t.numel() * 2 for t in state.values())


def test_working_set_grows_with_the_prompt():
    sizes = ModelSizes(n_blocks=32, d_model=4096, n_heads=32, d_mlp=11008, vocab=32000, n_visual=576)
    short = working_set_bytes(sizes, 640, torch.bfloat16)
    long = working_set_bytes(sizes, 6400, torch.bfloat16)
    assert 9.9 * short < long < 10.1 * short  # linear in T on the sdpa path
    kept = 3 * 32 * 6400 * 4096 * 2  # resid_pre, z, mlp_out per block
    assert long > kept + 6400 * 32000 * (2 + 4)  # plus the logits, in bfloat16 and a float32 copy
    eager = working_set_bytes(sizes, 6400, torch.bfloat16, eager=True)
    assert eager - long == 32 * 6400 * 6400 * (2 + 4)  # one layer's weights and their float32 softmax
    assert working_set_bytes(sizes, 6400, torch.bfloat16, "forward") < long
    # mixture-of-experts MLPs: each MoE module's input is kept too (one more stream per block)
    moe = ModelSizes(n_blocks=32, d_model=4096, n_heads=32, d_mlp=11008, vocab=32000, n_visual=576, experts=True)
    assert working_set_bytes(moe, 6400, torch.bfloat16) - long == 32 * 6400 * 4096 * 2
    assert ModelSizes.from_hf_config({"text_config": {"num_experts": 128, "hidden_size": 64}}).experts
    assert ModelSizes.from_hf_config({"text_config": {"num_local_experts": 16}}).experts
    assert not ModelSizes.from_hf_config({"text_config": {"hidden_size": 64}}).experts


def test_a_long_prompt_is_refused_before_the_readout(shapes_llava, monkeypatch):
    monkeypatch.setenv(MEMORY_ENV, "5MB")  # beside the loaded weights
    assert check_working_set(shapes_llava, 200).fits
    with pytest.raises(ModelTooLargeError) as e:
        check_working_set(shapes_llava, 100_000)
    assert re.fullmatch(
        rf"shapes-llava: needs ~{SIZE} in float32 for 100,000 tokens and {SIZE} is available; even bfloat16 needs ~{SIZE}",
        str(e.value),
    )
    monkeypatch.setenv(MEMORY_ENV, "1")  # nothing free beside the weights: analyze refuses before its capture
    from core.analyze import analyze

    with pytest.raises(ModelTooLargeError, match=r"^shapes-llava: needs ~.* for \d+ tokens and "):
        analyze(shapes_llava, SAMPLE, QUESTION)
