"""How well attribution patching's linear estimate agrees with actual patching, over
every head x position of the default models.

    python bench/attribution_agreement.py [--pairs 6] [--json bench/results/attribution_agreement.json]

For each model and each clean / source pair (bundled sample i against sample
i + 1, asked sample i's question; pairs whose answers are the same token are
skipped), every head's output at every position is patched for real (batched,
the patching grid's edits) and set against its attribution-patching estimate
(``core.methods.flow.attribution``), both normalised (0 = clean, 1 = source).
Reported: Spearman's rank correlation over all heads x positions the source
changes (a component 0 both ways, before the first position that differs, is
left out), over the top-20 estimates (what the command checks), and the sign
agreement of the top 20.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from datetime import date
from pathlib import Path

import torch

from core import load_model
from core.errors import InterventionError
from core.files.images import load_image
from core.forward.capture import edited_logits
from core.methods.flow.attribution import attribution_patching, spearman
from core.methods.flow.patch_grid import paired_runs
from core.methods.interventions import activation_patch
from core.models.loading import resources_dir


@torch.no_grad()
def actual_heads(loaded, image, source, question, tokens, batch_size=16) -> dict:
    """``{(block, head, position): normalised actual}`` of every head output patch."""
    a = loaded.adapter
    pair = paired_runs(loaded, image, source, question, *tokens)
    pos = pair.position
    keys = [
        (b, h, p)
        for b in range(pair.clean_trace.n_blocks)
        for h in range(pair.clean_trace.z[b].shape[2])
        for p in range(pos + 1)
    ]
    out = {}
    for start in range(0, len(keys), batch_size):
        chunk = keys[start : start + batch_size]
        batch = a.prepare([image] * len(chunk), [question] * len(chunk))
        edits = [
            dataclasses.replace(activation_patch(pair.source_trace, "z", b, h, [p]), rows=(row,))
            for row, (b, h, p) in enumerate(chunk)
        ]
        logits = edited_logits(loaded, batch, edits)[:, pos].double()
        for row, key in enumerate(chunk):
            ld = float(logits[row, tokens[0]] - logits[row, tokens[1]])
            out[key] = (ld - pair.clean.logit_diff) / pair.span
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(x) for x in (resources_dir() / "samples" / "pairs.jsonl").read_text().splitlines()]
    report = {"date": date.today().isoformat(), "torch": torch.__version__, "models": {}}
    print(
        "| model | pairs | heads x positions the source changes (mean per pair) | rank correlation, all (mean) | rank correlation, top 20 "
        "(mean) | signs agree, top 20 (mean) |"
    )
    print("|---|---|---|---|---|---|")
    for name in ("shapes-llava", "shapes-coca"):
        loaded = load_model(name)
        per = []
        for i in range(len(rows)):
            if len(per) == args.pairs:
                break
            r, s = rows[i], rows[(i + 1) % len(rows)]
            image, source = (
                load_image(resources_dir() / "samples" / r["image"]),
                load_image(resources_dir() / "samples" / s["image"]),
            )
            try:
                result = attribution_patching(loaded, image, source, r["question"], top_k=20)
            except InterventionError:  # the same answer on both images: no foil to read
                continue
            tokens = (result.clean.answer_id, result.clean.foil_id)
            actual = actual_heads(loaded, image, source, r["question"], tokens)
            estimates = {
                (b, h, p): v
                for b, block in enumerate(result.head_estimates)
                for h, row in enumerate(block)
                for p, v in enumerate(row)
            }
            # components the source does not change (positions before the first that differs) are 0 both
            # ways: left out, or their ties would lift the correlation
            keys = [k for k in sorted(actual) if actual[k] != 0 or estimates[k] != 0]
            top = [c for c in result.checked][:20]
            per.append(
                {
                    "pair": f"sample {r['index']} <- sample {s['index']}",
                    "components": len(keys),
                    "rank_all": spearman([estimates[k] for k in keys], [actual[k] for k in keys]),
                    "rank_top": result.rank_correlation,
                    "signs_top": result.sign_agreement,
                    "checked_sites": [c.site for c in top],
                }
            )
        summary = {
            "fingerprint": loaded.fingerprint,
            "pairs": len(per),
            "rank_all": statistics.fmean(x["rank_all"] for x in per),
            "rank_top": statistics.fmean(x["rank_top"] for x in per),
            "signs_top": statistics.fmean(x["signs_top"] for x in per),
        }
        report["models"][name] = {"summary": summary, "pairs": per}
        print(
            f"| {name} ({loaded.fingerprint[:16]}) | {len(per)} | {statistics.fmean(x['components'] for x in per):.0f} | "
            f"{summary['rank_all']:+.3f} | {summary['rank_top']:+.3f} | {summary['signs_top']:.0%} |"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
