"""The follow-up panels draw themselves from a run (the protocol of app.run_frame.RunFrame):
the Counterfactual tab (answer change, occlusion map, interventions table, the painter's token
grid), the head methods (Non-unique…, QK/OV) and the Validation tab, on shapes-llava, offscreen.

A live result and the same result restored from its JSON (core.results.readout.restore_result, as a
session restores it) draw the same cells and maps; a run of None clears what a run drew and
leaves the inputs (the image, the painted region). Each panel's request builder gives the
request the window built by hand before, or the refusal it said.
"""

import json

import numpy as np
import pytest

import core
from app.components import ModelChoice, RunInput, RunView, ShownRun, Workspace
from app.components.selection import Selection
from app.panels.counterfactual_panel import DRAWN_KINDS, NO_PASTE, PAINT_FIRST, CounterfactualPanel
from app.panels.head_methods_panel import HeadMethodsPanel
from app.panels.intervention_panel import InterventionPanel
from app.panels.run_requests import Refusal
from app.panels.validation_panel import ValidationPanel
from app.run_frame import RunFrame
from app.samples import bundled_samples
from core.analyze import analyze
from core.requests import (
    AblationRequest,
    CounterfactualRequest,
    NonuniqueRequest,
    PatchingRequest,
    QkOvRequest,
    SweepRequest,
    ValidateRequest,
)
from core.results.readout import jsonable, restore_result

SAMPLE = bundled_samples()[0]
SOURCE = bundled_samples()[2].image_path
CLAIM = "L1.H1 reads the colour of the shape asked about, at the answer position, on shape scenes"


@pytest.fixture(scope="module")
def loaded(model_cache):
    choice = ModelChoice("shapes-llava")  # the windows' default: shared with the other app tests
    if choice not in model_cache:
        model_cache[choice] = core.load_model("shapes-llava", **choice.load_options())
    return model_cache[choice]


@pytest.fixture(scope="module")
def image():
    return core.load_image(SAMPLE.image_path)


@pytest.fixture(scope="module")
def region(image):
    mask = np.zeros((image.height, image.width), bool)
    mask[:32, :32] = True  # the top-left 2 x 2 patches
    return mask


@pytest.fixture(scope="module")
def asked(image):
    """The AskedRequest fields the window gives a builder."""
    return {
        "image": image,
        "image_path": str(SAMPLE.image_path),
        "question": SAMPLE.question,
        "answer": "",
        "foil": "",
        "answer_text": None,
    }


@pytest.fixture(scope="module")
def live(loaded, asked, region):
    """One live result of each kind the panels draw, on the first sample."""
    source = core.load_image(SOURCE)
    return {
        "analyze": analyze(loaded, SAMPLE.image_path, SAMPLE.question),
        "counterfactual": CounterfactualRequest(**asked, mask=region, fill="mean").run(loaded),
        "sweep": SweepRequest(**asked, k=2).run(loaded),
        "intervention": AblationRequest(**asked, component="L1.H1").run(loaded),
        "patch": PatchingRequest(**asked, source_image=source, source_image_path=str(SOURCE), mask=region).run(loaded),
        "nonunique": NonuniqueRequest(**asked, head="L1.H2", mask=region, mask_name="painted region").run(loaded),
        "qk-ov": QkOvRequest(**asked, head="L0.H1").run(loaded),
        "validate": ValidateRequest(subjects=("L1.H1",), claim=CLAIM, dataset="scenes", n=6, n_side=2).run(loaded),
    }


def restored(kind: str, result):
    """``result`` as a session gives it back: its JSON, through strict JSON, restored as its class."""
    kind = "intervention" if kind == "patch" else kind
    return restore_result(kind, json.loads(json.dumps(jsonable(result.to_dict()), allow_nan=False)))


def run_of(results: dict, kind: str, run_id: int = 1) -> ShownRun:
    made_for = RunInput(image_path=str(SAMPLE.image_path), question=SAMPLE.question, model_spec="shapes-llava")
    return ShownRun(run_id, kind, made_for, dict(results))


