"""Visual-feature patching bar (issue 4, "Done when" #2): patching the target
object's visual tokens from a scene where ONLY that object's colour differs
flips the answer to the new colour in >= 90% of colour questions.

    python bench/patching_bars.py [--n 200] [--threads 1] [--models shapes-llava shapes-coca]
                                  [--json bench/results/patching_bars.json]

For each default model, held-out ``color_of_shape`` questions (``make_sample("heldout",
i, kind="attribute")``, i = 0, 1, ... keeping that template) are paired with
``scenes.counterfactual_sample``: the same scene re-drawn with the target's
colour changed (new colour drawn from the other four with
``default_rng([7, i])``), every other pixel identical. The patched tokens are
the visual tokens whose patch box overlaps the target's ground-truth mask
(``core.forward.geometry.region_tokens`` with ``--min-cover``, default: any pixel).

Per site (LLaVA: vision_out, projector_out, the residual entering each block;
CoCa: kv_source read by every cross block, and by each cross block alone):

* ``flip_rate``: forward-patched argmax == the new colour, over all questions (the bar);
* ``flip_rate_model_correct``: the same over questions the model answers right
  on both images (it cannot be asked to flip where it does not read colour);
* ``reverse_restore_rate``: the counterfactual run patched with the original's
  tokens answers the original colour;
* ``control_flip_rate``: the same number of tokens drawn away from the target
  (no overlap with its mask), patched forward: the specificity control (compare
  with ``unpatched_new_colour_rate``, how often the unpatched original already
  answers the new colour);
* medians of the answer-minus-foil logit difference (answer = original colour,
  foil = new colour) and of the share of the original-to-counterfactual change the
  patch recovers.

The script is re-runnable (a retrained model is measured the same way); the
JSON records each model's fingerprint.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from core import load_model
from core.files.atomic import write_text_atomic
from core.forward.capture import capture, hooks
from core.forward.geometry import region_tokens
from core.methods.interventions import visual_patch_edit
from core.zoo import scenes

BAR = 0.9


def colour_questions(n: int, start: int = 0):
    """``n`` (sample, counterfactual, i) triples of the color_of_shape template."""
    out, i = [], start
    while len(out) < n:
        s = scenes.make_sample("heldout", i, kind="attribute")
        if s.template == "color_of_shape":
            rng = np.random.default_rng([7, i])
            others = [c for c in scenes.COLORS if c != s.answer]
            cf = scenes.counterfactual_sample(s, color=str(others[rng.integers(len(others))]))
            out.append((s, cf, i))
        i += 1
    return out


def sites_of(loaded) -> list[tuple[str, int | None]]:
    a = loaded.adapter
    if a.family == "coca":
        cross = [b for b, (_, kind) in enumerate(a.blocks) if kind == "cross"]
        return [("kv_source", None)] + [("kv_source", b) for b in cross]
    return [("vision_out", None), ("projector_out", None)] + [("resid", b) for b in range(a.n_layers)]


def site_name(loaded, site: str, layer: int | None) -> str:
    if layer is None:
        return site if site != "kv_source" else "kv_source (every cross block)"
    return f"{site}@{loaded.adapter.blocks[layer][0]}"


def run_with_features(loaded, inputs, sites):
    """One unedited capture and every site's visual features ``(n_visual, width)``."""
    store: dict = {}
    regs = []
    for site in {s for s, _ in sites if s in ("vision_out", "projector_out")}:
        regs += loaded.adapter.site_record_hooks(site, store)
    with hooks(regs):
        trace = capture(loaded, None, "", pattern_layers=[], inputs=inputs)
    feats = {}
    for site, layer in sites:
        if site in ("vision_out", "projector_out"):
            feats[(site, layer)] = store[site][0]
        elif site == "resid":
            feats[(site, layer)] = trace.resid_pre[layer][0, trace.visual_positions[0]]
        else:
            cross = layer if layer is not None else next(b for b, k in enumerate(trace.block_kinds) if k == "cross")
            feats[(site, layer)] = trace.kv_source[cross][0]
    return trace, feats


def readout(trace, answer_id: int, foil_id: int) -> tuple[int, float]:
    row = trace.logits[0, int(trace.answer_positions[0])].double()
    return int(row.argmax()), float(row[answer_id] - row[foil_id])


