"""The read-out registry and its two drivers: one sample through ``analyze`` and
through the dataset audit gives the same numbers; ``AnalyzeResult`` is a
Readout that reads as the analyze JSON; the one set of audit-table writers."""

import csv
import io
import json
import math

import pytest
import torch
from PIL import Image

from core import load_model
from core.analyze import AnalyzeResult, analyze
from core.dataset_audit import METHODS, AuditMethod, parse_methods, read_dataset, run_shard, token_cover
from core.errors import ReadoutError
from core.files.images import load_mask
from core.readouts import ANALYZE_READOUTS, READOUTS, register_method
from core.results.audit import AuditRecord
from core.results.audit_tables import RECORD_COLUMNS, audit_csv, audit_markdown, cell, markdown_cell
from core.results.readout import Readout, Target
from core.zoo.dataset import write_dataset

BOTH = "answer,lens,attention,dla,rollout"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds")
    write_dataset(out, "heldout", 3, kind="attribute")  # every sample has a target mask
    return out


def _patch_values(grid_doc: dict, tokens: list[dict]) -> tuple[list[int], torch.Tensor]:
    """The analyze JSON's per-token values behind a patch grid, in token order (float64)."""
    by_image = {g["image"]: g["grid"] for g in grid_doc.get("visual_patch_mass_by_image") or []}
    index, values = [], []
    for i, t in enumerate(tokens):
        if t["col"] >= 0:
            g = by_image.get(t["image"], grid_doc["visual_patch_mass"])
            index.append(i)
            values.append(g[t["row"]][t["col"]])
    return index, torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("spec", ["shapes-coca", "shapes-llava"])
def test_one_sample_through_both_drivers_gives_the_same_numbers(spec, dataset):
    """analyze and a one-sample audit batch run the same capture and the same
    read-outs: every number the audit keeps is analyze's, exactly (the sums
    and dot products the audit derives are redone here with the same ops)."""
    loaded = load_model(spec)
    items = read_dataset(dataset)
    records = run_shard(loaded, items, parse_methods(BOTH), batch_size=1).records
    for item, rec in zip(items, records, strict=True):
        ref = analyze(loaded, item.image_path, item.question, answer=item.answer, foil=item.foil).to_dict()
        ro, t = rec["readouts"], ref["target"]
        assert rec["status"] == "ok" and rec["predicted"] == t["predicted"]
        # answer
        assert ro["answer"]["answer_logit"] == t["logit"] and ro["answer"]["answer_prob"] == t["prob"]
        assert ro["answer"]["logit_diff"] == t["logit_diff"] and ro["answer"]["top"] == t["top"]
        assert ro["answer"]["predicted_prob"] == t["top"][0][1]
        assert (ro["answer"]["answer_id"], ro["answer"]["foil_id"]) == (t["answer_id"], t["foil_id"])
        # logit lens
        assert ro["lens"]["position"] == t["position"]
        for mine, theirs in zip(ro["lens"]["rows"], ref["logit_lens"], strict=True):
            for key in ("layer", "answer_rank", "answer_logit", "logit_diff", "kl_to_final"):
                assert mine[key] == theirs[key], key
            assert mine["top1"] == theirs["top"][0][0]
        # attention
        assert ro["attention"]["query_position"] == t["position"]
        for mine, theirs in zip(ro["attention"]["heads"], ref["attention"], strict=True):
            assert (mine["block"], mine["head"]) == (theirs["layer"], theirs["head"])
            assert mine["visual_mass"] == theirs["visual_mass"] and mine["sink_mass"] == theirs["bos_mass"]
            assert mine["entropy"] == theirs["entropy"] and mine["argmax_source"] == theirs["argmax_source"]
            assert mine["other_mass"] == theirs["other_mass"]
        # DLA: every component's number, and the decomposition's checks
        rd = ref["residual_decomposition"]
        assert ro["dla"]["dla_frozen"] == {c["name"]: c["dla_frozen"] for c in rd["components"]}
        for key in ("reconstruction_max_abs_err", "target_logit", "frozen_sum_expected"):
            assert ro["dla"][key] == rd[key]
        assert ro["dla"]["top"] == sorted(rd["components"], key=lambda c: -abs(c["dla_frozen"]))[:10]
        # rollout: the grid's per-token values, summed / weighted as the audit does
        tokens = ref["input"]["visual_tokens"]
        index, values = _patch_values(ref["rollout"], tokens)
        assert ro["rollout"]["alpha"] == ref["rollout"]["alpha"] and ro["rollout"]["skipped"] is None
        assert ro["rollout"]["visual_mass"] == float(values.sum())
        best = tokens[index[int(values.argmax())]]
        assert ro["rollout"]["argmax_patch"] == [best["row"], best["col"]]
        # the target region: each token's share inside the mask
        mask = load_mask(item.target_mask)
        cover = torch.as_tensor(token_cover(loaded.adapter.visual_tokens(Image.open(item.image_path).size), mask))
        assert ro["rollout"]["region_mass"] == float(values @ cover[index])
        for mine, theirs in zip(ro["attention"]["heads"], ref["attention"], strict=True):
            idx, vals = _patch_values(theirs, tokens)
            # a text-only block of a cross-attention model has no visual key: no region mass
            assert mine["region_mass"] == (float(vals @ cover[idx]) if mine["has_visual_keys"] else None)


