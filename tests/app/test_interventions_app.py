"""Interventions chosen from any panel (issue 14, part 6), on shapes-llava, offscreen:
the component selected last in Attention, DLA or Lens is the one ablated; zero, mean
and resample ablation at the answer position, every position or the painted region;
patching at a chosen site from a chosen source image; the results table, live and
restored. Every number the window shows is compared with the engine called here
directly (the same arithmetic on the same model, so equal to the last bit).

Own file: these tests wait on worker signals (see tests/app/conftest.py).
"""

from types import SimpleNamespace

import numpy as np
import pytest

import core
from app.components import RunInput, ShownRun, Workspace
from app.components.selection import Selection, head_component, lens_component
from app.samples import bundled_samples
from core.forward.capture import capture
from core.methods.component_ablation import ablation_edits, parse_component
from core.methods.interventions import patch_visual_features, run_interventions
from core.requests.patching import patch_sites
from tests.app.shown import shown_result
from tests.app.test_window import run_until_idle

BLOCKS = ["L0", "L1", "L2", "L3"]  # shapes-llava's blocks, as the trace names them


# ---------------------------------------------------------------- the selection model (no Qt, no model)


def test_view_selections_name_the_engines_components():
    assert head_component(BLOCKS, 2, 3) == "L2.H3"
    assert lens_component(BLOCKS, 0)[0] == "embed"  # the residual entering block 0: nothing but the embedding
    assert [lens_component(BLOCKS, layer)[0] for layer in range(1, 5)] == BLOCKS  # row l: block l-1's writes
    assert lens_component(BLOCKS, 4)[1] == "lens row final: the writes of L3"
    with pytest.raises(ValueError, match="rows 0..4"):
        lens_component(BLOCKS, 5)


def test_a_selection_goes_stale_when_another_readout_is_shown_and_clears_with_nothing_shown():
    workspace = Workspace(RunInput(model_spec="m"))
    selection = Selection(workspace)
    seen = []
    selection.changed.connect(lambda selected: seen.append(selected))
    readout = {"target": {}}
    workspace.show_run(ShownRun(4, "analyze", workspace.input, {"analyze": readout}))
    selected = selection.select("L1.H2", "dla", readout)
    assert (selected.run_id, selected.stale) == (4, False)
    assert selected.describe() == "L1.H2 (selected in DLA, run #4)"
    workspace.add_result("intervention", {"rows": []}, 5)  # a follow-up of the same read-out: still current
    assert selection.current is selected and len(seen) == 1
    workspace.show_run(ShownRun(6, "analyze", workspace.input, {"analyze": {"target": {}}}))
    assert selection.current.stale and selection.current.name == "L1.H2" and "select it again" in seen[-1].describe()
    workspace.clear_shown()
    assert selection.current is None and seen[-1] is None
    # selected while a read-out is drawn but before its run is shown (a restore): the run id follows
    selection.select("L0.mlp", "lens", readout)
    assert selection.current.run_id is None
    workspace.show_run(ShownRun(7, "intervention", workspace.input, {"analyze": readout}, {"analyze": 3}))
    assert (selection.current.run_id, selection.current.stale) == (3, False)


def test_patch_sites_are_the_familys_visual_sites():
    from core.models.families.coca import CocaAdapter
    from core.models.families.llava import LlavaAdapter

    assert patch_sites(LlavaAdapter) == ["vision_out", "projector_out", "resid"]
    assert patch_sites(CocaAdapter) == ["kv_source"]  # resid: its visual tokens are not in the text stream
    assert patch_sites(SimpleNamespace(edit_sites=("z", "mlp"), attention_kind="self")) == []


# ---------------------------------------------------------------- the window


@pytest.fixture
def read_out(qtbot, window):
    """The window with the first sample read out."""
    run_until_idle(qtbot, window, window.actions.run_readout)
    assert window.analysis is not None, window.inputs.error_label.text()
    return window


def loaded_model(window) -> core.LoadedModel:
    return window.loaded_model()


def engine_ablation(window, name: str, kind: str = "zero", positions: str = "target", region=(), source=None):
    """The engine's own ablation of ``name`` on the window's image and question: the
    references of a mean are the bundled samples asked the same question."""
    loaded = loaded_model(window)
    adapter, question = loaded.adapter, window.inputs.question_edit.text().strip()

    def capture_of(image):
        return capture(loaded, None, "", pattern_layers=[], inputs=adapter.prepare([image], [question]))

    inputs = adapter.prepare([window.image], [question])
    base = capture(loaded, None, "", pattern_layers=[], inputs=inputs)
    references = [capture_of(core.load_image(s.image_path)) for s in bundled_samples()] if kind == "mean" else []
    edits = ablation_edits(
        adapter,
        base,
        parse_component(name, base.block_names),
        kind=kind,
        positions=positions,
        region_tokens=list(region),
        references=references,
        source=capture_of(core.load_image(source)) if source is not None else None,
    )
    answer_id = int(base.logits[0, int(base.answer_positions[0])].argmax())
    return run_interventions(loaded, inputs, {name: edits}, answer_id, base=base)


