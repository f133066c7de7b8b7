"""The Validation tab and the Attention tab's head actions (issue 15, part 4), on shapes-llava,
offscreen: a claim checked with the seven-step chain through the window's worker shows the
statuses of the run's own result, is recorded with its audit rows and restored from the
History; cancel, a bad subject and another model leave nothing wrong on screen; Non-unique…
and QK/OV run on the selected head, are recorded and restored.

Own file: these tests wait on worker signals (see tests/app/conftest.py).
"""

import json

import numpy as np
import pytest

from app.panels.validation_panel import COLUMNS
from core.methods.nonunique import nonunique_of_input
from core.methods.qk_ov import qk_ov
from tests.app.shown import shown_result
from tests.app.test_window import TIMEOUT_MS, run_until_idle

SUBJECT = "L1.H1"
CLAIM = "L1.H1 reads the colour of the shape asked about, at the answer position, on shape scenes"
SMALL_N = 12  # with n // 3 = 4 inputs per other question kind: a chain of a few seconds


def state_claim(window, subject: str = SUBJECT, n: int = SMALL_N) -> None:
    panel = window.validation_panel
    panel.subject_edit.setText(subject)
    panel.claim_edit.setText(CLAIM)
    panel.set_dataset("scenes")
    panel.n_spin.setValue(n)


@pytest.fixture
def checked(qtbot, window):
    """The window after one small chain on shapes-llava's L1.H1."""
    state_claim(window)
    run_until_idle(qtbot, window, window.actions.run_claim)
    assert window.inputs.error_label.text() == ""
    return window


def statuses(validation, chain: int = 0) -> list[str]:
    return [validation.chains[chain].steps[k].status for k in range(1, 8)]


def test_the_checklist_shows_the_runs_own_statuses_and_lands_in_the_session(checked):
    window, panel = checked, checked.validation_panel
    result = shown_result(window, "validate")
    assert [c.subject for c in result.chains] == [SUBJECT]
    assert panel.status_texts() == statuses(result)  # each row's status cell, from the run's result
    assert panel.table.rowCount() == 7
    verdict = result.verdicts()[0]
    said = "supported" if verdict["supported"] else f"not supported: {verdict['status']}, held back by step"
    assert panel.verdict_label.text().startswith(f"{SUBJECT}: {said}")
    # which steps passed, never a bare count (issue 31: "steps passed 7" read as seven passes)
    passed = [k for k in range(1, 8) if statuses(result)[k - 1] == "passed"]
    assert panel.verdict_label.text().endswith(
        f"steps passed: {len(passed)} of 7"
        + (f" ({'step' if len(passed) == 1 else 'steps'} {', '.join(map(str, passed))})" if passed else "")
    )
    # above the steps: the relation actually tested, the distribution it was measured on and its n
    said = panel.distribution_label.text()
    assert said == result.tested() and result.claim.relation in said and f"n={result.heldout.n_samples}" in said
    assert "heldout" in verdict["verdict"] and verdict["steps_passed"] == passed
    for r, step in enumerate(result.chains[0].steps.values()):
        assert panel.table.item(r, COLUMNS.index("title")).text() == step.title
        assert panel.table.item(r, COLUMNS.index("n")).text().startswith(str(step.n))
    # recorded: kind validate, no image, its audit rows
    (info,) = window.session.runs("validate")
    run = window.session.run(info.id)
    assert run.kind == "validate" and info.image_sha256 is None and run.model["spec"] == "shapes-llava"
    assert run.result == json.loads(json.dumps(result.to_dict()))
    audit = [row for row in window.session.audit_table() if row["run_id"] == info.id]
    assert len(audit) == len(result.audit_records()) > 7  # the chain's row and each tested step's
    assert window.history_panel.row_texts(info.id)["question"] == CLAIM


