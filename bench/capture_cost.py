"""Cost of a full capture and of all-heads x all-sources DLA, as ratios to a
plain eager forward with ``output_attentions=True`` on the same input,
measured side by side (interleaved) in one run.

    python bench/capture_cost.py [--threads 2] [--repeats 15] [--json bench/results/capture_cost.json]

Models: the default ``shapes-llava`` and a random LLaVA with a 7B-shaped
language model scaled down to fit a CPU (d_model 1024, 8 layers, 8 heads of
128, SwiGLU 2816, vocabulary 32000, 576 visual tokens from a 336 px image in
14 px patches; a small CLIP tower, since the language model is what is read out).

* capture: patterns of the answer position at every layer, every head's z,
  MLP outputs, residuals, final residual and logits (``core.forward.capture.capture``).
* DLA: ``core.methods.contributions.source_contributions`` for the answer
  position, every block x head x source, four conventions, on that trace.
* memory: the largest single allocation made while the DLA runs (torch's
  profiler), next to the size of its output and of the (layers, heads, sources,
  d_model) tensor a naive implementation would build.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from scale import random_llava  # bench/scale.py (the script's folder is on sys.path)
from timing import interleaved_times  # bench/timing.py

from core import load_model
from core.forward.capture import capture
from core.methods.contributions import source_contributions
from core.models.loading import LoadedModel


def big_llava() -> LoadedModel:
    """A random LLaVA with a 7B-shaped (scaled) language model of 8 heads of 128 and 576 visual tokens."""
    return random_llava("llava-1024", 336, None, torch.float32, "cpu", heads=8)


def _interleaved_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, timed interleaved."""
    return {k: statistics.median(v) for k, v in interleaved_times(fns, repeats).items()}


def _largest_allocation(fn) -> int:
    """Bytes of the largest single CPU allocation while ``fn`` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)


@torch.no_grad()
def bench(loaded: LoadedModel, image, question: str, repeats: int) -> dict:
    a = loaded.adapter
    inputs = a.prepare([image], [question])
    model = loaded.model
    model.set_attn_implementation("eager")
    trace = capture(loaded, None, "", inputs=inputs)
    answer_id = int(trace.logits[0, int(trace.answer_positions[0])].argmax())

    def plain():
        model(**inputs.tensors, output_attentions=True)

    def full_capture():
        capture(loaded, None, "", inputs=inputs)

    def dla():
        source_contributions(a, trace, answer_id)

    t = _interleaved_medians({"forward": plain, "capture": full_capture, "dla": dla}, repeats)
    n_pos = inputs.input_ids.shape[1]
    n_blocks, heads, d_model = len(a.blocks), a.n_heads, a.d_model
    out_bytes = 4 * n_blocks * heads * n_pos * trace.final_resid.element_size()
    naive_bytes = n_blocks * heads * n_pos * d_model * trace.final_resid.element_size()
    return {
        "model": loaded.spec,
        "fingerprint": loaded.fingerprint,
        "sequence_length": n_pos,
        "visual_tokens": int(trace.visual_positions.shape[1]),
        "layers": n_blocks,
        "heads": heads,
        "d_model": d_model,
        "forward_eager_output_attentions_ms": round(t["forward"] * 1000, 2),
        "capture_ms": round(t["capture"] * 1000, 2),
        "dla_all_heads_sources_ms": round(t["dla"] * 1000, 2),
        "capture_over_forward": round(t["capture"] / t["forward"], 3),
        "dla_over_forward": round(t["dla"] / t["forward"], 3),
        "dla_largest_allocation_bytes": _largest_allocation(dla),
        "dla_output_bytes": out_bytes,
        "naive_layers_heads_sources_dmodel_bytes": naive_bytes,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from core.zoo import scenes

    s = scenes.make_sample("heldout", 0)
    rows = [bench(load_model("shapes-llava"), Image.fromarray(s.image), s.question, args.repeats)]
    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 255, (336, 336, 3), dtype=np.uint8))
    rows.append(bench(big_llava(), photo, "what color is the circle ?", max(5, args.repeats // 3)))
    print(
        "| model | tokens | forward ms | capture ms | DLA ms | capture / forward | DLA / forward | DLA largest alloc | naive tensor |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['sequence_length']} | {r['forward_eager_output_attentions_ms']} | {r['capture_ms']} | "
            f"{r['dla_all_heads_sources_ms']} | {r['capture_over_forward']} | {r['dla_over_forward']} | "
            f"{r['dla_largest_allocation_bytes'] / 2**20:.2f} MiB | {r['naive_layers_heads_sources_dmodel_bytes'] / 2**20:.1f} MiB |"
        )
    if args.json:
        out = {
            "machine": platform.machine(),
            "torch": torch.__version__,
            "threads": args.threads,
            "rows": rows,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
