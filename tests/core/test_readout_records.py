"""Every method result is a :class:`core.results.readout.Readout`, and
:meth:`core.session.Session.record` stores what it says about itself: its
kind, its ``to_dict()`` JSON, its one-line ``summary()``, its ``parameters()``
(with the caller's additions) and its ``audit_records()``; nothing is guessed
from a result's keys. The answer numbers of every method are one
:class:`core.results.readout.Target`."""

import functools
import json

import pytest

from core.methods import interventions as iv
from core.methods.counterfactual import occlusion_sweep, region_counterfactual
from core.methods.tuned_lens.evaluate import LensEvaluation, ReaderMetrics
from core.methods.validation.chain import InputCondition, ValidationChain
from core.results.readout import Readout, RecordedResult, Target
from core.session import Session
from core.zoo.distractor_scenes import scenes_with_distractor
from tests.core.test_capture_llava import tiny_llava_float64 as _tiny_llava
from tests.core.test_interventions import colour_pair

tiny_llava_float64 = functools.cache(_tiny_llava)


@pytest.fixture(scope="module")
def llava():
    return tiny_llava_float64()


@pytest.fixture(scope="module")
def sample():
    return scenes_with_distractor("heldout", 2)[1]


@pytest.fixture
def session():
    s = Session.temporary()
    yield s
    s.close()


def _recorded_as_said(session: Session, readout, **kwargs) -> dict:
    """Record ``readout`` and check the run is what it says about itself; returns the stored parameters."""
    assert isinstance(readout, Readout)
    rid = session.record(readout, **kwargs)
    run = session.run(rid)
    assert run.kind == readout.kind
    assert run.result == json.loads(json.dumps(readout.to_dict()))
    assert run.summary == " ".join(readout.summary().split()) and run.summary
    assert run.audits == [a.to_dict() for a in readout.audit_records()] and run.audits
    assert run.parameters == {**json.loads(json.dumps(readout.parameters())), **kwargs.get("parameters", {})}
    return run.parameters


def test_counterfactual_and_sweep_record_themselves(llava, sample, session):
    m = sample.objects[sample.target].mask
    r = region_counterfactual(llava, sample.image, sample.question, m, "mean", answer=sample.answer, foil=sample.foil)
    assert isinstance(r.original, Target) and isinstance(r.edited, Target)
    params = _recorded_as_said(session, r, image=sample.image, mask=m, parameters={"question": sample.question})
    assert params["fill"] == "mean" and params["mask_area_px"] == int(m.sum()) and params["foil"] == sample.foil
    assert params["question"] == sample.question  # the caller's addition, merged
    assert r.summary() == r.summary_of(r.to_dict()) and r.summary().startswith(f"fill mean: {sample.answer!r}")
    doc = r.to_dict()
    assert set(doc["original"]) >= {
        "answer",
        "answer_id",
        "foil",
        "foil_id",
        "logit",
        "logit_diff",
        "prob",
        "predicted",
        "predicted_id",
    }  # the counterfactual JSON's keys, kept

    sw = occlusion_sweep(llava, sample.image, sample.question, k=4, answer=sample.answer, foil=sample.foil)
    params = _recorded_as_said(session, sw, image=sample.image)
    assert params["k"] == 4 and params["fill"] == "mean"
    assert sw.summary().startswith("occlusion sweep 2x2 cells (k=4, fill mean)")
    assert [i.kind for i in session.runs()] == ["counterfactual", "sweep"]


def test_interventions_record_themselves(llava):
    s, cf = colour_pair(0)
    a = llava.adapter
    inputs = a.prepare([s.image], [s.question])
    ans = a.token_id(s.answer)
    res = iv.run_interventions(llava, inputs, {"L1.H0 zero": [iv.zero_ablation(1, 0)]}, ans)
    assert isinstance(res.original, Target) and res.original.position == res.position
    patch = iv.patch_visual_features(llava, s.image, s.question, cf.image, site="projector_out", answer=ans)
    with Session.temporary() as session:
        assert _recorded_as_said(session, res)["method"] == "ablation"
        assert _recorded_as_said(session, patch, mask=s.objects[s.target].mask)["site"] == "projector_out"
        assert [i.kind for i in session.runs()] == ["intervention", "intervention"]  # as the app records both
    assert res.summary().startswith(f"ablation at position {res.position}: L1.H0 zero: {s.answer!r} logit ")
    assert "all forward" in patch.summary() and "all reverse" in patch.summary()