def assert_row_shown(cells: list[str], label: str, before, after, flipped: bool) -> None:
    """One table row holds these numbers (no foil: the score is the answer logit)."""
    assert cells[0] == label and cells[1] == before.answer
    assert cells[2].split("\n")[0] == f"{before.logit:+.3f} → {after.logit:+.3f}"
    assert cells[2].split("\n")[1] == f"({after.logit - before.logit:+.3f})"
    assert cells[3].split("\n")[0] == f"{before.prob:.4f} → {after.prob:.4f}"
    assert cells[4].split() == [before.predicted, "→", after.predicted]
    assert cells[5] == ("yes" if flipped else "no")


def ablate(qtbot, window):
    run_until_idle(qtbot, window, window.actions.ablate_selected)
    assert window.inputs.error_label.text() == ""
    return shown_result(window, "intervention")


def test_the_component_selected_last_is_the_one_ablated(qtbot, read_out):
    """A head selected in DLA after one in Attention: Ablate ablates the DLA one (the Attention
    selection used to win), and its numbers are the engine's."""
    window = read_out
    assert window.attention_panel.select_head(1, 1)
    window.dla_panel.select_component("L0.H2", emit=True)  # as a click on its bar
    assert window.attention_panel.selected == (1, 1)  # still highlighted there
    assert window.intervention_panel.component_label.text().startswith("L0.H2 (selected in DLA, run #")
    result = ablate(qtbot, window)
    engine = engine_ablation(window, "L0.H2")
    (row,), (want,) = result.rows, engine.rows
    assert row.label == "L0.H2 zeroed at the answer position"
    assert (row.original, row.edited, row.effect) == (want.original, want.edited, want.effect)
    assert [(e["site"], e["block"], e["head"], e["positions"]) for e in row.edits] == [("z", 0, 2, [result.position])]
    (cells,) = window.intervention_panel.results.texts()
    assert_row_shown(cells, row.label, want.original, want.edited, want.effect.flipped)
    recorded = window.session.run(window.session.runs("intervention")[-1].id).parameters
    assert (recorded["component"], recorded["selected_in"], recorded["ablation"]) == ("L0.H2", "dla", "zero")
    assert recorded["answer_prefix_ids"] == [] and recorded["question"] == window.inputs.question_edit.text()


@pytest.mark.parametrize(
    "kind, select, name",
    [
        ("zero", lambda w: w.attention_panel.select_head(2, 1), "L2.H1"),
        ("mean", lambda w: w.lens_panel.select_layer(2), "L1"),  # lens row L2: every write of block L1
        ("resample", lambda w: w.dla_panel.select_component("L1.mlp", emit=True), "L1.mlp"),
    ],
)
def test_each_ablation_kind_is_the_engines(qtbot, read_out, kind, select, name):
    window = read_out
    panel = window.intervention_panel
    select(window)
    assert window.selection.current.name == name
    panel.set_kind(kind)
    source = bundled_samples()[3].image_path
    panel.set_source(source)
    if kind == "mean":
        assert panel.reference_label.text() == "mean over the 8 bundled sample images, each asked the question shown"
    result = ablate(qtbot, window)
    engine = engine_ablation(window, name, kind, source=source if kind == "resample" else None)
    (row,), (want,) = result.rows, engine.rows
    assert (row.original, row.edited) == (want.original, want.edited)
    assert row.edited.logit != row.original.logit  # the edit changed something
    assert result.ablation == kind
    (cells,) = panel.results.texts()
    assert_row_shown(cells, row.label, want.original, want.edited, want.effect.flipped)
    parameters = result.parameters()
    if kind == "mean":
        assert parameters["n_references"] == 8 and parameters["reference_set"] == "bundled sample"
    if kind == "resample":
        assert parameters["source_image"] == str(source)
        assert parameters["source_image_sha256"] == core.files.images.image_sha256(core.load_image(source))


def test_the_painted_region_positions_are_its_visual_tokens(qtbot, read_out):
    window = read_out
    mask = np.zeros((window.image.height, window.image.width), bool)
    mask[:32, :32] = True  # the top-left 2 x 2 patches of the 16-pixel grid
    window.counterfactual_panel.canvas.set_mask(mask)
    window.attention_panel.select_head(1, 0)
    window.intervention_panel.set_positions("region")
    result = ablate(qtbot, window)
    adapter = loaded_model(window).adapter
    region = [t.index for t in adapter.visual_tokens(window.image.size) if t.row < 2 and 0 <= t.col < 2]
    assert len(region) == 4
    positions = adapter.visual_positions(adapter.prepare([window.image], [window.inputs.question_edit.text()]))[0]
    (row,) = result.rows
    assert row.edits[0]["positions"] == [int(positions[t]) for t in region]  # the sequence positions of those tokens
    assert row.label == "L1.H0 zeroed at the painted region (4 visual tokens)"
    want = engine_ablation(window, "L1.H0", positions="region", region=region).rows[0]
    assert row.edited == want.edited
    assert result.parameters()["region_tokens"] == region
    assert window.session.runs("intervention")[-1].mask_id is not None  # the region is recorded with the run