def test_a_step_clicked_shows_its_evidence(checked):
    panel = checked.validation_panel
    chain = shown_result(checked, "validate").chains[0]
    assert panel.select_step(1)
    step = chain.steps[1]
    assert step.criterion in panel.details.text() and f"status: {step.status}" in panel.details.text()
    assert all(b.kind in panel.details.text() for b in step.baselines)
    per_sample = step.numbers.get("per_sample")
    if per_sample:  # the per-sample distribution of the target mass
        assert not panel.plot.isHidden() and f"of {len(per_sample['target_mass'])} inputs" in panel.evidence_note.text()
    assert panel.select_step(4)
    pairs = chain.steps[4].numbers.get("pairs")
    if pairs:
        assert not panel.pairs_table.isHidden() and panel.pairs_table.rowCount() == len(pairs)
        assert panel.pairs_table.item(0, 1).text() == f"{pairs[0]['mass_target_before']:.3f}"
    assert panel.select_step(6)
    assert "difference [" in panel.details.text()  # the paired comparisons with their intervals


def test_the_history_restores_the_claim(qtbot, checked):
    window, panel = checked, checked.validation_panel
    want = statuses(shown_result(window, "validate"))
    verdict = panel.verdict_label.text()
    panel.clear_result()
    assert panel.status_texts() == []
    (info,) = window.session.runs("validate")
    assert window.history_panel.select_run(info.id)
    assert panel.status_texts() == want and panel.verdict_label.text() == verdict
    assert not window.is_busy() and window.inputs.error_label.text() == ""


def test_another_model_clears_the_claim(qtbot, checked):
    window, panel = checked, checked.validation_panel
    window.inputs.model_picker.setCurrentText("shapes-coca")
    assert panel.validation is None and panel.status_texts() == []
    said = panel.verdict_label.text()
    # the dtype named: the one it runs in once loaded (another test of the run may have loaded it)
    coca_dtype = "float32 (auto)" if window.loaded_model() is not None else "auto"
    assert f"checked on shapes-llava · float32 (auto) · cpu; the model is now shapes-coca · {coca_dtype} · cpu" in said
    window.inputs.model_picker.setCurrentText("shapes-llava")  # back: the claim stays gone (run or restore it)
    assert panel.validation is None


def test_cancel_mid_run_leaves_the_window_idle_and_usable(qtbot, window):
    state_claim(window, n=150)
    with qtbot.waitSignal(window.idle, timeout=TIMEOUT_MS):
        assert window.actions.run_claim()
        window.runner.job.progress.connect(lambda *_: window.cancel())  # at the first step reported
    assert not window.is_busy() and window.inputs.status_label.text().startswith("cancelled")
    assert window.session.runs("validate") == [] and window.validation_panel.validation is None
    assert window.validation_panel.run_button.isEnabled()
    run_until_idle(qtbot, window, window.actions.answer_question)  # still usable
    assert shown_result(window, "answer") is not None


def test_a_bad_subject_is_a_message_and_records_nothing(qtbot, window):
    panel = window.validation_panel
    state_claim(window, subject="L9.H0")
    run_until_idle(qtbot, window, window.actions.run_claim)
    message = window.inputs.error_label.text()
    assert "L9" in message and panel.message_label.text() == message
    assert window.session.runs("validate") == [] and panel.validation is None
    # refused before anything runs: no subject, no claim, a folder not chosen
    panel.subject_edit.setText("")
    assert not window.actions.run_claim() and "name a head or route" in panel.message_label.text()
    state_claim(window)
    panel.claim_edit.setText("")
    assert not window.actions.run_claim() and "state the claim" in window.inputs.error_label.text()
    state_claim(window)
    panel.set_dataset("folder")
    assert not window.actions.run_claim() and "folder" in panel.message_label.text()
    assert window.session.runs("validate") == []


def test_a_head_selected_in_attention_names_the_subject(qtbot, window):
    run_until_idle(qtbot, window, window.actions.run_readout)
    window.attention_panel.select_head(1, 2)
    assert window.validation_panel.subject_edit.text() == "L1.H2"
    window.lens_panel.select_layer(2)  # a lens row selects a block's writes, not a head
    assert window.validation_panel.subject_edit.text() == "L1.H2"


# ---------------------------------------------------------------- Non-unique… and QK/OV


