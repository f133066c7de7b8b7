"""``vlm-readout audit`` at dataset scale: one process against two (torchrun,
gloo), on held-out synthetic scenes, for each default model.

    python bench/audit_scale.py [--n 200] [--batch-size 16] [--json bench/results/audit_scale.json]

For each model: writes ``--n`` held-out scenes with ``python -m core.zoo.dataset``
(at least one distractor each), runs the audit with every method (counterfactual:
mean fill of the target's ground-truth mask) in one process and again under
``python -m torch.distributed.run --nproc_per_node 2`` (gloo), checks every
output but run.json is byte-identical, and records wall times and the
summary's headline numbers. Every process runs with one thread
(``OMP_NUM_THREADS=1``), so the outputs can be compared bit for bit; the 2-process
speed-up depends on free cores (the development machine has 2, one of them busy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = "answer,lens,attention,dla,rollout,counterfactual"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], env: dict) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def bench_model(model: str, data: Path, work: Path, batch_size: int, env: dict) -> dict:
    audit = ["-m", "core.cli", "audit", "--model", model, "--dataset", str(data), "--methods", METHODS]
    audit += ["--batch-size", str(batch_size), "--quiet"]
    one, two = work / f"{model}-1", work / f"{model}-2"
    t1 = _run([sys.executable, *audit, "--out", str(one)], env)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    launcher += ["--master_addr", "127.0.0.1", "--master_port", str(_port())]
    t2 = _run([*launcher, *audit, "--out", str(two)], env)
    names = sorted(p.name for p in one.iterdir() if p.name != "run.json")
    differing = [n for n in names if (one / n).read_bytes() != (two / n).read_bytes()]
    s = json.loads((one / "summary.json").read_text())
    g = s["groups"]["all"]
    cf = g["counterfactual"]
    rve = s.get("routing_vs_effect", {})
    return {
        "model": model,
        "n": s["n_samples"],
        "n_errors": s["n_errors"],
        "accuracy": s["accuracy"],
        "by_kind": s["by_kind"],
        "counterfactual_mean_fill_target": {
            "n": cf["drop"]["n"] if cf["drop"] else 0,
            "share_drop_positive": cf["share_drop_positive"],
            "median_drop": cf["drop"]["quantiles"]["0.5"] if cf["drop"] else None,
            "flip_rate": cf["flip_rate"],
        },
        "spearman_routing_vs_drop": {k: rve[k] for k in ("rollout_region_mass", "mean_head_region_mass") if k in rve},
        "one_process_s": round(t1, 2),
        "two_process_s": round(t2, 2),
        "files_compared": names,
        "files_differing": differing,
        "byte_identical": not differing,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--models", default="shapes-coca,shapes-llava")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "audit_scale.json"))
    a = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "data"
        subprocess.run(
            [sys.executable, "-m", "core.zoo.dataset", "--split", "heldout", "--n", str(a.n), "--out", str(data)]
            + ["--min-distractors", "1", "--quiet"],
            cwd=ROOT,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        for model in a.models.split(","):
            rows.append(bench_model(model, data, work, a.batch_size, env))
            print(json.dumps(rows[-1]), flush=True)
    import torch

    doc = {
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads_per_process": 1,
        "dataset": f"heldout scenes 0.. with at least one distractor, n={a.n}",
        "batch_size": a.batch_size,
        "methods": METHODS,
        "rows": rows,
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(r["byte_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