@pytest.mark.parametrize("site, layer", [("projector_out", None), ("resid", 1)])
def test_patching_at_the_chosen_site_is_patch_visual_features(qtbot, read_out, site, layer):
    window = read_out
    panel = window.intervention_panel
    assert panel.sites() == ["vision_out", "projector_out", "resid"]  # the loaded family's
    mask = np.zeros((window.image.height, window.image.width), bool)
    mask[40:90, 30:100] = True
    window.counterfactual_panel.canvas.set_mask(mask)
    source = bundled_samples()[2].image_path
    panel.set_source(source)
    panel.set_site(site, layer)
    assert panel.site_choice() == (site, layer)
    run_until_idle(qtbot, window, window.actions.patch_region)
    assert window.inputs.error_label.text() == ""
    result = shown_result(window, "intervention")
    loaded = loaded_model(window)
    tokens = loaded.adapter.visual_tokens(window.image.size)
    region = [
        t.index for t in tokens if t.col >= 0 and t.box[0] < 100 and t.box[2] > 30 and t.box[1] < 90 and t.box[3] > 40
    ]
    want = patch_visual_features(
        loaded,
        window.image,
        window.inputs.question_edit.text(),
        source,
        site=site,
        layer=layer,
        token_sets={"painted region": region},
    )
    assert (result.site, result.layer) == (site, layer)
    (row,), (want_row,) = result.rows, want.rows
    assert row.tokens == region
    assert row.forward.edited == want_row.forward.edited and row.reverse.edited == want_row.reverse.edited
    forward, reverse = panel.results.texts()
    assert forward[0] == "painted region forward" and reverse[0] == "painted region reverse"
    assert want.original.foil == want.source.predicted != want.original.predicted  # the score: the logit diff
    for cells, effect in ((forward, want_row.forward), (reverse, want_row.reverse)):
        before, after = effect.original.logit_diff, effect.edited.logit_diff
        assert cells[2] == f"{before:+.3f} → {after:+.3f}\n({after - before:+.3f})"
    where = site if layer is None else f"{site} block {layer}"
    assert panel.results.title.text().startswith(f"visual-feature patching at {where} from {source.name}")
    tabs = window.counterfactual_panel.numbers_tabs
    assert tabs.currentWidget() is panel.results  # the table is brought up


def test_choices_that_map_to_nothing_are_a_message(qtbot, read_out):
    """Nothing selected, the embedding selected (Lens row 0), the painted region with
    nothing painted, no source image: a line in the window, no job, no traceback."""
    window = read_out
    panel = window.intervention_panel

    def refused(start, words: str) -> None:
        assert not start()
        assert not window.is_busy()
        assert words in window.inputs.error_label.text() and words in panel.message_label.text()
        assert "Traceback" not in window.inputs.error_label.text()

    refused(window.actions.ablate_selected, "select a component first")
    assert window.lens_panel.select_layer(0)
    assert window.selection.current.name == "embed"
    refused(window.actions.ablate_selected, "embed: not an activation a forward can ablate")
    window.attention_panel.select_head(0, 0)
    panel.set_positions("region")
    refused(window.actions.ablate_selected, "paint a region in the Counterfactual tab")
    refused(window.actions.patch_region, "choose a source image")
    panel.set_source(bundled_samples()[1].image_path)
    refused(window.actions.patch_region, "paint a region in the Counterfactual tab")
    panel.set_positions("target")
    panel.set_kind("resample")
    panel.source_combo.setCurrentIndex(0)  # the placeholder: no source
    refused(window.actions.ablate_selected, "resample ablation: choose a source image")
    assert window.session.runs("intervention") == []


def test_a_new_readout_stales_the_selection_and_a_new_image_clears_it(qtbot, read_out):
    window = read_out
    window.dla_panel.select_component("L2.mlp", emit=True)
    assert not window.selection.current.stale
    window.set_question("what shape is the red object?")
    run_until_idle(qtbot, window, window.actions.run_readout)
    assert window.selection.current.stale and window.selection.current.name == "L2.mlp"
    assert "stale" in window.intervention_panel.component_label.text()
    assert not window.actions.ablate_selected()
    assert "select it again" in window.inputs.error_label.text()
    window.dla_panel.select_component("L2.mlp", emit=True)  # selected again in the read-out shown
    assert not window.selection.current.stale
    assert window.load_sample(bundled_samples()[1])
    assert window.selection.current is None


def test_a_restored_ablation_fills_the_same_table_and_selection(qtbot, read_out):
    window = read_out
    window.dla_panel.select_component("L3.H2", emit=True)
    ablate(qtbot, window)
    ablation_id = window.session.runs("intervention")[-1].id
    live = window.intervention_panel.results.texts()
    assert window.load_sample(bundled_samples()[5])
    assert window.intervention_panel.results.texts() == []  # a new image empties every view
    assert window.sessions.restore_run(ablation_id)
    assert window.intervention_panel.results.texts() == live
    assert window.counterfactual_panel.numbers_tabs.currentWidget() is window.intervention_panel.results
    selected = window.selection.current
    assert (selected.name, selected.view, selected.stale) == ("L3.H2", "dla", False)
    assert window.dla_panel.selected == "L3.H2"