@pytest.fixture
def read_out(qtbot, window):
    run_until_idle(qtbot, window, window.actions.run_readout)
    assert window.analysis is not None, window.inputs.error_label.text()
    return window


def test_nonunique_on_the_selected_head_is_the_librarys_and_is_recorded(qtbot, read_out):
    window, panel = read_out, read_out.head_methods
    assert window.attention_panel.select_head(1, 2)
    run_until_idle(qtbot, window, window.actions.run_nonunique)
    assert window.inputs.error_label.text() == ""
    result = shown_result(window, "nonunique", "qk-ov")
    loaded = window.loaded_model()
    path = window.workspace.input.image_path
    _, want = nonunique_of_input(loaded, window.image, window.inputs.question_edit.text(), "L1.H2", image_path=path)
    (info,) = window.session.runs("nonunique")
    stored = window.session.run(info.id)
    assert stored.result == json.loads(json.dumps(want, allow_nan=False))  # the command's JSON, to the last digit
    assert (
        stored.parameters["component"] == "L1.H2"
        and stored.parameters["question"] == window.inputs.question_edit.text()
    )
    assert [row["run_id"] for row in window.session.audit_table()].count(info.id) == len(result.audit_records())
    shown = panel.text.text().split("\n")
    assert shown[0] == result.summary() and shown[1 : 1 + len(result.levels)] == [lv.statement for lv in result.levels]
    assert window.head_methods_frame.header_text().startswith(f"run #{info.id} · nonunique")
    # the painted region is the source set when one is painted
    mask = np.zeros((window.image.height, window.image.width), bool)
    mask[:32, :32] = True
    window.counterfactual_panel.canvas.set_mask(mask)
    run_until_idle(qtbot, window, window.actions.run_nonunique)
    doc = window.session.run(window.session.runs("nonunique")[-1].id).result
    assert doc["region"]["mask"] == "painted region" and doc["region"]["cover"] == 0.25


def test_qk_ov_keeps_the_weight_and_activation_levels_apart_and_is_restored(qtbot, read_out):
    window, panel = read_out, read_out.head_methods
    assert window.attention_panel.select_head(0, 1)
    run_until_idle(qtbot, window, window.actions.run_qk_ov)
    assert window.inputs.error_label.text() == ""
    want = qk_ov(window.loaded_model(), "L0.H1", window.image, window.inputs.question_edit.text()).to_dict()
    (info,) = window.session.runs("qk-ov")
    stored = window.session.run(info.id).result
    # the factored SVD (float32 QR + SVD) differs by ~1e-7 between the worker's thread and this one
    for circuit in ("qk", "ov"):
        got, expected = (d["weight_level"][circuit].pop("singular_values") for d in (stored, want))
        np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert stored == json.loads(json.dumps(want))  # everything else to the last digit
    assert panel.weight_text.text().startswith(want["weight_level"]["flag"])
    assert panel.activation_text.text().startswith(want["activation_level"]["flag"])
    assert panel.weight_box.title().startswith("weight level") and panel.activation_box.title().startswith("activation")
    assert not panel.weight_box.isHidden() and not panel.activation_box.isHidden() and panel.text.isHidden()
    # restored from the History: the head selected again, its result shown
    run_until_idle(qtbot, window, lambda: window.attention_panel.select_head(1, 0) and window.actions.run_nonunique())
    panel.clear_result()
    assert window.history_panel.select_run(info.id)
    assert panel.kind == "qk-ov" and panel.weight_text.text().startswith(want["weight_level"]["flag"])
    assert window.attention_panel.selected == (0, 1) and window.selection.current.name == "L0.H1"
    assert window.head_methods_frame.header_text().startswith(f"run #{info.id} · qk-ov")


def test_head_actions_refuse_what_is_no_selected_head(qtbot, read_out):
    window, panel = read_out, read_out.head_methods
    assert not window.actions.run_qk_ov() and "select a head first" in panel.message_label.text()
    window.lens_panel.select_layer(2)
    assert not window.actions.run_nonunique() and "L1 is not an attention head" in window.inputs.error_label.text()
    window.attention_panel.select_head(1, 1)
    run_until_idle(qtbot, window, window.actions.run_readout)  # another read-out: the selection is stale
    assert window.selection.current.stale
    assert not window.actions.run_qk_ov() and "select it again" in panel.message_label.text()
    assert window.session.runs("qk-ov") == [] and window.session.runs("nonunique") == []