def cells(table) -> list[list[str]]:
    return [
        [table.item(r, c).text() if table.item(r, c) is not None else "" for c in range(table.columnCount())]
        for r in range(table.rowCount())
    ]


@pytest.fixture
def workspace():
    return Workspace(RunInput(model_spec="shapes-llava"))


@pytest.fixture
def selection(workspace):
    return Selection(workspace)


@pytest.fixture
def panel(qtbot, image, selection):
    """The Counterfactual tab's panel hosting the Interventions box, the sample shown."""
    p = CounterfactualPanel()
    p.host_interventions(InterventionPanel(selection))
    qtbot.addWidget(p)
    p.resize(1280, 800)
    p.set_image(image)
    return p


def counterfactual_drawn(p: CounterfactualPanel) -> dict:
    """What a reader sees of the Counterfactual tab's results (not the edited image)."""
    sweep = p.sweep_canvas
    return {
        "answer": cells(p.answer_table),
        "lines": [p.tokens_label.text(), p.flip_label.text(), p.fill_summary.text()],
        "routing": [p.rollout_value.text(), p.dla_value.text(), p.mean_mass_value.text(), p.heads_title.text()],
        "heads": cells(p.heads_table),
        "sweep": [p.sweep_title.text(), p.sweep_summary.text(), sweep.heatmap_label, len(sweep.cells)],
        "sweep values": None if sweep.values is None else sweep.values.tolist(),
        "interventions": [p.interventions.results.title.text(), p.interventions.results.texts()],
        "grid": [len(p.canvas.cells), p.canvas.note_label.text(), p.region_label.text()],
    }


# ---------------------------------------------------------------- the Counterfactual tab


@pytest.mark.parametrize("ablation", ["intervention", "patch"])
def test_the_counterfactual_tab_draws_a_live_run_and_its_restored_copy_alike(panel, live, region, ablation):
    panel.canvas.set_mask(region)
    kinds = ("analyze", "counterfactual", "sweep")
    live_run = run_of({**{k: live[k] for k in kinds}, "intervention": live[ablation]}, "counterfactual")
    panel.draw(live_run, "counterfactual")
    drawn = counterfactual_drawn(panel)
    assert drawn["answer"][0][0] == live["counterfactual"].original.predicted and drawn["heads"]
    assert drawn["sweep values"] is not None and drawn["sweep"][3] == 16  # 8 x 8 patches in 2 x 2 cells
    assert drawn["grid"][0] == 64 and "touches 4 of 64 patch tokens" in drawn["grid"][2]
    assert len(drawn["interventions"][1]) == len(live[ablation].effect_rows()) > 0
    assert np.array_equal(panel.edited_view.image, live["counterfactual"].edited_image)
    assert panel.numbers_tabs.currentIndex() == 0  # the answer change just shown

    panel.draw(None, None)
    back = {k: restored(k, live[k]) for k in kinds}
    panel.draw(run_of({**back, "intervention": restored(ablation, live[ablation])}, "counterfactual"), "counterfactual")
    assert counterfactual_drawn(panel) == drawn
    assert panel.edited_view.image is None  # a restored counterfactual holds no edited image


def test_the_tab_of_the_result_just_shown_comes_up(panel, live):
    run = run_of({k: live[k] for k in ("analyze", "counterfactual", "sweep", "intervention")}, "sweep")
    panel.draw(run, "sweep")
    assert panel.numbers_tabs.currentWidget() is panel.sweep_box
    panel.draw(run_of(run.results, "intervention"), "intervention")
    assert panel.numbers_tabs.currentWidget() is panel.interventions.results
    panel.draw(run_of({"analyze": live["analyze"]}, "analyze"), "analyze")  # a read-out: the tab stays
    assert panel.numbers_tabs.currentWidget() is panel.interventions.results


