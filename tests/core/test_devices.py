"""Devices: a model spread by a device map runs every read-out, intervention
and generation as the model on one device does, and a device the machine does
not have is one line.

On the CPU the model is dispatched with accelerate itself (``dispatch_model``,
``force_hooks``): every decoder layer, the embeddings, the vision tower, the
final norm and the unembedding are separate device-map entries, so each runs
behind accelerate's ``AlignDevicesHook`` (the inputs moved by the hook after
the capture's forward pre-hooks ran, outputs handed back at the top) exactly
as on several GPUs. CPU-to-CPU moves copy nothing, so the numbers are the
model's bitwise; the model is dispatched in place (a copy of the weights at
other addresses may round differently) and its hooks removed after.
``bench/gpu_scale.sh`` is the GPU check of the same paths."""

import contextlib
import json
import logging

import pytest
import torch

from core import load_model
from core.analyze import analyze
from core.cli import main
from core.errors import ModelLoadError
from core.generate import generate
from core.methods.interventions import knockout, patch_visual_features, run_interventions, visual_keys, zero_ablation
from core.models.loading import resources_dir

SAMPLES = resources_dir() / "samples"
IMAGE, OTHER = SAMPLES / "sample_00.png", SAMPLES / "sample_01.png"
QUESTION = "what shape is the blue object?"


def split_device_map(model, layers) -> dict[str, str]:
    """A device map (every entry "cpu") with each module of ``layers`` an entry of
    its own and the rest of the model cut into the largest modules holding none of them."""
    names = {id(m): n for n, m in model.named_modules()}
    layer_names = {names[id(m)] for m in layers}
    device_map: dict[str, str] = {}

    def visit(prefix: str, module) -> None:
        for name, child in module.named_children():
            full = prefix + name
            if full in layer_names or not any(n.startswith(full + ".") for n in layer_names):
                device_map[full] = "cpu"
            else:
                visit(full + ".", child)

    visit("", model)
    return device_map


@contextlib.contextmanager
def dispatched(loaded):
    """``loaded``'s model behind accelerate's hooks, one device-map entry per block, for the block."""
    from accelerate import dispatch_model
    from accelerate.hooks import AlignDevicesHook, remove_hook_from_submodules

    adapter = loaded.adapter
    layers = [adapter.layer_module(b) for b in range(len(adapter.blocks))]
    device_map = split_device_map(loaded.model, layers)
    logger = logging.getLogger("accelerate.big_modeling")
    level = logger.level
    logger.setLevel(logging.ERROR)  # "offloaded to the cpu": not so, the main device is the CPU
    try:
        dispatch_model(loaded.model, device_map=device_map, main_device="cpu", force_hooks=True)
    finally:
        logger.setLevel(level)
    try:
        assert all(isinstance(getattr(m, "_hf_hook", None), AlignDevicesHook) for m in layers)
        assert len(device_map) > len(layers) + 2  # embeddings, vision tower, norm, head: entries of their own
        yield loaded
    finally:
        remove_hook_from_submodules(loaded.model)


@pytest.fixture(scope="module")
def llava():
    return load_model("shapes-llava")  # its own copy: dispatched in place below


def _json(result) -> str:
    return json.dumps(result.to_dict(), sort_keys=True, default=str)


def _runs(m) -> dict[str, str]:
    """Every kind of run, as JSON: analyze, a head ablation and an attention
    knockout, visual-feature patching, a KV-cache generation."""
    adapter = m.adapter
    inputs = adapter.prepare([IMAGE], [QUESTION])
    square, triangle = adapter.token_id("square"), adapter.token_id("triangle")
    answer = int(inputs.answer_positions[0])
    from core.forward.capture import capture

    base = capture(m, IMAGE, QUESTION, inputs=inputs)
    edits = {
        "L1.H0": [zero_ablation(1, 0, positions=[answer])],
        "L2.mlp": [zero_ablation(2, None)],
        "knockout": [knockout(2, visual_keys(base, 2, range(8)), positions=[answer])],
    }
    return {
        "analyze": _json(analyze(m, IMAGE, QUESTION, answer="square", foil="triangle")),
        "interventions": _json(run_interventions(m, inputs, edits, square, triangle, base=base)),
        "patching": _json(
            patch_visual_features(
                m, IMAGE, QUESTION, OTHER, site="projector_out", token_sets={"first": range(6)}, answer="square"
            )
        ),
        "generate": _json(generate(m, IMAGE, QUESTION, max_new_tokens=4)),
        "generate_rerun": _json(generate(m, IMAGE, QUESTION, max_new_tokens=4, use_cache=False)),
    }


def test_a_model_behind_accelerate_hooks_reads_out_as_the_model(llava):
    """Capture, recomputed rows, edits (head, MLP, knockout, visual features)
    and the KV cache through accelerate's hooks: the same numbers, bitwise."""
    want = _runs(llava)
    with dispatched(llava):
        got = _runs(llava)
    assert got.keys() == want.keys()
    for kind in want:
        assert got[kind] == want[kind], kind


def test_capture_records_each_block_where_its_weights_are(llava):
    """The capture's records of a block's input and the final norm's input live
    on the device of that module's weights (here the CPU, through the hooks)."""
    from core.forward.capture import capture

    with dispatched(llava) as m:
        trace = capture(m, IMAGE, QUESTION)
        for block in range(trace.n_blocks):
            weight = next(m.adapter.layer_module(block).parameters())
            assert trace.resid_pre[block].device == weight.device
        assert trace.final_resid.device == m.adapter.final_norm_layer().weight.device


def test_device_auto_on_the_cpu_loads_the_same_model():
    """``device="auto"`` (accelerate's device map; a dependency) on a machine
    without a GPU: the model on the CPU, answering as ``device="cpu"``."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: auto spreads the model over it (bench/gpu_scale.sh)")
    auto, cpu = load_model("shapes-llava", device="auto"), load_model("shapes-llava", device="cpu")
    assert {p.device.type for p in auto.model.parameters()} == {"cpu"}
    assert auto.info.get("device", "cpu") == "cpu"
    with torch.no_grad():
        got = auto.adapter.next_token_logits(auto.adapter.prepare([IMAGE], [QUESTION]))
        want = cpu.adapter.next_token_logits(cpu.adapter.prepare([IMAGE], [QUESTION]))
    assert torch.equal(got, want)


def test_device_auto_without_accelerate_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(ModelLoadError, match="accelerate"):
        load_model("shapes-llava", device="auto")


@pytest.mark.parametrize(
    "device, message",
    [
        ("cuda", "CUDA is not available"),
        ("cuda:1", "CUDA is not available"),
        ("gpu", "not a device"),
        ("cuda:x", "not a device"),
        ("meta", "not supported"),
    ],
)
def test_a_device_this_machine_lacks_is_one_line_from_the_cli(device, message, capsys):
    if torch.cuda.is_available() and device.startswith("cuda"):
        pytest.skip("this machine has CUDA")
    argv = ["answer", "--model", "shapes-llava", "--image", str(IMAGE), "--question", QUESTION]
    assert main([*argv, "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