def test_a_held_out_set_too_small_for_step_one_is_refused_with_its_minimum(qtbot, window):
    """Issue 31's new user: a held-out set of one input cannot pass step 1's exact test at its
    level, so nothing runs: the window says so with the smallest n that could, and records nothing."""
    state_claim(window, n=2)
    window.validation_panel.set_dataset("bundled")  # halved: one input held out, as that user had
    run_until_idle(qtbot, window, window.actions.run_claim)
    message = window.inputs.error_label.text()
    assert "held-out n=1 is too small" in message and "the smallest n at which step 1 could pass is" in message
    assert window.validation_panel.message_label.text() == message
    assert window.session.runs("validate") == [] and window.validation_panel.validation is None


def test_a_specification_file_is_chosen_run_and_recorded(qtbot, window, tmp_path):
    """The Relation field: a file that cannot be read is one line naming the field (the
    choice stays); a user's file runs, its relation is what the tab says was tested above the
    steps, and the run records its fields."""
    import json

    panel = window.validation_panel
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "relation": "y", "prediction_r": 1.5}')
    assert not panel.set_spec(bad)
    assert (
        "'prediction_r' 1.5 is outside" in panel.message_label.text() and panel.spec_loaded.name == "attribute-moving"
    )
    good = tmp_path / "claim.json"
    fields = {"name": "colour-reader", "relation": "reads the colour of the asked shape", "prediction_r": 0.6}
    good.write_text(json.dumps(fields))
    assert panel.set_spec(good) and panel.spec_combo.currentText().startswith("file: claim.json")
    state_claim(window)
    run_until_idle(qtbot, window, window.actions.run_claim)
    assert window.inputs.error_label.text() == ""
    result = shown_result(window, "validate")
    assert result.spec.relation == fields["relation"] and "r >= 0.6" in result.spec.criteria()[3]
    assert panel.distribution_label.text().startswith("relation tested: 'reads the colour of the asked shape'")
    (info,) = window.session.runs("validate")
    assert window.session.run(info.id).parameters["specification"]["prediction_r"] == 0.6


SPEC_SUBJECTS = {  # a head each shipped relation is about: one that reads the image, or a self-attention head
    "shapes-llava": {"visual": "L1.H1", "text": "L0.H1"},
    "shapes-coca": {"visual": "L1.xattn.H1", "text": "T0.H1"},
}


@pytest.mark.parametrize(
    "spec", ["attribute-moving", "object-name-copying", "previous-token", "induction", "sink-delimiter"]
)
@pytest.mark.parametrize("model", list(SPEC_SUBJECTS))
def test_each_shipped_relation_runs_from_the_relation_field(qtbot, window, model, spec):
    """Each shipped relation picked in the Relation field, on both default models: the chain runs
    on a head it is about, and the tab says above the steps which relation was tested, at which
    query, on what n; a held-out set too small for it is refused in the window with the smallest n
    (the sink's, whose sources are several tokens of each input)."""
    from core.methods.validation.spec import QUERY_WORDS, SHIPPED

    if model != "shapes-llava":
        window.inputs.model_picker.setCurrentText(model)
    panel = window.validation_panel
    index = panel.spec_combo.findData(spec)
    assert index >= 0
    panel.spec_combo.setCurrentIndex(index)
    panel._on_spec_activated(index)
    assert panel.spec_loaded == SHIPPED[spec]
    subject = SPEC_SUBJECTS[model]["visual" if SHIPPED[spec].on_image else "text"]
    state_claim(window, subject=subject)
    run_until_idle(qtbot, window, window.actions.run_claim)
    assert window.inputs.error_label.text() == ""
    result = shown_result(window, "validate")
    assert result.model == model and result.spec == SHIPPED[spec] and [c.subject for c in result.chains] == [subject]
    label = panel.distribution_label.text()
    assert label.startswith(f"relation tested: {SHIPPED[spec].relation!r}") and f"n={SMALL_N}" in label
    assert f"at the {QUERY_WORDS[SHIPPED[spec].query]}" in label
    assert panel.status_texts() == statuses(result)
    if spec == "sink-delimiter" and model == "shapes-llava":
        state_claim(window, subject=subject, n=2)
        run_until_idle(qtbot, window, window.actions.run_claim)
        message = window.inputs.error_label.text()
        assert "held-out n=2 is too small" in message and "the smallest n at which step 1 could pass is 3" in message
    window.inputs.model_picker.setCurrentText("shapes-llava")