def test_drawing_nothing_clears_the_results_and_the_grid_not_the_inputs(panel, live, region, image):
    panel.canvas.set_mask(region)
    panel.draw(run_of({k: live[k] for k in DRAWN_KINDS}, "counterfactual"), "counterfactual")
    panel.draw(None, None)
    assert panel.result is None and panel.sweep is None and panel.interventions.results.result is None
    assert panel.sweep_title.text() == "occlusion sweep: not run" and panel.sweep_canvas.values is None
    assert cells(panel.answer_table)[0] == ["", "", ""] and panel.heads_table.rowCount() == 0
    assert panel.interventions.results.table.rowCount() == 0 and panel.interventions.analysis is None
    assert panel.canvas.cells == [] and panel.tokens == []
    assert np.array_equal(panel.mask(), region) and np.array_equal(panel.image, np.asarray(image))  # inputs stay
    # a run without one of the kinds empties that part only
    panel.draw(run_of({"analyze": live["analyze"], "sweep": live["sweep"]}, "sweep"), "sweep")
    assert panel.result is None and panel.sweep is live["sweep"] and len(panel.canvas.cells) == 64


def test_through_a_run_frame_the_panel_follows_the_workspace(panel, live, workspace):
    frame = RunFrame(panel, RunView(workspace, DRAWN_KINDS, "counterfactual"))
    assert panel.canvas.cells == []
    run = ShownRun(3, "analyze", workspace.input, {"analyze": live["analyze"]})
    workspace.show_run(run)
    assert len(panel.canvas.cells) == 64 and panel.result is None
    workspace.add_result("counterfactual", live["counterfactual"], 4)
    assert panel.result is live["counterfactual"] and frame.header_text().startswith("run #4 · counterfactual")
    workspace.add_result("intervention", live["intervention"], 5)
    assert panel.interventions.results.result is live["intervention"] and panel.result is live["counterfactual"]
    assert panel.interventions.analysis is live["analyze"]
    assert panel.numbers_tabs.currentWidget() is panel.interventions.results
    workspace.clear_shown()  # a new image
    assert panel.result is None and panel.interventions.results.result is None and panel.canvas.cells == []


def test_the_interventions_box_names_the_head_an_ablation_edits(qtbot, live, selection):
    box = InterventionPanel(selection)
    qtbot.addWidget(box)
    box.draw(run_of({"intervention": live["intervention"]}, "intervention"))
    assert box.shown_head() == (1, 1)  # a restored ablation selects it in Attention
    box.draw(run_of({"intervention": restored("patch", live["patch"])}, "intervention"))
    assert box.shown_head() is None and box.results.texts()[0][0] == "painted region forward"
    box.draw(None)
    assert box.shown_head() is None


# ---------------------------------------------------------------- head methods and claims


def head_drawn(p: HeadMethodsPanel) -> list:
    return [
        p.kind,
        p.title.text(),
        p.text.text(),
        p.weight_text.text(),
        p.activation_text.text(),
        [p.text.isHidden(), p.weight_box.isHidden(), p.activation_box.isHidden()],
    ]


@pytest.mark.parametrize("kind", ["nonunique", "qk-ov"])
def test_the_head_methods_draw_a_live_run_and_its_restored_copy_alike(qtbot, live, selection, kind):
    p = HeadMethodsPanel(selection)
    qtbot.addWidget(p)
    p.draw(run_of({kind: live[kind]}, kind), kind)
    drawn = head_drawn(p)
    assert drawn[0] == kind and drawn[1] != ""
    if kind == "qk-ov":
        assert p.shown_head() == (0, 1) and drawn[5] == [True, False, False]
    else:
        assert p.shown_head() == (1, 2) and drawn[2].split("\n")[0] == live[kind].summary()
    p.draw(None, None)
    assert p.kind is None and p.result is None and p.text.text() == "" and p.shown_head() is None
    p.draw(run_of({kind: restored(kind, live[kind])}, kind), kind)
    assert head_drawn(p) == drawn


def test_a_run_holding_both_head_results_draws_the_kind_shown(qtbot, live, selection):
    p = HeadMethodsPanel(selection)
    qtbot.addWidget(p)
    both = run_of({"nonunique": live["nonunique"], "qk-ov": live["qk-ov"]}, "nonunique")
    p.draw(both, "qk-ov")
    assert p.kind == "qk-ov"
    p.draw(both, "nonunique")
    assert p.kind == "nonunique"
    p.draw(both, "counterfactual")  # another kind: the first of the panel's it has
    assert p.kind == "nonunique"


