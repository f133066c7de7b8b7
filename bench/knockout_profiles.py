"""Knockout profiles of the default models over the bundled samples and generated
scenes: what cutting the image from the answer does, layer by layer, against
rollout and against a blank image.

    python bench/knockout_profiles.py [--scenes 32] [--json bench/results/knockout_profiles.json]

For each model and input (the 8 bundled samples, then ``--scenes`` attribute
scenes of the held-out split):

* **all layers vs blank image**: every image->answer edge (and every image->text
  edge: the image cut from every non-visual position, no indirect route left) cut in every layer
  (``core.methods.flow.knockout``), against the same question asked of a blank
  (mid-grey) image of the same size: whether the two predict the same token,
  and the total variation distance between their next-token distributions,
  beside the distance between the clean run and the blank run (what the cut
  would have to cover).
* **per-layer profile**: each single-layer window's drop of the answer's logit
  difference against the runner-up token (the model's top token and its second
  on the clean run), and rollout's reach from the image to the answer position
  through that layer; the per-input Pearson correlation of the two profiles,
  and its mean. A correlation of a structural approximation with an
  intervention, not a decomposition.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import date
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from core import load_model
from core.files.images import load_image
from core.forward.capture import capture, edited_logits
from core.methods.flow.knockout import ALL_LAYERS, knockout_edits, knockout_sweep
from core.methods.flow.positions import parse_edges
from core.models.loading import resources_dir
from core.zoo import scenes


def inputs_of(n_scenes: int) -> list[tuple[str, Image.Image, str]]:
    rows = [json.loads(x) for x in (resources_dir() / "samples" / "pairs.jsonl").read_text().splitlines()]
    out = [(f"sample {r['index']}", load_image(resources_dir() / "samples" / r["image"]), r["question"]) for r in rows]
    for i in range(n_scenes):
        s = scenes.make_sample("heldout", i, kind="attribute")
        out.append((f"scene {i}", Image.fromarray(s.image), s.question))
    return out


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double().softmax(-1) - b.double().softmax(-1)).abs().sum())


@torch.no_grad()
def one_input(loaded, image, question: str) -> dict:
    a = loaded.adapter
    inputs = a.prepare([image], [question])
    base = capture(loaded, None, "", pattern_layers=[], inputs=inputs)
    pos = int(base.answer_positions[0])
    top2 = base.logits[0, pos].topk(2).indices.tolist()
    edges = parse_edges("image->answer,image->text")
    result = knockout_sweep(loaded, inputs, image, question, edges, top2[0], top2[1], base=base)
    blank = Image.new("RGB", image.size, (128, 128, 128))
    blank_logits = a.next_token_logits(a.prepare([blank], [question]))[0]
    clean = base.logits[0, pos]
    out = {"layers": result.layers, "clean_same_as_blank": int(clean.argmax()) == int(blank_logits.argmax())}
    out["tv_clean_blank"] = total_variation(clean, blank_logits)
    for profile in result.profiles:
        every = profile.window(ALL_LAYERS)
        cuts = [(base.block_names.index(c.block), c.keys) for c in every.cut]
        knocked = edited_logits(loaded, inputs, knockout_edits(base, cuts, profile.target, None))[0, pos]
        out[profile.edge] = {
            "drops": profile.drops(result.layers),
            "reach": profile.rollout_reach,
            "correlation": profile.rollout_correlation,
            "same_as_blank": int(knocked.argmax()) == int(blank_logits.argmax()),
            "tv_knocked_blank": total_variation(knocked, blank_logits),
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenes", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = inputs_of(args.scenes)
    report = {"date": date.today().isoformat(), "torch": torch.__version__, "inputs": len(rows), "models": {}}
    for name in ("shapes-llava", "shapes-coca"):
        loaded = load_model(name)
        per = [{"input": label, **one_input(loaded, image, question)} for label, image, question in rows]
        layers = per[0]["layers"]
        summary = {
            "fingerprint": loaded.fingerprint,
            "layers": layers,
            "clean_same_as_blank": sum(r["clean_same_as_blank"] for r in per) / len(per),
            "mean_tv_clean_blank": statistics.fmean(r["tv_clean_blank"] for r in per),
        }
        print(f"## {name} ({loaded.fingerprint[:16]}), {len(per)} inputs")
        for edge in ("image->answer", "image->text"):
            rs = [r[edge] for r in per]
            correlations = [r["correlation"] for r in rs if r["correlation"] is not None]
            drops = [d for r in rs for d in r["drops"]]
            reach = [x for r in rs for x in r["reach"]]
            summary[edge] = s = {
                "mean_drop": [statistics.fmean(r["drops"][i] for r in rs) for i in range(len(layers))],
                "mean_reach": [statistics.fmean(r["reach"][i] for r in rs) for i in range(len(layers))],
                "mean_correlation": statistics.fmean(correlations) if correlations else None,
                "pooled_correlation": float(np.corrcoef(drops, reach)[0, 1]),
                "same_as_blank": sum(r["same_as_blank"] for r in rs) / len(rs),
                "mean_tv_knocked_blank": statistics.fmean(r["tv_knocked_blank"] for r in rs),
            }
            print(f"\n{edge}: per layer (window 1)\n")
            print("| layer | mean drop of the logit difference | mean rollout reach |")
            print("|---|---|---|")
            for i, layer in enumerate(layers):
                print(f"| {layer} | {s['mean_drop'][i]:+.3f} | {s['mean_reach'][i]:.3f} |")
            print(
                f"\ncorrelation of the two profiles (Pearson over layers; an approximation against an intervention): "
                f"mean per input {s['mean_correlation']:+.3f}, pooled {s['pooled_correlation']:+.3f}. "
                f"Cut in all layers: same top token as the blank image {s['same_as_blank']:.0%} "
                f"(clean run {summary['clean_same_as_blank']:.0%}); total variation to the blank run "
                f"{s['mean_tv_knocked_blank']:.3f} (clean run {summary['mean_tv_clean_blank']:.3f})"
            )
        report["models"][name] = {"summary": summary, "inputs": per}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