def test_one_head_holds_a_label_per_relation_and_condition(qtbot, window, monkeypatch):
    """The same head checked under two relations: the session holds two labels of it, each with
    its specification, status and condition, and the tab lists both under the steps."""
    from core.validate import subject_labels

    panel = window.validation_panel
    for spec in ("attribute-moving", "previous-token"):
        index = panel.spec_combo.findData(spec)
        panel.spec_combo.setCurrentIndex(index)
        panel._on_spec_activated(index)
        state_claim(window, subject="L1.H1")
        run_until_idle(qtbot, window, window.actions.run_claim)
        assert window.inputs.error_label.text() == ""
    result = shown_result(window, "validate")
    labels = subject_labels(window.session, "L1.H1", result.fingerprint)
    assert [x["specification"] for x in labels] == ["attribute-moving", "previous-token"]
    runs = [info.id for info in window.session.runs("validate")]
    assert [x["run"] for x in labels] == runs[-2:]
    for x, run in zip(labels, runs[-2:]):
        recorded = window.session.run(run).readout
        assert x["status"] == recorded.chains[0].status().status and x["condition"] == recorded.heldout.describe()
    said = panel.labels_label.text()
    assert (
        said.startswith("labels of L1.H1 in this session (2): ")
        and "attribute-moving" in said
        and "previous-token" in said
    )
    assert subject_labels(window.session, "L1.H1", "another fingerprint") == []
    # a run read once is not read again (its labels are kept by run): the same list, no session read
    cache: dict = {}
    assert subject_labels(window.session, "L1.H1", result.fingerprint, cache) == labels
    reads = []
    real = window.session.run
    monkeypatch.setattr(window.session, "run", lambda run_id: reads.append(run_id) or real(run_id))
    assert subject_labels(window.session, "L1.H1", result.fingerprint, cache) == labels and reads == []


def test_the_history_restores_the_relation_a_run_checked(qtbot, window, tmp_path):
    """A run restored from the History puts back the relation it checked, not the one picked since:
    a shipped one by name, a user's file as recorded with the run (the file itself gone); run
    again, it checks that relation."""
    import json

    from core.methods.validation.spec import ATTRIBUTE_MOVING, SHIPPED

    panel = window.validation_panel
    assert panel.set_spec("induction")
    state_claim(window, subject="L0.H1")
    run_until_idle(qtbot, window, window.actions.run_claim)
    mine = tmp_path / "mine.json"
    fields = dict(SHIPPED["previous-token"].to_dict(), name="my-previous", hit_ratio=3.0)
    mine.write_text(json.dumps(fields))
    assert panel.set_spec(mine)
    run_until_idle(qtbot, window, window.actions.run_claim)
    mine.unlink()
    first, second = (info.id for info in window.session.runs("validate"))
    assert panel.set_spec("attribute-moving") and panel.spec_loaded == ATTRIBUTE_MOVING
    assert window.history_panel.select_run(first)
    assert panel.spec_loaded == SHIPPED["induction"] and panel.spec_combo.currentData() == "induction"
    assert window.history_panel.select_run(second)
    assert panel.spec_loaded.to_dict() == fields and panel.spec_combo.currentText() == f"run #{second} (my-previous)"
    run_until_idle(qtbot, window, window.actions.run_claim)  # again: the recorded specification, not attribute-moving
    assert shown_result(window, "validate").spec.to_dict() == fields