def claims_drawn(p: ValidationPanel) -> list:
    return [p.verdict_label.text(), p.distribution_label.text(), p.condition_label.text(), cells(p.table)]


def test_the_claims_tab_draws_a_live_claim_and_its_restored_copy_alike(qtbot, live, selection):
    p = ValidationPanel(selection)
    qtbot.addWidget(p)
    validation = live["validate"]
    p.draw(run_of({"validate": validation}, "validate"), "validate")
    drawn = claims_drawn(p)
    assert p.status_texts() == [validation.chains[0].steps[k].status for k in range(1, 8)]
    assert drawn[0].startswith("L1.H1: ") and len(drawn[3]) == 7
    p.draw(None, None)
    assert p.validation is None and p.claim_run is None and p.status_texts() == []
    p.draw(run_of({"validate": restored("validate", validation)}, "validate"), "validate")
    assert claims_drawn(p) == drawn


def test_a_claim_follows_its_model_not_the_input(qtbot, live, workspace):
    """Another model (or other weights) clears the claim, saying so; another image or question does not."""
    p = ValidationPanel(Selection(workspace), workspace)
    qtbot.addWidget(p)
    workspace.set_input(model_fingerprint="f1", loaded_dtype="float32")
    p.show_claim(live["validate"], 7, workspace.input)
    assert p.claim_run.id_of() == 7 and p.validation is live["validate"]
    workspace.set_input(question="what colour?", image_sha256="another")
    workspace.clear_shown()
    assert p.validation is live["validate"]
    workspace.set_input(model_fingerprint="f2")  # other weights under the same spec
    assert p.validation is None and p.status_texts() == []
    assert "checked on shapes-llava · float32 (auto) · cpu; the model is now shapes-llava" in p.verdict_label.text()

    p.show_claim(live["validate"], 8, workspace.input)
    workspace.set_input(model_spec="shapes-coca", model_fingerprint=None, loaded_dtype=None)
    said = p.verdict_label.text()
    assert p.validation is None and "; the model is now shapes-coca · auto · cpu: run it again" in said
    workspace.set_input(model_spec="shapes-llava")  # back: the claim stays gone (run or restore it)
    assert p.validation is None


def test_a_restored_claim_says_so(qtbot, live, selection, tmp_path):
    from core.session import Session

    session = Session.open_or_create(tmp_path / "s.vlmr")
    run_id = session.record(live["validate"], model="shapes-llava")
    run = session.run(run_id)
    p = ValidationPanel(selection)
    qtbot.addWidget(p)
    made_for = RunInput(model_spec="shapes-llava")
    p.show_restored(run, made_for)
    assert p.status_texts() == [live["validate"].chains[0].steps[k].status for k in range(1, 8)]
    assert p.message_label.text() == f"run #{run_id} of {run.created}, restored from the History"
    p.show_restored(run, made_for, "run #1 used a painted region that is not stored with it")
    assert p.message_label.text().startswith("run #1 used") and "c00000" in p.message_label.styleSheet()
    session.close()


# ---------------------------------------------------------------- the requests the panels build


def same_request(built, by_hand) -> None:
    """The same request: the same class and parameters, the same mask and pixels."""
    assert type(built) is type(by_hand) and built.parameters() == by_hand.parameters()
    for name in ("mask", "region"):
        a, b = getattr(built, name, None), getattr(by_hand, name, None)
        assert (a is None and b is None) or np.array_equal(a, b)
    for name in ("image", "source_image", "paste_from"):
        a, b = getattr(built, name, None), getattr(by_hand, name, None)
        assert (a is None and b is None) or np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "fill, options",
    [("mean", {}), ("constant", {"color": (10, 20, 30)}), ("blur", {"radius": 2.5}), ("noise", {"seed": 7})],
)
def test_the_fill_requests_are_the_ones_the_window_built(panel, asked, region, fill, options):
    panel.canvas.set_mask(region)
    panel.set_fill(fill, **options)
    same_request(panel.counterfactual_request(asked), CounterfactualRequest(**asked, mask=region, fill=fill, **options))
    panel.sweep_k.setValue(3)
    same_request(panel.sweep_request(asked), SweepRequest(**asked, k=3, fill=fill, **options))
    # what run_requested carries, given back
    other = np.zeros_like(region)
    other[40:60, 40:60] = True
    built = panel.counterfactual_request(asked, other, "blur", {"radius": 1.0})
    same_request(built, CounterfactualRequest(**asked, mask=other, fill="blur", radius=1.0))