def test_the_registry_serves_both_drivers_and_takes_plugins(dataset):
    assert all(READOUTS[n].analyze_key for n in ANALYZE_READOUTS)
    assert set(METHODS) == {"answer", "lens", "attention", "dla", "rollout", "counterfactual"}
    assert "text_patterns" in READOUTS and "text_patterns" not in METHODS
    with pytest.raises(ReadoutError, match="analyze only"):
        parse_methods("answer,text_patterns")

    class PredictedRank(AuditMethod):
        """A plugin: the answer's rank among the logits (a section from the context)."""

        name = "answer_rank"
        audit_method = "model output"
        needs_capture = False

        def run(self, ctx):
            return {"rank": int((ctx.logits > ctx.logits[ctx.answer_id]).sum())}, None

        def csv_columns(self):
            return ["answer_rank"]

        def csv_values(self, s):
            return {"answer_rank": s["rank"]}

    register_method(PredictedRank())
    try:
        assert "answer_rank" in METHODS
        loaded = load_model("shapes-coca")
        recs = run_shard(loaded, read_dataset(dataset), parse_methods("answer,answer_rank"), batch_size=2).records
        for r in recs:
            assert (r["readouts"]["answer_rank"]["rank"] == 0) == r["correct"]
    finally:
        READOUTS.pop("answer_rank")
    assert "answer_rank" not in METHODS


def test_rollout_has_one_implementation_for_both_drivers(dataset, monkeypatch):
    import core.methods.patterns as module

    calls = []
    real = module.rollout_visual_mass

    def counting(*args, **kw):
        calls.append(kw.get("batch", 0))
        return real(*args, **kw)

    monkeypatch.setattr(module, "rollout_visual_mass", counting)
    loaded = load_model("shapes-coca")
    item = read_dataset(dataset, limit=1)[0]
    analyze(loaded, item.image_path, item.question)
    run_shard(loaded, read_dataset(dataset), parse_methods("rollout"), batch_size=3)
    assert calls == [0, 0, 1, 2]  # analyze's one sample, then each row of the audit's batch


def test_analyze_result_is_a_readout_and_reads_as_the_json(dataset):
    loaded = load_model("shapes-llava")
    item = read_dataset(dataset, limit=1)[0]
    result = analyze(loaded, item.image_path, item.question, answer=item.answer, foil=item.foil, rollout_alpha=0.25)
    assert isinstance(result, Readout) and result.kind == "analyze"
    doc = result.to_dict()
    assert isinstance(result.target, Target) and result.target.position == doc["target"]["position"]
    text = json.dumps(doc, allow_nan=False)  # strict JSON
    assert not isinstance(result, dict)  # typed: the document is to_dict's, not the result itself
    assert doc["target"]["prob"] == result.target.prob and doc["target"]["top"] == [list(t) for t in result.top]
    back = AnalyzeResult.from_dict(json.loads(text))
    assert back.to_dict() == doc and back.target == result.target and back.parameters() == result.parameters()
    assert result.parameters() == {
        "question": item.question,
        "answer": item.answer,
        "foil": item.foil,
        "rollout_alpha": 0.25,
    }
    assert [a.to_dict() for a in result.audit_records()] == doc["audit"]
    assert all(isinstance(a, AuditRecord) for a in result.audit_records())
    line = result.summary()
    assert "\n" not in line and line.startswith(f"answer {item.answer!r} p=")
    assert f"logit diff vs {item.foil!r}" in line and "most visual head L" in line
    assert "largest frozen-scale DLA" in line and "reconstruction error" in line


