"""Generation throughput: greedy decoding with the key / value cache against
re-running the whole prefix at every step, measured side by side (interleaved)
in one run on the LLaVA-1.5-shaped random model.

    python bench/generation.py [--threads 2] [--tokens 32] [--repeats 3] [--json bench/results/generation.json]

Model: bench/capture_cost.py's random LLaVA (language model d_model 1024, 8
layers, 8 heads of 128, SwiGLU 2816, vocabulary 32000; 576 visual tokens from
a 336 px image in 14 px patches; a small CLIP tower). Both paths generate
exactly ``--tokens`` tokens (the random model's end tokens are switched off),
through ``core.generate.generate`` (``use_cache=True`` / ``False``); the
prefill (one forward of the prompt) is timed beside them. tokens/s is
tokens / wall time of the whole call (prefill included); the decode rate
leaves the prefill out: ``(tokens - 1) / (cached time - prefill time)``.
Each repeat also checks that both paths gave the same tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import numpy as np
import torch
from capture_cost import big_llava  # bench/ is on sys.path (the script's folder)
from PIL import Image
from timing import interleaved_times

from core.generate import generate

QUESTION = "what color is the circle ?"


@torch.no_grad()
def bench(n_tokens: int, repeats: int) -> dict:
    loaded = big_llava()
    a = loaded.adapter
    a.end_token_ids = lambda: set()  # a random model's EOS comes at chance: generate every token
    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 255, (336, 336, 3), dtype=np.uint8))
    inputs = a.prepare([photo], [QUESTION])
    runs: dict[str, list] = {"cached": [], "rerun": []}

    def cached():
        runs["cached"].append(generate(loaded, photo, QUESTION, max_new_tokens=n_tokens))

    def rerun():
        runs["rerun"].append(generate(loaded, photo, QUESTION, max_new_tokens=n_tokens, use_cache=False))

    times = interleaved_times({"prefill": lambda: a.start_decoding(inputs), "cached": cached, "rerun": rerun}, repeats)
    t = {k: statistics.median(v) for k, v in times.items()}
    fast, slow = runs["cached"][-1], runs["rerun"][-1]
    assert all(len(g.token_ids) == n_tokens for g in runs["cached"] + runs["rerun"])
    same = all(f.token_ids == s.token_ids for f, s in zip(runs["cached"], runs["rerun"]))
    return {
        "model": loaded.spec,
        "prompt_length": fast.prompt_length,
        "visual_tokens": int(a.visual_positions(inputs).shape[1]),
        "d_model": a.d_model,
        "layers": a.n_layers,
        "tokens": n_tokens,
        "repeats": repeats,
        "prefill_s": round(t["prefill"], 3),
        "cached_s": round(t["cached"], 3),
        "rerun_s": round(t["rerun"], 3),
        "cached_tokens_per_s": round(n_tokens / t["cached"], 2),
        "rerun_tokens_per_s": round(n_tokens / t["rerun"], 3),
        "cached_over_rerun_throughput": round(t["rerun"] / t["cached"], 2),
        "cached_decode_tokens_per_s": round((n_tokens - 1) / (t["cached"] - t["prefill"]), 2),
        "same_tokens": same,
        "max_prob_difference": max(abs(p - q) for p, q in zip(fast.probs, slow.probs)),
        "cache": [fast.cache, slow.cache],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    r = bench(args.tokens, args.repeats)
    print(
        "| model | prompt tokens | new tokens | prefill s | cached s | re-run s | cached tok/s | re-run tok/s | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {r['model']} | {r['prompt_length']} | {r['tokens']} | {r['prefill_s']} | {r['cached_s']} | {r['rerun_s']} | "
        f"{r['cached_tokens_per_s']} | {r['rerun_tokens_per_s']} | {r['cached_over_rerun_throughput']} |"
    )
    print(
        f"decode only (prefill left out): {r['cached_decode_tokens_per_s']} tok/s; same tokens: {r['same_tokens']}; "
        f"largest probability difference {r['max_prob_difference']:.2e}"
    )
    if args.json:
        out = {"machine": platform.machine(), "torch": torch.__version__, "threads": args.threads, "row": r}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