def test_a_paste_fill_reads_its_source_and_is_refused_without_one(panel, asked, region, tmp_path):
    panel.canvas.set_mask(region)
    panel.set_fill("paste")
    for refused in (panel.counterfactual_request(asked), panel.sweep_request(asked)):
        assert refused == Refusal(NO_PASTE)
    assert not panel.request_sweep() and panel.message_label.text() == NO_PASTE
    panel.set_fill("paste", paste_from=SOURCE)
    pixels = core.load_image(SOURCE)
    by_hand = CounterfactualRequest(**asked, mask=region, fill="paste", paste_from=pixels, paste_from_path=str(SOURCE))
    same_request(panel.counterfactual_request(asked), by_hand)
    bad = tmp_path / "not-an-image.png"
    bad.write_bytes(b"not a png")
    panel.set_paste_source(bad)
    refused = panel.counterfactual_request(asked)
    assert isinstance(refused, Refusal) and str(bad.name) in refused.message and refused.met is None


def test_the_counterfactual_refusals(qtbot, panel, asked, region):
    empty = CounterfactualPanel()
    qtbot.addWidget(empty)
    assert empty.counterfactual_request(asked) == Refusal("no image to edit")
    assert empty.sweep_request(asked) == Refusal("no image to sweep")
    refused = panel.counterfactual_request(asked)
    assert refused.message == PAINT_FIRST and not refused.met()
    assert not panel.request_run() and panel.message_label.text() == PAINT_FIRST
    panel.canvas.set_mask(region)
    assert refused.met() and panel.message_label.text() == ""  # painted: the refusal goes


def test_the_running_line_goes_with_its_job_and_no_other_message(panel, asked, region, live):
    panel.canvas.set_mask(region)
    request = panel.counterfactual_request(asked)
    panel.show_running(request)
    assert panel.message_label.text() == f"running: mean fill over {int(region.sum())} px…"
    panel.draw(run_of({"counterfactual": live["counterfactual"]}, "counterfactual"), "counterfactual")
    assert panel.message_label.text() == ""  # its result is drawn
    panel.sweep_k.setValue(2)
    panel.show_running(panel.sweep_request(asked))
    assert panel.message_label.text() == "running the occlusion sweep (2x2 patches per cell, mean)…"
    panel.show_message("the painted region of run #3 is not stored with it", error=True)
    panel.end_running()
    panel.draw(None, None)
    assert panel.message_label.text() == "the painted region of run #3 is not stored with it"


def shown_readout(workspace, analysis) -> ShownRun:
    run = ShownRun(2, "analyze", workspace.input, {"analyze": analysis})
    workspace.show_run(run)
    return run