def measure(spec: str, n: int, min_cover: float, progress=True) -> dict:
    loaded = load_model(spec)
    a = loaded.adapter
    sites = sites_of(loaded)
    questions = colour_questions(n)
    per_site = {s: {"flip": [], "reverse": [], "control": [], "diff": [], "recovered": []} for s in sites}
    orig_ok, cf_ok, already_new, n_tokens, indices = [], [], [], [], []
    t0 = time.perf_counter()
    for q, (s, cf, i) in enumerate(questions):
        ans, foil = a.token_id(s.answer), a.token_id(cf.answer)
        a_in = a.prepare([s.image], [s.question])
        b_in = a.prepare([cf.image], [cf.question])
        a_tr, a_feats = run_with_features(loaded, a_in, sites)
        b_tr, b_feats = run_with_features(loaded, b_in, sites)
        a_pred, a_diff = readout(a_tr, ans, foil)
        b_pred, b_diff = readout(b_tr, ans, foil)
        orig_ok.append(a_pred == ans)
        cf_ok.append(b_pred == foil)
        already_new.append(a_pred == foil)  # the unpatched original already answers the new colour
        mask = s.objects[s.target].mask
        vt = a.visual_tokens((s.image.shape[1], s.image.shape[0]))
        tokens = region_tokens(vt, mask, min_cover)
        touching = set(region_tokens(vt, mask, 1e-9))
        away = [t for t in range(len(vt)) if t not in touching]
        rng = np.random.default_rng([11, i])
        control = sorted(int(t) for t in rng.choice(away, size=min(len(tokens), len(away)), replace=False))
        n_tokens.append(len(tokens))
        indices.append(i)
        for key in sites:
            site, layer = key
            fwd = capture(
                loaded, None, "", pattern_layers=[], inputs=a_in,
                edits=[visual_patch_edit(site, tokens, b_feats[key], a_tr, layer)],
            )  # fmt: skip
            rev = capture(
                loaded, None, "", pattern_layers=[], inputs=b_in,
                edits=[visual_patch_edit(site, tokens, a_feats[key], b_tr, layer)],
            )  # fmt: skip
            ctl = capture(
                loaded, None, "", pattern_layers=[], inputs=a_in,
                edits=[visual_patch_edit(site, control, b_feats[key], a_tr, layer)],
            )  # fmt: skip
            f_pred, f_diff = readout(fwd, ans, foil)
            r_pred, _ = readout(rev, ans, foil)
            c_pred, _ = readout(ctl, ans, foil)
            d = per_site[key]
            d["flip"].append(f_pred == foil)
            d["reverse"].append(r_pred == ans)
            d["control"].append(c_pred == foil)
            d["diff"].append(f_diff)
            d["recovered"].append((f_diff - a_diff) / (b_diff - a_diff) if b_diff != a_diff else float("nan"))
        per_site.setdefault("_base", {"a": [], "b": []})
        per_site["_base"]["a"].append(a_diff)
        per_site["_base"]["b"].append(b_diff)
        if progress and (q + 1) % 20 == 0:
            print(f"{spec}: {q + 1}/{n} questions, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    base = per_site.pop("_base")
    both = [x and y for x, y in zip(orig_ok, cf_ok)]
    rows = []
    for (site, layer), d in per_site.items():
        flips = np.array(d["flip"])
        rows.append(
            {
                "site": site,
                "layer": layer,
                "name": site_name(loaded, site, layer),
                "n": len(flips),
                "flip_rate": float(flips.mean()),
                "flip_rate_model_correct": float(flips[both].mean()) if any(both) else None,
                "n_model_correct": int(sum(both)),
                "reverse_restore_rate": float(np.mean(d["reverse"])),
                "control_flip_rate": float(np.mean(d["control"])),
                "median_logit_diff_patched": statistics.median(d["diff"]),
                "median_recovered_share": float(np.nanmedian(d["recovered"])),
                "meets_bar": bool(flips.mean() >= BAR),
                "failed_sample_indices": [i for i, f in zip(indices, d["flip"]) if not f][:50],
            }
        )
    best = max(rows, key=lambda r: r["flip_rate"])
    return {
        "spec": spec,
        "fingerprint": loaded.fingerprint,
        "n_questions": len(questions),
        "sample_indices": [indices[0], indices[-1]],
        "accuracy_original": float(np.mean(orig_ok)),
        "accuracy_counterfactual": float(np.mean(cf_ok)),
        "unpatched_new_colour_rate": float(np.mean(already_new)),
        "median_logit_diff_original": statistics.median(base["a"]),
        "median_logit_diff_counterfactual": statistics.median(base["b"]),
        "tokens_patched": {"mean": float(np.mean(n_tokens)), "min": int(min(n_tokens)), "max": int(max(n_tokens))},
        "sites": rows,
        "best_site": best["name"],
        "meets_bar": best["meets_bar"],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["shapes-llava", "shapes-coca"])
    p.add_argument("--n", type=int, default=200, help="colour questions per model")
    p.add_argument("--min-cover", type=float, default=1e-6, help="region_tokens min_cover (default: any overlap)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=Path("bench/results/patching_bars.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {
        "schema_version": 1,
        "bar": {
            "statement": "patching the target object's visual tokens from a scene where only its colour differs "
            "flips the answer to the new colour in >= 90% of colour questions (template color_of_shape)",
            "threshold": BAR,
            "metric": "flip_rate (all questions) at the best site",
        },
        "parameters": {"n": args.n, "min_cover": args.min_cover, "split": "heldout", "template": "color_of_shape"},
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": args.threads},
        "measured": time.strftime("%Y-%m-%d"),
        "models": [measure(spec, args.n, args.min_cover) for spec in args.models],
    }
    write_text_atomic(args.json, json.dumps(result, indent=2))
    for m in result["models"]:
        print(f"{m['spec']} ({m['fingerprint']}): n={m['n_questions']}, accuracy {m['accuracy_original']:.3f} / "
              f"{m['accuracy_counterfactual']:.3f} (original / counterfactual)")  # fmt: skip
        for r in m["sites"]:
            print(
                f"  {r['name']:32s} flip {r['flip_rate']:.3f}  (model right on both: {r['flip_rate_model_correct']}, "
                f"n={r['n_model_correct']})  reverse {r['reverse_restore_rate']:.3f}  control {r['control_flip_rate']:.3f}"
                f"  recovered {r['median_recovered_share']:.2f}"
            )


if __name__ == "__main__":
    main()
