"""Edited forwards (core/forward/edits.py) and the DLA-versus-re-run comparison,
checked against what the edit must do by construction."""

import pytest
import torch
from PIL import Image

from core import load_model
from core.forward.capture import capture
from core.forward.edits import Edit
from core.methods.residual import compare_with_rerun, decompose
from core.zoo import scenes
from tests.core.exactness import head_removal_tol, removal_tol
from tests.core.test_capture_coca import tiny_coca_float64
from tests.core.test_capture_llava import tiny_llava_float64


@pytest.fixture(scope="module", params=["tiny-llava", "tiny-coca", "shapes-llava"])
def case(request):
    m = {"tiny-llava": tiny_llava_float64, "tiny-coca": tiny_coca_float64}.get(request.param)
    m = m() if m else load_model(request.param)
    s = scenes.make_sample("heldout", 9)
    inputs = m.adapter.prepare([Image.fromarray(s.image)], [s.question])
    trace = capture(m, None, "", inputs=inputs, keep_attn_out=True)
    return m, inputs, trace, s


def test_zeroing_a_head_removes_exactly_its_write_at_that_position(case):
    m, inputs, trace, _ = case
    a = m.adapter
    pos = int(trace.answer_positions[0])
    block, head = 1, 2
    edited = capture(m, None, "", inputs=inputs, edits=[Edit(block, head, (pos,))], keep_attn_out=True)
    assert edited.edits and not trace.edits
    expected = trace.attn_out[block][0, pos] - trace.head_output(a, block, pos)[head]
    tol = head_removal_tol(a, trace, block, pos)
    torch.testing.assert_close(edited.attn_out[block][0, pos], expected, atol=tol, rtol=0)
    # earlier positions and earlier blocks are untouched (causal)
    torch.testing.assert_close(edited.resid_pre[block], trace.resid_pre[block], atol=0, rtol=0)
    torch.testing.assert_close(edited.attn_out[block][0, :pos], trace.attn_out[block][0, :pos], atol=0, rtol=0)


def test_patching_a_write_with_its_own_value_changes_nothing(case):
    """Exactly: the same values go through the same ops."""
    m, inputs, trace, _ = case
    pos = int(trace.answer_positions[0])
    z_own = trace.z[0][0, pos : pos + 1, 1]  # (1, d_head)
    mlp_own = trace.mlp_out[1][0, pos : pos + 1]  # (1, d_model)
    edited = capture(m, None, "", inputs=inputs, edits=[Edit(0, 1, (pos,), z_own), Edit(1, None, (pos,), mlp_own)])
    torch.testing.assert_close(edited.logits, trace.logits, atol=0, rtol=0)


def test_rerun_of_the_last_mlp_is_its_exact_direct_effect(case):
    """Nothing follows the last block's MLP: removing it and re-running must
    equal recomputing the final norm without it; the linear conventions are
    reported beside it."""
    m, inputs, trace, s = case
    a = m.adapter
    answer, foil = a.token_id(s.answer), a.token_id(s.foil)
    last = f"{trace.block_names[-1]}.mlp"
    cmp = compare_with_rerun(m, trace, answer, foil, names=[last, f"{trace.block_names[0]}.H0"], inputs=inputs)
    row = cmp.rows[0]
    p = cmp.position
    tol = removal_tol(a, trace, p, answer, foil, trace.mlp_out[-1][0, p])
    assert row.total_removal == pytest.approx(row.direct_removal, abs=tol)
    dec = {c.name: c for c in decompose(a, trace, answer, foil).components}
    assert row.dla_frozen == dec[last].dla_frozen  # the same decomposition
    assert "actual re-run" in " ".join(cmp.audit.controls)


def test_top_components_are_chosen_by_frozen_dla_and_biases_are_refused(case):
    m, inputs, trace, s = case
    a = m.adapter
    answer = a.token_id(s.answer)
    cmp = compare_with_rerun(m, trace, answer, top=4, inputs=inputs)
    assert len(cmp.rows) == 4
    assert [abs(r.dla_frozen) for r in cmp.rows] == sorted((abs(r.dla_frozen) for r in cmp.rows), reverse=True)
    assert set(cmp.rank_correlation) == {"dla_frozen", "dla_jacobian", "direct_removal"}
    with pytest.raises(ValueError, match="cannot be removed"):
        compare_with_rerun(m, trace, answer, names=["embed"], inputs=inputs)
