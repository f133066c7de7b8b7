"""`vlm-readout audit`: the synthetic dataset writer, per-sample read-outs
against `analyze`, error rows, the audit table, and the 2-process (gloo)
sharded run giving byte-identical outputs to a one-process run."""

import csv
import json
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from core import load_model
from core.analyze import analyze
from core.cli import build_parser, main
from core.cli.audit import run as cmd_audit
from core.dataset_audit import (
    METHODS,
    AuditOptions,
    merge_shards,
    parse_methods,
    read_dataset,
    run_shard,
    shard_chunks,
    write_outputs,
)
from core.files.atomic import staged_writes
from core.files.images import load_mask
from core.zoo import scenes
from core.zoo.dataset import main as dataset_main
from core.zoo.dataset import write_dataset
from tests.core.exactness import forwards_tol
from tests.tolerances import sum_tol

ALL = "answer,lens,attention,dla,rollout,counterfactual"


@pytest.fixture(scope="module")
def coca():
    return load_model("shapes-coca")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds")
    write_dataset(out, "heldout", 8)
    return out


def _args(dataset, out, *extra):
    return build_parser().parse_args(
        ["audit", "--model", "shapes-coca", "--dataset", str(dataset), "--out", str(out), "--quiet", *extra]
    )


@pytest.fixture(scope="module")
def reference(coca, dataset, tmp_path_factory):
    """One single-process run with every method, batch size 3, one thread."""
    out = tmp_path_factory.mktemp("ref")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cmd_audit(_args(dataset, out, "--methods", ALL, "--batch-size", "3"), lambda a: coca) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_dataset_writer_round_trips_images_and_masks(tmp_path):
    rows = write_dataset(tmp_path, "heldout", 5, min_distractors=1)
    lines = [json.loads(x) for x in (tmp_path / "dataset.jsonl").read_text().splitlines()]
    assert lines == rows and len(rows) == 5
    assert json.loads((tmp_path / "manifest.json").read_text())["n"] == 5
    for row in rows:
        s = scenes.make_sample(row["split"], row["index"])
        assert (row["question"], row["answer"], row["foil"], row["kind"]) == (s.question, s.answer, s.foil, s.kind)
        assert np.array_equal(np.asarray(Image.open(tmp_path / row["image"])), s.image)
        for k, o in enumerate(s.objects):
            assert np.array_equal(load_mask(tmp_path / row["object_masks"][k]), o.mask)
        if s.target is not None:
            assert np.array_equal(load_mask(tmp_path / row["target_mask"]), s.objects[s.target].mask)
        else:
            assert row["target_mask"] is None
        assert row["distractors"] == s.distractors and len(s.distractors) >= 1
        for k, m in zip(s.distractors, row["distractor_masks"]):
            assert np.array_equal(load_mask(tmp_path / m), s.objects[k].mask)
    # the command line writes the same thing
    assert dataset_main(["--split", "heldout", "--n", "2", "--out", str(tmp_path / "cli"), "--quiet"]) == 0
    again = [json.loads(x) for x in (tmp_path / "cli" / "dataset.jsonl").read_text().splitlines()]
    assert [r["index"] for r in again] == [0, 1]


def test_sharding_covers_every_batch_once():
    for n, b, world in [(8, 3, 2), (8, 1, 2), (7, 2, 3), (2, 4, 3)]:
        seen = [i for r in range(world) for c in shard_chunks(n, b, r, world) for i in c]
        assert sorted(seen) == list(range(n))
    assert [list(c) for c in shard_chunks(6, 1, 1, 2)] == [[1], [3], [5]]  # batch size 1: i % world == rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_worker(rank, world, port, dataset, out, model):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    assert cmd_audit(_args(dataset, out, "--methods", ALL, "--batch-size", "3"), lambda a: model) == 0


def test_two_gloo_processes_write_exactly_the_single_process_outputs(coca, dataset, reference, tmp_path):
    import torch.multiprocessing as tmp

    out = tmp_path / "dist"
    # fork: the workers inherit the imported modules and the loaded model (no reload)
    tmp.start_processes(
        _rank_worker, args=(2, _free_port(), dataset, out, coca), nprocs=2, join=True, start_method="fork"
    )
    names = sorted(p.name for p in reference.iterdir() if p.name != "run.json")
    assert names == sorted(p.name for p in out.iterdir() if p.name != "run.json")
    assert {"samples.csv", "samples.jsonl", "summary.json", "audit.csv", "audit.md", "audit.json"} <= set(names)
    for name in names:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    run = json.loads((out / "run.json").read_text())
    assert run["world_size"] == 2 and run["backend"] == "gloo" and run["complete"]
    assert json.loads((reference / "run.json").read_text())["world_size"] == 1