def test_the_ablation_requests_are_the_ones_the_window_built(qtbot, live, asked, region, workspace, selection):
    box = InterventionPanel(selection)
    qtbot.addWidget(box)
    painted = np.zeros_like(region)
    refused = box.ablation_request(asked, lambda: painted)
    assert refused.message.startswith("select a component first: Read out, then click a head (Attention)")
    run = shown_readout(workspace, live["analyze"])
    box.draw(run, "analyze")  # the Counterfactual tab's view draws it: the read-out's blocks
    selection.select("L1.H1", "attention", live["analyze"])
    assert refused.met()
    same_request(
        box.ablation_request(asked, lambda: painted),
        AblationRequest(**asked, component="L1.H1", selected_in="attention"),
    )
    box.set_positions("region")
    refused = box.ablation_request(asked, lambda: painted)
    assert refused.message == "positions 'painted region': paint a region in the Counterfactual tab"
    painted = region
    assert refused.met()
    box.set_references([s.image_path for s in bundled_samples()], "bundled sample")
    box.set_kind("mean")
    same_request(
        box.ablation_request(asked, lambda: painted),
        AblationRequest(
            **asked, component="L1.H1", selected_in="attention", ablation="mean", positions="region", mask=region,
            references=tuple(str(s.image_path) for s in bundled_samples()), reference_set="bundled sample",
        ),
    )  # fmt: skip
    box.set_kind("resample")
    refused = box.ablation_request(asked, lambda: painted)
    assert refused.message == "resample ablation: choose a source image (a sample or File…)" and not refused.met()
    box.set_source(SOURCE)
    assert refused.met()
    same_request(
        box.ablation_request(asked, lambda: painted),
        AblationRequest(
            **asked, component="L1.H1", selected_in="attention", ablation="resample", positions="region",
            mask=region, source_image=core.load_image(SOURCE), source_image_path=str(SOURCE),
        ),
    )  # fmt: skip
    selection.select("embed", "lens", live["analyze"])  # the embedding: no write a forward can ablate
    refused = box.ablation_request(asked, lambda: painted)
    assert isinstance(refused, Refusal) and refused.met is not None and not refused.met()
    shown_readout(workspace, restored("analyze", live["analyze"]))  # another read-out: the selection is stale
    assert box.ablation_request(asked, lambda: painted).message == (
        "embed was selected in another read-out than the one shown: select it again"
    )


def test_the_patch_requests_are_the_ones_the_window_built(qtbot, asked, region, selection):
    box = InterventionPanel(selection)
    qtbot.addWidget(box)
    painted = np.zeros_like(region)
    refused = box.patch_request(asked, lambda: painted)
    assert refused.message == "patching: choose a source image (a sample or File…)" and not refused.met()
    box.set_source(SOURCE)
    assert refused.met()
    box.set_positions("region")
    refused = box.patch_request(asked, lambda: painted)
    assert refused.message.startswith("patching: paint a region in the Counterfactual tab (or choose all positions")
    box.set_positions("all")
    assert refused.met()
    source = core.load_image(SOURCE)
    by_hand = PatchingRequest(**asked, source_image=source, source_image_path=str(SOURCE), mask=None)
    same_request(box.patch_request(asked, lambda: painted), by_hand)
    box.set_positions("region")
    box.set_site("resid", 1)  # chosen before the model's sites are known
    painted = region
    by_hand = PatchingRequest(
        **asked, source_image=source, source_image_path=str(SOURCE), mask=region, site="resid", layer=1
    )
    same_request(box.patch_request(asked, lambda: painted), by_hand)
    pixels = np.asarray(source)  # a source given as pixels: no file to record
    built = box.patch_request(asked, lambda: painted, pixels)
    assert built.source_image_path is None and np.array_equal(np.asarray(built.source_image), pixels)
    box.show_running(built)
    assert box.message_label.text() == "running: patching at resid…"
    box.end_running()
    assert box.message_label.text() == ""


def test_the_head_method_requests_are_the_ones_the_window_built(qtbot, live, asked, region, workspace, selection):
    p = HeadMethodsPanel(selection)
    qtbot.addWidget(p)
    refused = p.qk_ov_request(asked)
    assert refused.message == "select a head first: Read out, then click a head in Attention (or a head's bar in DLA)"
    shown_readout(workspace, live["analyze"])
    selection.select("L1.mlp", "dla", live["analyze"])
    assert refused.met()
    refused = p.nonunique_request(asked, lambda: region)
    assert refused.message == "L1.mlp is not an attention head: select a head (L1.H2) in Attention or DLA"
    selection.select("L1.H2", "attention", live["analyze"])
    assert refused.met()
    same_request(p.qk_ov_request(asked), QkOvRequest(**asked, head="L1.H2"))
    same_request(
        p.nonunique_request(asked, lambda: region),
        NonuniqueRequest(**asked, head="L1.H2", mask=region, mask_name="painted region"),
    )
    same_request(p.nonunique_request(asked, lambda: np.zeros_like(region)), NonuniqueRequest(**asked, head="L1.H2"))
    p.show_running(p.qk_ov_request(asked))
    assert p.message_label.text() == "running: QK / OV of L1.H2…"
    p.draw(run_of({"qk-ov": live["qk-ov"]}, "qk-ov"), "qk-ov")
    assert p.message_label.text() == ""
    shown_readout(workspace, restored("analyze", live["analyze"]))
    assert (
        p.qk_ov_request(asked).message == "L1.H2 was selected in another read-out than the one shown: select it again"
    )


