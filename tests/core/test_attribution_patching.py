"""Attribution patching (issue 29, part 4): each estimate is the derivative the
engine's own replacement edits give by central finite differences (not autograd);
the top components' actual patches are the patching grid's cells; the agreement
is Spearman's rho and the sign fraction of those pairs; the command writes and
records it and refuses bad input in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import core.cli
from core import load_model
from core.cli import main
from core.files.images import load_image
from core.forward.capture import capture, edited_logits
from core.forward.edits import Edit
from core.methods.flow.attribution import AttributionPatching, attribution_patching, spearman
from core.methods.flow.patch_grid import patch_grid
from core.models.loading import resources_dir
from core.results.readout import restore_result

SAMPLES = resources_dir() / "samples"
IMAGE, SOURCE = SAMPLES / "sample_00.png", SAMPLES / "sample_02.png"
QUESTION = "what shape is the blue object?"


@pytest.fixture(scope="module", params=["shapes-llava", "shapes-coca"])
def run(request):
    m = load_model(request.param)
    image, source = load_image(IMAGE), load_image(SOURCE)
    return m, attribution_patching(m, image, source, QUESTION, top_k=12)


@torch.no_grad()
def finite_difference(m, component, result, eps: float = 1e-2) -> float:
    """d LD / d t at t = 0 of the clean run with the activation set to clean + t (source - clean),
    by the engine's replacement edits, central differences, normalised as the estimate."""
    a = m.adapter
    image, source = load_image(IMAGE), load_image(SOURCE)
    inputs, source_inputs = a.prepare([image], [QUESTION]), a.prepare([source], [QUESTION])
    clean_trace = capture(m, None, "", pattern_layers=[], inputs=inputs)
    source_trace = capture(m, None, "", pattern_layers=[], inputs=source_inputs)
    b, p, h = clean_trace.block_names.index(component.block), component.position, component.head
    if component.site == "head":
        site, clean, src = "z", clean_trace.z[b][0, p, h], source_trace.z[b][0, p, h]
    else:
        stream = "mlp_out" if component.site == "mlp" else "resid_pre"
        site, clean, src = component.site, getattr(clean_trace, stream)[b][0, p], getattr(source_trace, stream)[b][0, p]
    answer_id, foil_id = result.clean.answer_id, result.clean.foil_id

    def ld(t: float) -> float:
        value = (clean.double() + t * (src.double() - clean.double())).to(clean.dtype)[None]
        logits = edited_logits(m, inputs, [Edit(b, h, (p,), value, site=site)])[0, int(inputs.answer_positions[0])]
        return float(logits[answer_id].double() - logits[foil_id].double())

    span = result.source.logit_diff - result.clean.logit_diff
    return (ld(eps) - ld(-eps)) / (2 * eps) / span


def test_estimates_are_the_derivative_along_the_patch(run):
    m, result = run
    for component in result.checked[:6]:
        fd = finite_difference(m, component, result)
        # central differences: O(eps^2) curvature plus float32 rounding of LD over 2 eps
        assert component.estimate == pytest.approx(fd, rel=0.05, abs=2e-3), component.name


def test_checked_components_are_actual_patches(run):
    m, result = run
    image, source = load_image(IMAGE), load_image(SOURCE)
    foil = result.clean.foil_id
    for site in ("resid", "mlp"):
        mine = [c for c in result.checked if c.site == site]
        if not mine:
            continue
        grid = patch_grid(m, image, source, QUESTION, site=site, columns="each", foil_id=foil)
        for c in mine:
            assert c.actual == pytest.approx(grid.cell(c.block, f"p{c.position}"), abs=1e-4), c.name
    ranks = lambda v: np.argsort(np.argsort(v)).astype(float)  # noqa: E731 (no ties among these floats)
    est, act = [c.estimate for c in result.checked], [c.actual for c in result.checked]
    assert result.rank_correlation == pytest.approx(np.corrcoef(ranks(est), ranks(act))[0, 1], abs=1e-9)
    assert result.sign_agreement == sum((e > 0) == (x > 0) for e, x in zip(est, act)) / len(est)
    assert [abs(c.estimate) for c in result.checked] == sorted((abs(c.estimate) for c in result.checked), reverse=True)
    doc = json.loads(json.dumps(result.to_dict()))
    restored = restore_result("attribution-patching", doc)
    assert isinstance(restored, AttributionPatching) and restored.to_dict() == doc
    assert "linear estimate" in result.summary() and "never alone" in " ".join(result.audit.notes)


def test_spearman_handles_ties_and_short_input():
    assert spearman([1, 2], [2, 1]) is None
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 1], [1, 2, 3]) is None  # a constant side
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(np.corrcoef([1, 2.5, 2.5, 4], [1, 2, 3, 4])[0, 1])


def test_the_command_writes_and_records_it(tmp_path, monkeypatch, capsys):
    m = load_model("shapes-llava")
    monkeypatch.setattr(core.cli, "_load", lambda args: m)
    out, session = tmp_path / "a.json", tmp_path / "s.vlmr"
    argv = ["attribution-patching", "--image", str(IMAGE), "--question", QUESTION, "--source-image", str(SOURCE)]
    assert main([*argv, "--top-k", "5", "--json", str(out), "--session", str(session), "--quiet"]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["checked"]) == 5 and len(doc["head_estimates"]) == len(doc["blocks"])
    assert "top 5 checked by actual patching" in capsys.readouterr().out
    from core.session import Session

    with Session.open(session) as s:
        (info,) = s.runs("attribution-patching")
        assert s.run(info.id).readout.to_dict() == doc
    assert main([*argv, "--source-image", str(IMAGE), "--json", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "both answer" in err and "\n" not in err
