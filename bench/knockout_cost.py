"""What a knockout sweep and an activation-patching grid cost in plain forwards,
measured side by side (interleaved) in one process.

    python bench/knockout_cost.py [--threads 1] [--repeats 9] [--json bench/results/knockout_cost.json]

* sweep: ``core.requests.knockout.KnockoutRequest.run`` (``rollout=False``; with
  rollout's per-layer reach, one more capture of full patterns, beside it) for three edge kinds
  (image->answer, question->answer, image->question) at window 1: the unedited
  capture, the position sets, and (layers + 1) x 3 edited forwards (every
  single-layer window and all layers), batched ``--batch-size`` at a time;
* grid: ``core.requests.patch_grid.PatchGridRequest.run`` at the residual stream over
  layers x 4 position groups (image, region: the upper-left quarter, question, answer),
  from another bundled sample: the two unedited captures and layers x 4 patched rows, batched;
* plain: the model's own forward on the prepared input (``adapter.forward_logits``), batch 1.

Bars (issue 29): sweep / plain <= layers x kinds + 1, grid / plain <= layers x 4 + 1
(medians; the fastest runs' ratio beside them). The sweep runs kinds x (layers + 1) edited rows, three more than
the bar counts (the all-layers windows), so it meets the bar only by batching.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from datetime import date
from pathlib import Path

import numpy as np
import torch
from timing import interleaved_times  # bench/timing.py (the script's folder is on sys.path)

from core import load_model
from core.files.images import load_image
from core.models.loading import resources_dir
from core.requests.knockout import KnockoutRequest
from core.requests.patch_grid import PatchGridRequest

EDGES = ("image->answer", "question->answer", "image->question")


@torch.no_grad()
def bench(name: str, repeats: int, batch_size: int) -> dict:
    loaded = load_model(name)
    a = loaded.adapter
    image = load_image(resources_dir() / "samples" / "sample_00.png")
    question = "what color is the circle?"
    request = KnockoutRequest(image=image, question=question, edges=EDGES, batch_size=batch_size, rollout=False)
    with_rollout = KnockoutRequest(image=image, question=question, edges=EDGES, batch_size=batch_size)
    mask = np.zeros((image.height, image.width), dtype=bool)
    mask[: image.height // 2, : image.width // 2] = True
    grid = PatchGridRequest(
        image=image,
        question=question,
        source_image=load_image(resources_dir() / "samples" / "sample_02.png"),
        foil="red",
        mask=mask,
        batch_size=batch_size,
    )
    inputs = a.prepare([image], [question])
    result = request.run(loaded)
    grid_result = grid.run(loaded)
    layers = len(result.layers)

    fns = {
        "sweep": lambda: request.run(loaded),
        "with_rollout": lambda: with_rollout.run(loaded),
        "grid": lambda: grid.run(loaded),
        "plain": lambda: a.forward_logits(inputs),
    }
    times = interleaved_times(fns, repeats)
    t = {k: statistics.median(v) for k, v in times.items()}
    fastest = {k: min(v) for k, v in times.items()}
    return {
        "model": name,
        "fingerprint": loaded.fingerprint,
        "layers": layers,
        "kinds": len(EDGES),
        "edited_rows": sum(1 for p in result.profiles for w in p.windows if w.cut),
        "batch_size": batch_size,
        "bar_forwards": layers * len(EDGES) + 1,
        "sweep_ms": 1000 * t["sweep"],
        "plain_ms": 1000 * t["plain"],
        "ratio": t["sweep"] / t["plain"],
        "ratio_fastest": fastest["sweep"] / fastest["plain"],
        "with_rollout_ms": 1000 * t["with_rollout"],
        "with_rollout_ratio": t["with_rollout"] / t["plain"],
        "grid_blocks": len(grid_result.blocks),
        "grid_bar_forwards": len(grid_result.blocks) * 4 + 1,
        "grid_rows": sum(v is not None for row in grid_result.metric for v in row),
        "grid_ms": 1000 * t["grid"],
        "grid_ratio": t["grid"] / t["plain"],
        "grid_ratio_fastest": fastest["grid"] / fastest["plain"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [bench(name, args.repeats, args.batch_size) for name in ("shapes-llava", "shapes-coca")]
    print(
        "| model | layers x kinds + 1 (bar) | edited rows | sweep ms | forward ms | sweep / forward | fastest "
        "| with rollout / forward |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} ({r['fingerprint'][:16]}) | {r['bar_forwards']} | {r['edited_rows']} | "
            f"{r['sweep_ms']:.1f} | {r['plain_ms']:.2f} | {r['ratio']:.2f} | {r['ratio_fastest']:.2f} | "
            f"{r['with_rollout_ratio']:.2f} |"
        )
    print()
    print("| model | blocks x 4 + 1 (bar) | patched rows | grid ms | forward ms | grid / forward | fastest |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} ({r['fingerprint'][:16]}) | {r['grid_bar_forwards']} | {r['grid_rows']} | "
            f"{r['grid_ms']:.1f} | {r['plain_ms']:.2f} | {r['grid_ratio']:.2f} | {r['grid_ratio_fastest']:.2f} |"
        )
    if args.json:
        doc = {
            "date": date.today().isoformat(),
            "machine": platform.machine(),
            "torch": torch.__version__,
            "threads": args.threads,
            "repeats": args.repeats,
            "rows": rows,
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