def test_the_validate_requests_are_the_ones_the_window_built(qtbot, region, selection, tmp_path):
    p = ValidationPanel(selection)
    qtbot.addWidget(p)
    painted = np.zeros_like(region)
    refused = p.validate_request(lambda: painted)
    assert refused.message == "name a head or route (L1.H1, L1.H0+L1.H1), or select a head in Attention or DLA"
    p.subject_edit.setText("L1.H1, L1.H0 + L1.H2")
    assert refused.met()
    refused = p.validate_request(lambda: painted)
    assert refused.message == "state the claim: what the head or route is said to do, and on which inputs"
    p.claim_edit.setText(CLAIM)
    assert refused.met()
    p.set_dataset("folder")
    refused = p.validate_request(lambda: painted)
    assert refused.message == "choose the dataset folder (holding a pairs JSONL), or another dataset"
    p.set_dataset("scenes")
    assert refused.met()
    p.n_spin.setValue(12)
    by_hand = ValidateRequest(subjects=("L1.H1", "L1.H0+L1.H2"), claim=CLAIM, dataset="scenes", n=12, n_side=4)
    same_request(p.validate_request(lambda: painted), by_hand)
    p.region_check.setChecked(True)
    refused = p.validate_request(lambda: painted)
    assert refused.message == "painted region: paint one in the Counterfactual tab, or untick its box"
    painted = region
    assert refused.met()
    by_hand = ValidateRequest(
        subjects=("L1.H1", "L1.H0+L1.H2"), claim=CLAIM, dataset="scenes", n=12, n_side=4, region=region
    )
    same_request(p.validate_request(lambda: painted), by_hand)
    p.show_running(by_hand)
    assert p.message_label.text() == "running: the seven-step chain on L1.H1, L1.H0+L1.H2…"
    emitted = []
    p.choices_changed.connect(lambda: emitted.append(1))
    p.claim_edit.setText("another claim")
    assert emitted  # the window rechecks a refusal as the fields change


def test_a_baselines_interval_is_read_from_its_typed_fields():
    """The checklist's baseline lines: a step's baseline with its 95% interval, and step 6's
    paired comparison (the compared step, the candidate, the interval of the difference)."""
    from types import SimpleNamespace

    from app.panels.validation_panel import baseline_line
    from core.methods.validation.chain import Baseline

    stats = {"n": 9, "mean": 0.5, "se": 0.1, "ci95": [0.304, 0.696]}
    plain = Baseline("matched random head", ["L0.H1"], 0.5, 9, {"stats": stats})
    assert plain.interval == (0.304, 0.696) and plain.compared_step is None
    assert baseline_line(SimpleNamespace(number=1), plain) == "matched random head: 0.5 [0.304, 0.696]"
    paired = Baseline(
        "matched random head", ["L0.H1"], 0.25, 9, {"step": 4, "candidate": 0.75, "paired_difference": stats}
    )
    assert (paired.compared_step, paired.candidate_value, paired.interval) == (4, 0.75, (0.304, 0.696))
    line = baseline_line(SimpleNamespace(number=6), paired)
    assert line == "step 4 matched random head: 0.25 vs 0.75, difference [0.304, 0.696]"
    none = Baseline(
        "matched random head", [], None, 0, {"stats": {"n": 0, "mean": None, "se": None, "ci95": [None, None]}}
    )
    assert none.interval is None and baseline_line(SimpleNamespace(number=1), none) == "matched random head: —"
    assert Baseline.from_dict(json.loads(json.dumps(paired.to_dict()))).interval == paired.interval