def test_the_read_outs_give_typed_sections_and_a_restored_result_reads_alike(dataset):
    """Each section is its read-out's class, not a dict; the result a stored JSON restores
    (``from_dict``) holds the same typed values as the live one, which the app draws alike."""
    from core.methods.answer_patterns import AnswerPatterns
    from core.methods.logit_lens import LensRow
    from core.methods.patterns import HeadSummary, TextPatterns
    from core.readouts.residual import ResidualSection
    from core.readouts.rollout import RolloutSection

    loaded = load_model("shapes-coca")
    item = read_dataset(dataset, limit=1)[0]
    result = analyze(loaded, item.image_path, item.question, answer=item.answer, foil=item.foil)
    assert isinstance(result.residual_decomposition, ResidualSection)
    assert result.logit_lens and all(isinstance(r, LensRow) and r.reader is None for r in result.logit_lens)
    assert result.attention and all(isinstance(h, HeadSummary) for h in result.attention)
    assert isinstance(result.rollout, RolloutSection) and isinstance(result.text_patterns, TextPatterns)
    assert isinstance(result.answer_patterns, AnswerPatterns) and result.tuned_lens is None
    back = AnalyzeResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert back.model == result.model and back.input == result.input and back.target == result.target
    assert back.attention == result.attention and back.logit_lens == result.logit_lens
    assert back.residual_decomposition == result.residual_decomposition and back.rollout == result.rollout
    assert back.block_names == result.block_names == {h.layer: h.block for h in result.attention}
    head = result.attention[-1]
    assert result.head(head.layer, head.head) is head and result.head(99, 0) is None
    # a section's mistakes are named: a stored document without a part it needs does not restore
    doc = result.to_dict()
    del doc["residual_decomposition"]
    with pytest.raises(KeyError, match="residual_decomposition"):
        AnalyzeResult.from_dict(doc)


def test_one_escaping_for_every_audit_table():
    nasty = 'a|b\\c\nd\re, "quoted"'
    assert cell(None) == "" and cell(float("nan")) == "" and cell(float("inf")) == ""
    assert cell(True) == "true" and cell(0.1) == repr(0.1) and cell(3) == "3"
    assert cell(["x", "y"]) == "x; y" and cell({"b": 1, "a": float("nan")}) == '{"a": null, "b": 1}'
    md = markdown_cell(nasty)
    assert "\n" not in md and "\r" not in md and md.count("\\|") == 1 and "\\\\c" in md
    rec = AuditRecord.for_method("logit lens", controls=["c1", "c2"], parameters={"q": nasty}, notes=[nasty])
    rows = list(csv.DictReader(io.StringIO(audit_csv([rec]))))  # AuditRecords or dicts alike
    assert list(rows[0]) == RECORD_COLUMNS and rows[0]["notes"] == nasty and rows[0]["controls"] == "c1; c2"
    assert json.loads(rows[0]["parameters"]) == {"q": nasty}
    assert audit_csv([rec]) == audit_csv([rec.to_dict()])
    lines = audit_markdown([rec], title="T").splitlines()
    assert lines[:2] == ["# T", ""] and lines[2] == "| " + " | ".join(RECORD_COLUMNS) + " |"
    assert len(lines) == 5 and lines[4].count(" | ") == len(RECORD_COLUMNS) - 1  # no pipe or line break leaked
    assert not math.isnan(float(cell(1e-300)))
