"""Read-outs of a half-precision model accumulate in float32 (docs/METHODS.md,
"Precision"), and the reconstruction check judges the residual split against
the model dtype's rounding: a correct bfloat16 / float16 run passes, a float32
split missing a component fails."""

from __future__ import annotations

import json
import math

import pytest
import torch

import core
from core.analyze import analyze
from core.forward.capture import capture
from core.methods.residual import component_stack, decompose, target_direction
from core.shell.precision import dtype_name, unit_roundoff

SAMPLES = "resources/samples"
U32 = unit_roundoff(torch.float32)


def _samples(n: int = 2) -> list[dict]:
    with open(f"{SAMPLES}/pairs.jsonl") as f:
        return [json.loads(line) for line in f.readlines()[:n]]


@pytest.fixture(scope="module", params=["shapes-llava", "shapes-coca"])
def spec(request):
    return request.param


@pytest.fixture(scope="module")
def float32_model(spec):
    return core.load_model(spec)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def half_model(request, spec):
    return core.load_model(spec, dtype=request.param)


def _finite_numbers(value, where: str = "") -> list[str]:
    """The paths of the non-finite floats in a JSON-like value."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [where]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _finite_numbers(v, f"{where}.{k}")]
    if isinstance(value, list | tuple):
        return [p for i, v in enumerate(value) for p in _finite_numbers(v, f"{where}[{i}]")]
    return []


def _capture(loaded, sample):
    image = core.load_image(f"{SAMPLES}/{sample['image']}")
    return capture(loaded, image, sample["question"], pattern_layers=[])


def test_half_precision_analyze_is_finite_and_its_reconstruction_ok(half_model, float32_model):
    dtype = half_model.adapter.parameters_dtype
    for sample in _samples():
        result = analyze(
            half_model, f"{SAMPLES}/{sample['image']}", sample["question"], answer=sample["answer"], foil=sample["foil"]
        )
        doc = result.to_dict()
        assert _finite_numbers(doc) == []
        rd = doc["residual_decomposition"]
        # a correct half-precision run: its error is the model's rounding, within the bound
        assert rd["reconstruction_ok"] and rd["reconstruction_rel_err"] <= rd["reconstruction_bound"]
        assert rd["reconstruction_bound"] < 30 * result.model.n_layers * unit_roundoff(dtype)
        assert f"for {dtype_name(dtype)}): ok" in result.summary()
        # text-side pattern rows: the float32 softmax sums to 1 to float32 rounding over its keys
        # (a half-precision softmax would miss by about 2^-9)
        tp = doc["text_patterns"]
        n_keys = len(result.input.input_ids)
        for block, others in zip(tp["patterns"], tp["other_mass"], strict=True):
            for h, head in enumerate(block):
                for q, row in enumerate(head):
                    total = sum(row) + sum(v[h][q] for v in others.values())
                    assert abs(total - 1) <= (n_keys + 4) * U32

        # the answer: the float32 model's wherever its top-two gap exceeds what the half forward moved
        reference = _capture(float32_model, sample)
        pos = int(reference.answer_positions[0])
        z32 = reference.logits[0, pos].double()
        zh = _capture(half_model, sample).logits[0, pos].double()
        forward_error = float((zh - z32).abs().max())
        top2 = z32.topk(2).values
        if float(top2[0] - top2[1]) > 2 * forward_error:
            assert result.target.predicted_id == int(z32.argmax())


@torch.no_grad()
def test_half_precision_frozen_dla_sums_in_float32(half_model):
    """Each ``dla_frozen`` is the float32 dot product ``g . c_i`` of a half-precision
    component (exactly representable in float32), so the components' sum differs from
    the float64 sum of the same products by float32 rounding only, and from
    ``frozen_sum_expected`` by that plus ``g . (sum c - x_L)``, the model's own
    rounding of x_L (Cauchy-Schwarz: ``|g| |sum c - x_L|``)."""
    adapter = half_model.adapter
    for sample in _samples():
        trace = _capture(half_model, sample)
        answer, foil = adapter.as_token_id(sample["answer"]), adapter.as_token_id(sample["foil"])
        r = decompose(adapter, trace, answer, foil)
        _, C = component_stack(adapter, trace, r.position)
        C64 = C.double()
        x64 = trace.final_resid[0, r.position].double()
        g = adapter.final_norm_layer().frozen_readout(x64, target_direction(adapter, answer, foil).double())
        terms = float((C64 * g).abs().sum())  # sum_i sum_k |g_k c_ik|
        d = C.shape[-1]
        got = sum(c.dla_frozen for c in r.components)
        exact = float((C64 @ g).sum())
        float32_tol = (d + 4) * U32 * terms
        assert abs(got - exact) <= float32_tol
        # the test tells float32 from half-precision accumulation: a half sum would round by far more
        assert float32_tol < unit_roundoff(adapter.parameters_dtype) * abs(exact)
        residue = float((C64.sum(0) - x64).norm())
        expected_tol = float32_tol + float(g.norm()) * residue + (d + 4) * U32 * float((g * x64).abs().sum())
        assert abs(got - r.frozen_sum_expected) <= expected_tol


def test_float32_split_missing_a_component_fails_the_verdict(monkeypatch):
    loaded = core.load_model("shapes-llava")
    adapter = loaded.adapter
    sample = _samples(1)[0]
    trace = _capture(loaded, sample)
    answer, foil = adapter.as_token_id(sample["answer"]), adapter.as_token_id(sample["foil"])
    whole = decompose(adapter, trace, answer, foil)
    assert whole.reconstruction_ok and whole.to_dict()["reconstruction_ok"] is True

    names, C = component_stack(adapter, trace, whole.position)
    dropped = min(range(len(names)), key=lambda i: float(C[i].norm()) if names[i] != "embed" else math.inf)
    keep = [i for i in range(len(names)) if i != dropped]  # the smallest write, not the embedding
    monkeypatch.setattr(adapter, "component_stack", lambda tr, pos, batch=0: ([names[i] for i in keep], C[keep]))
    broken = decompose(adapter, trace, answer, foil)
    assert not broken.reconstruction_ok and broken.to_dict()["reconstruction_ok"] is False
    assert broken.reconstruction_rel_err > broken.reconstruction_bound
    assert "reconstruction error exceeds the float32 bound: the decomposition is not exact" in broken.audit.notes