def test_outputs_hold_the_audit_table_with_every_method_row(reference):
    expected = [METHODS[m].audit_method for m in ALL.split(",")]
    rows = json.loads((reference / "audit.json").read_text())["rows"]
    assert [r["method"] for r in rows] == expected
    assert [r["parameters"]["readout"] for r in rows] == ALL.split(",")
    for r in rows:
        p = r["parameters"]
        assert p["model"] == "shapes-coca" and p["batch_size"] == 3 and p["n_samples"] == 8
        assert r["supports"] and r["cannot_support"] and r["controls"]
        assert "correct and incorrect samples summarised apart" in r["controls"]
    with open(reference / "audit.csv", newline="") as fh:
        assert [r["method"] for r in csv.DictReader(fh)] == expected
    md = (reference / "audit.md").read_text().splitlines()
    assert md[0].startswith("| method |") and [line.split(" | ")[0][2:] for line in md[2:]] == expected
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["audit"] == rows
    assert summary["n_samples"] == 8 and summary["n_errors"] == 0
    assert summary["n_correct"] + summary["n_incorrect"] == 8
    assert {"all", "correct", "incorrect"} <= set(summary["groups"])
    prob = summary["groups"]["all"]["answer"]["answer_prob"]
    assert prob["n"] == 8 and set(prob["quantiles"]) == {"0.05", "0.25", "0.5", "0.75", "0.95"}
    assert len(prob["edges"]) == len(prob["counts"]) + 1 and sum(prob["counts"]) == 8
    assert summary["routing_vs_effect"]["rollout_region_mass"]["n"] >= 1
    # the flat table and the JSONL agree, sample by sample, in dataset order
    recs = [json.loads(x) for x in (reference / "samples.jsonl").read_text().splitlines()]
    with open(reference / "samples.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    assert [int(r["index"]) for r in table] == [r["index"] for r in recs] == list(range(8))
    for row, rec in zip(table, recs):
        assert float(row["answer_prob"]) == rec["readouts"]["answer"]["answer_prob"]
        assert row["correct"] == ("true" if rec["correct"] else "false")


@torch.no_grad()
def padded_batch_tols(loaded, item) -> tuple[float, float, int, int]:
    """``(logit, weight, n_blocks, n_keys)``: how far a sample's numbers from a
    padded batch may be from its single run. A logit: as far as two forwards may
    be apart. A pattern weight, relative to itself: twice its scores' change
    (softmax's sensitivity), the scores as far as two forwards may be apart."""
    from core.forward.capture import capture

    a = loaded.adapter
    tr = capture(loaded, item.image_path, item.question, keep_qk=True)
    n_keys = max(tr.input_ids.shape[1], len(a.visual_tokens((128, 128))))
    # the scores' terms: scale |q| . |k| (the model's own q and k)
    scores = 0.0
    for b in range(tr.n_blocks):
        q = tr.q[b][0].abs()  # (pos, heads, d_head)
        k = tr.k[b][0].abs().repeat_interleave(q.shape[1] // tr.k[b].shape[2], dim=1)
        scores = max(scores, float(torch.einsum("qhd,khd->hqk", q, k).max()) * abs(tr.score_scale[b]))
    weight = 2 * forwards_tol(a, scores, n_keys)
    logit = forwards_tol(a, tr.logits[0, int(tr.answer_positions[0])], n_keys)
    return logit, weight, tr.n_blocks, n_keys


def test_per_sample_readouts_equal_analyze(coca, dataset):
    """One sample at a time the audit runs what analyze runs (one capture of that
    prompt, the same read-outs): the same numbers, exactly."""
    items = read_dataset(dataset, limit=4)
    methods = parse_methods("answer,lens,attention,dla,rollout")
    one = run_shard(coca, items, methods, batch_size=1).records
    for item, rec in zip(items[:3], one):
        ref = analyze(coca, item.image_path, item.question, answer=item.answer, foil=item.foil).to_dict()
        ro = rec["readouts"]
        t = ref["target"]
        assert ro["answer"]["answer_logit"] == t["logit"]
        assert ro["answer"]["logit_diff"] == t["logit_diff"]
        assert rec["correct"] == (t["predicted"] == item.answer)
        for mine, theirs in zip(ro["lens"]["rows"], ref["logit_lens"]):
            assert mine["answer_rank"] == theirs["answer_rank"]
            assert mine["logit_diff"] == theirs["logit_diff"]
        heads = {(h["layer"], h["head"]): h for h in ref["attention"]}
        for h in ro["attention"]["heads"]:
            assert h["visual_mass"] == heads[(h["block"], h["head"])]["visual_mass"]
            assert h["sink_mass"] == heads[(h["block"], h["head"])]["bos_mass"]
        comps = {c["name"]: c for c in ref["residual_decomposition"]["components"]}
        for c in ro["dla"]["top"]:
            assert c["dla_frozen"] == comps[c["name"]]["dla_frozen"]
        assert set(ro["dla"]["dla_frozen"]) == set(comps)
        grid = np.array(ref["rollout"]["visual_patch_mass"], dtype=float)
        # the grid's cells summed here in another order (float64)
        assert ro["rollout"]["visual_mass"] == pytest.approx(
            float(np.nansum(grid)), abs=sum_tol(1.0, grid.size, torch.float64)
        )
        # region mass: attention weighted by each patch's share inside the target mask
        if item.target_mask is not None:
            mask = load_mask(item.target_mask)
            cover = mask.reshape(8, 16, 8, 16).mean(axis=(1, 3))  # 16 px patches on 128 px
            for h in ro["attention"]["heads"]:
                if h["has_visual_keys"]:
                    g = np.array(heads[(h["block"], h["head"])]["visual_patch_mass"])
                    tol = sum_tol(float(g.sum()), g.size + 1, torch.float32)  # float32 weights, another order
                    assert h["region_mass"] == pytest.approx(float((g * cover).sum()), abs=tol)
    # batching pads the prompts; the numbers move by float noise only
    batched = run_shard(coca, items, methods, batch_size=4).records
    for item, a, b in zip(items, one, batched):
        logit, weight, n_blocks, n_keys = padded_batch_tols(coca, item)
        # a rollout mass (at most 1): the product over blocks adds their weights' relative errors
        mass = n_blocks * weight + sum_tol(1.0, n_keys, torch.float32)
        assert a["predicted"] == b["predicted"]
        assert a["readouts"]["answer"]["answer_logit"] == pytest.approx(
            b["readouts"]["answer"]["answer_logit"], abs=logit
        )
        assert a["readouts"]["rollout"]["visual_mass"] == pytest.approx(
            b["readouts"]["rollout"]["visual_mass"], abs=mass
        )


def test_relative_paths_and_bad_samples_become_error_rows(coca, dataset, tmp_path, monkeypatch):
    src = read_dataset(dataset, limit=3)
    (tmp_path / "imgs").mkdir()
    (tmp_path / "lists").mkdir()
    rows = []
    for it in src:
        shutil.copy(it.image_path, tmp_path / "imgs" / Path(it.image).name)
        rows.append({"image": f"../imgs/{Path(it.image).name}", "question": it.question, "answer": it.answer})
    (tmp_path / "imgs" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    Image.new("L", (10, 10), 255).save(tmp_path / "imgs" / "small_mask.png")
    rows.insert(1, {"image": "../imgs/broken.png", "question": "what color is the circle?", "answer": "red"})
    rows.append(
        {"image": rows[0]["image"], "question": "is there a red circle?", "target_mask": "../imgs/small_mask.png"}
    )
    rows.append({"image": rows[0]["image"], "question": "is there a red circle?", "answer": "not-a-word-we-know"})
    (tmp_path / "lists" / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path / "imgs")  # paths resolve against the JSONL, not the working folder
    out = tmp_path / "out"
    assert cmd_audit(_args(tmp_path / "lists", out, "--batch-size", "3"), lambda a: coca) == 0
    recs = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["status"] for r in recs] == ["ok", "error", "ok", "ok", "error", "error"]
    assert recs[0]["image"] == "../imgs/" + Path(src[0].image).name
    assert "broken.png" in recs[1]["error"] and "\n" not in recs[1]["error"]
    assert "must match" in recs[4]["error"] and "single token" in recs[5]["error"]
    for r in recs:
        if r["status"] == "ok":
            assert set(r["readouts"]) == {"answer", "lens", "attention", "dla", "rollout"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_errors"] == 3 and summary["n_ok"] == 3
    assert [e["index"] for e in summary["errors"]] == [1, 4, 5]
    with open(out / "samples.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    assert [r["status"] for r in table] == [r["status"] for r in recs] and table[1]["answer_prob"] == ""
    assert "errors 3" in (out / "summary.md").read_text()


def test_unknown_method_and_bad_dataset_are_one_line_errors(tmp_path, capsys):
    assert main(["audit", "--dataset", str(tmp_path), "--out", str(tmp_path / "o"), "--methods", "answer,bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown method 'bogus'") and "\n" not in err and "counterfactual" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"image": "a.png", "question": "q"}\n{"image": 3}\n')
    assert main(["audit", "--dataset", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {bad}:2:")
    assert main(["audit", "--dataset", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "no such dataset" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cancel_keeps_the_finished_batches(coca, dataset, tmp_path):
    items = read_dataset(dataset)
    methods = parse_methods("answer,dla")
    calls = []

    def cancel():
        calls.append(1)
        return len(calls) > 1  # stop after the first batch

    shard = run_shard(coca, items, methods, batch_size=2, cancel=cancel)
    assert shard.cancelled and [r["index"] for r in shard.records] == [0, 1]
    params = {"model": "shapes-coca", "dataset": str(dataset)}
    with staged_writes() as staging:
        write_outputs(staging, tmp_path, merge_shards([shard]), methods, params, AuditOptions(), len(items))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cancelled"] and summary["n_samples"] == 2 and summary["n_requested"] == 8
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_self_attention_model_region_mass_in_a_padded_batch(tmp_path):
    """LLaVA keeps visual tokens in the text stream; two questions of different
    length share one padded batch (answer rows at different positions)."""
    llava = load_model("shapes-llava")
    write_dataset(tmp_path, "heldout", 2, kind="attribute")
    items = read_dataset(tmp_path)
    prepared = llava.adapter.prepare([Image.open(it.image_path) for it in items], [it.question for it in items])
    assert len(set(prepared.answer_positions.tolist())) == 2  # the batch is padded
    methods = parse_methods("attention")
    recs = run_shard(llava, items, methods, batch_size=2).records
    from core.forward.capture import capture

    for it, rec in zip(items, recs):
        mask = load_mask(it.target_mask)
        cover = torch.tensor(mask.reshape(8, 16, 8, 16).mean(axis=(1, 3)).reshape(-1), dtype=torch.float64)
        tr = capture(llava, it.image_path, it.question)
        _, weight, _, n_keys = padded_batch_tols(llava, it)  # a padded batch against this single run
        mass = weight + sum_tol(1.0, n_keys, torch.float32)  # a sum of weights (at most 1)
        for h in rec["readouts"]["attention"]["heads"]:
            pat = tr.patterns[h["block"]][0, h["head"], 0].double()
            assert h["visual_mass"] == pytest.approx(float(pat[tr.visual_positions[0]].sum()), abs=mass)
            assert h["region_mass"] == pytest.approx(float(pat[tr.visual_positions[0]] @ cover), abs=mass)


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("pyarrow") is None, reason="pyarrow is optional and not installed"
)
def test_parquet_is_written_when_pyarrow_is_there(reference):
    import pyarrow.parquet as pq

    assert pq.read_table(reference / "samples.parquet").num_rows == 8


def test_first_ctrl_c_asks_to_stop_after_the_batch(capsys):
    import signal

    from core.cli.audit import cancel_on_sigint

    before = signal.getsignal(signal.SIGINT)
    with cancel_on_sigint() as cancelled:
        assert not cancelled()
        os.kill(os.getpid(), signal.SIGINT)
        assert cancelled()
        # stderr holds only error: and warning: lines (no bar off a terminal, so no blank line)
        assert capsys.readouterr().err == "warning: stopping after this batch (Ctrl-C again to abort)\n"
        with pytest.raises(KeyboardInterrupt):  # the second one aborts
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_failed_session_record_leaves_the_earlier_outputs_as_they_were(coca, dataset, tmp_path, monkeypatch):
    """The output files are staged and land only once the --session run is
    recorded (core.files.atomic.staged_writes): a failed record changes none of an
    earlier run's files and leaves no temporary file."""
    import core.session
    from core.session import SessionError

    out = tmp_path / "out"
    assert cmd_audit(_args(dataset, out, "--limit", "2"), lambda a: coca) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(path, run, **kwargs):
        raise SessionError(f"{path}: cannot record the run: the disk is full")

    monkeypatch.setattr(core.session, "record_into", disk_full)
    session = tmp_path / "s.vlmr"
    with pytest.raises(SessionError, match="the disk is full"):
        cmd_audit(_args(dataset, out, "--limit", "3", "--session", str(session)), lambda a: coca)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