def test_lens_evaluation_and_label_chain_are_readouts():
    metrics = {"trained": ReaderMetrics(0.5, 1.0, 0.9, 0.1, 4), "identity": ReaderMetrics(2.0, 3.0, 0.5, 1.0, 4)}
    ev = LensEvaluation(
        {}, {"n_samples": 2}, "answer", [{"layer": 0, "block": "L0", "readers": metrics, "by_positions": {}}]
    )
    assert isinstance(ev, Readout) and ev.kind == "lens" and ev.audit_records() == []
    assert ev.summary() == "lens on 2 samples (answer): mean KL over layers, bits: trained 0.500, identity 2.000"
    chain = ValidationChain("L1.H0", "color", "tiny", InputCondition("core.zoo.scenes", "heldout", 8))
    assert isinstance(chain, Readout) and chain.kind == "label"
    assert chain.summary() == "L1.H0 'color' (head): not a candidate; steps pass none of 7"


def test_a_document_without_a_class_is_recorded_as_said(session):
    note = RecordedResult("note", {"text": "L1.H1 looks at the object"}, "a note", {"who": "me"})
    rid = session.record(note)
    run = session.run(rid)
    assert (run.kind, run.result, run.summary, run.parameters) == ("note", note.doc, "a note", {"who": "me"})
    again = RecordedResult.of(RecordedResult("note", {"a": 1}, "one", {"p": 1}), {"a": 1, "header": True})
    assert (again.kind, again.summary(), again.parameters(), again.to_dict()) == (
        "note",
        "one",
        {"p": 1},
        {"a": 1, "header": True},
    )


def test_target_from_logits_against_a_hand_softmax():
    """Target's numbers from one float32 row of logits, against the softmax written
    out in Python floats (math.fsum over exp(z - max)): float64 arithmetic, so they
    agree to a few float64 ulps, far below float32's rounding."""
    import math

    import torch

    class Tokens:
        def token_str(self, i):
            return f"t{i}"

    logits = torch.tensor([0.5, 3.25, -1.0, 3.0, 2.0], dtype=torch.float32)
    z = [float(v) for v in logits]
    top = max(z)
    prob = math.exp(z[3] - top) / math.fsum(math.exp(v - top) for v in z)
    t = Target.from_logits(Tokens(), logits, 3, 1, position=7)
    assert (t.answer, t.answer_id, t.foil, t.foil_id, t.predicted, t.predicted_id) == ("t3", 3, "t1", 1, "t1", 1)
    assert t.logit == 3.0 and t.logit_diff == -0.25 and t.position == 7 and t.score == -0.25
    assert t.prob == pytest.approx(prob, rel=4 * 2**-52)
    assert Target.from_dict({**t.to_dict(), "top": []}) == t  # extra keys of a stored JSON are ignored
    plain = Target.from_logits(Tokens(), logits, 0)
    assert plain.foil is None and plain.logit_diff is None and plain.score == 0.5 and plain.position is None


def test_jsonable_maps_every_non_finite_float_to_none_on_the_fast_path_and_off_it():
    import math

    import numpy as np
    import torch

    from core.results.readout import jsonable

    big = 1e308
    cases = {
        "finite": ([0.5, -2.0, 3.25], [0.5, -2.0, 3.25]),
        "nan": ([1.0, math.nan, 2.0], [1.0, None, 2.0]),
        "inf_and_minus_inf": ([math.inf, -math.inf, 1.0], [None, None, 1.0]),  # their sum is nan
        "sum_overflows": ([big, big, -1.0], [big, big, -1.0]),  # finite numbers whose sum is inf
        "ints": ((1, 2, 3), [1, 2, 3]),
        "mixed": ([1, 2.0, True, None, math.nan], [1, 2.0, True, None, None]),
        "nested": ([[1.0, math.inf], (2.0,)], [[1.0, None], [2.0]]),
        "tensor": (torch.tensor([[1.0, float("nan")], [float("inf"), 0.0]]), [[1.0, None], [None, 0.0]]),
        "array": (np.array([np.float32(0.25), np.nan]), [0.25, None]),
    }
    for name, (value, expected) in cases.items():
        out = jsonable(value)
        assert out == expected, name
        json.dumps(out, allow_nan=False)  # strict JSON
