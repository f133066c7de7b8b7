"""Batch-1 forward time of the default models, and the cost of VLM Readout's
answer path relative to the plain forward, measured side by side in one run.

    python bench/forward_latency.py [--threads 2] [--repeats 50] [--json bench/results/forward_latency.json]

The absolute milliseconds depend on the machine and its load (the issue's
bar is "under 30 ms on 2 CPU cores"); the ratio column is the comparable one.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch
from timing import interleaved_times  # bench/timing.py (the script's folder is on sys.path)

from core import answer, load_model
from core.zoo import scenes


@torch.no_grad()
def bench(name: str, repeats: int) -> dict:
    loaded = load_model(name)
    s = scenes.make_sample("heldout", 0)
    inputs = loaded.adapter.prepare([s.image], [s.question])
    times = interleaved_times(
        {
            "plain": lambda: loaded.adapter.forward_logits(inputs),
            "full": lambda: answer(loaded, s.image, s.question),
        },
        repeats,
    )
    plain, full = (1000 * statistics.median(times[k]) for k in ("plain", "full"))
    return {
        "model": name,
        "fingerprint": loaded.fingerprint,
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
        "forward_ms": round(plain, 2),
        "answer_path_ms": round(full, 2),
        "answer_path_over_forward": round(full / plain, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = [bench(n, a.repeats) for n in ("shapes-llava", "shapes-coca")]
    print("| model | parameters | forward ms (batch 1) | answer path ms | answer / forward |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['parameters']:,} | {r['forward_ms']} | {r['answer_path_ms']} | {r['answer_path_over_forward']} |"
        )
    if a.json:
        out = {"threads": a.threads, "machine": platform.machine(), "processor": platform.processor(), "rows": rows}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
