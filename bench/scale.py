"""Capture and analyze against a plain forward as the sequence grows: time
ratios and peak memory growth, paired call by call in one process.

    python bench/scale.py [--tokens 600 2900 8000] [--threads 1] [--json bench/results/scale.json]
    python bench/scale.py --device cuda --dtype bfloat16 --preset llava-7b --tokens 600 2900   # bench/gpu_scale.sh

Model: a random LLaVA built from a config (no download). The CPU preset
``llava-1024`` is LLaVA-1.5's language model scaled to fit this machine
(Llama, d_model 1024, 8 layers of 16 heads of 64, SwiGLU 2816, vocabulary
32000) behind a small CLIP tower; ``llava-7b`` is
LLaVA-1.5-7B's shape (d_model 4096, 32 layers of 32 heads, SwiGLU 11008,
CLIP ViT-L/14). The number of visual tokens follows the image side (14 px
patches): 24^2 = 576 at 336 px (588 tokens with the prompt), 54^2 = 2,916 at
756 px, 89^2 = 7,921 at 1,246 px.

Each round runs, back to back and in the same order, a plain forward
(``model(**inputs)``, the model's own sdpa attention, no hook), the default
capture (the answer row of every block's pattern, every z, MLP output and
residual), ``core.analyze.analyze`` (every read-out, rollout included up to
FULL_PATTERN_LIMIT tokens) and, where it fits, an eager capture (the
reference the sdpa path replaces). Ratios are medians over rounds of each
call's time over its own round's forward. Memory: the peak resident set
growth of each call above the resident set before it (Linux VmHWM, reset by
``/proc/self/clear_refs`` before every call; glibc's mmap threshold pinned so
freed tensors leave the resident set), or on CUDA the peak allocated memory
above the allocated memory before the call. The fit: peak growth against T,
least squares, per call.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Freed tensors must leave the resident set for peak growth to mean anything:
# pin glibc's mmap threshold (it otherwise grows to 32 MB and keeps big blocks on the heap).
if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and __name__ == "__main__":
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import numpy as np
import torch
from PIL import Image

from core.analyze import analyze
from core.capture import capture
from core.models.loading import LoadedModel

PRESETS = {
    # name: language model, vision tower
    "llava-1024": (
        {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16},
        {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4},
    ),
    "llava-7b": (
        {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32},
        {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16},
    ),
    "tiny": (  # the smoke run's (tests/bench)
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
        {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
    ),
}
PATCH = 14
QUESTION = "what color is the circle ?"


def image_side(tokens: int) -> int:
    """The image side (pixels) whose patch grid gives about ``tokens`` visual tokens."""
    return max(1, round((max(tokens - 12, 1)) ** 0.5)) * PATCH


def random_llava(preset: str, side: int, layers: int | None, dtype: torch.dtype, device: str) -> LoadedModel:
    """A random LLaVA of ``preset``'s shape reading ``side`` px images (``layers``: the language model's depth)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    from core.models.families.llava import LlavaAdapter

    words = ["<unk>", "<s>", "</s>", "<pad>", "<image>", *QUESTION.split(), "user", "assistant", ":"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    lm, vision = PRESETS[preset]
    lm = {**lm, **({"num_hidden_layers": layers} if layers else {})}
    grid = side // PATCH
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**vision, image_size=side, patch_size=PATCH),
        text_config=LlamaConfig(**lm, vocab_size=32000, max_position_embeddings=16384),
        image_token_id=vocab["<image>"],
        image_seq_length=grid * grid,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # built where it runs: a 7B model is initialised on the GPU
            model = LlavaForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(default)
    ip = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    processor = LlavaProcessor(
        image_processor=ip,
        tokenizer=fast,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    return LoadedModel(f"random-{preset}", "llava", model, processor, fast, LlavaAdapter(model, processor, fast))


class Memory:
    """Peak memory growth of one call: resident set on the CPU, allocated memory on CUDA."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def _rss(self, field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {field}")

    def measure(self, fn) -> tuple[float, int]:
        """``(seconds, peak bytes above the start)`` of ``fn()``; its result is dropped after the peak is read."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            start = self._rss("VmRSS")
        t = time.perf_counter()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated() if self.cuda else self._rss("VmHWM")
        del out
        return seconds, peak - start


@torch.no_grad()
def bench_case(loaded: LoadedModel, image, rounds: int, memory: Memory, eager: bool) -> dict:
    inputs = loaded.adapter.prepare([image], [QUESTION])
    calls = {
        "forward": lambda: loaded.model(**inputs.tensors, use_cache=False),
        "capture": lambda: capture(loaded, None, "", inputs=inputs),
        "analyze": lambda: analyze(loaded, image, QUESTION),
    }
    if eager:
        calls["capture_eager"] = lambda: capture(loaded, None, "", inputs=inputs, attention="eager")
    for fn in calls.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in calls}
    peaks: dict[str, list[int]] = {k: [] for k in calls}
    for _ in range(rounds):
        for k, fn in calls.items():
            seconds, peak = memory.measure(fn)
            times[k].append(seconds)
            peaks[k].append(peak)
    ratios = {k: statistics.median(t / f for t, f in zip(times[k], times["forward"])) for k in calls if k != "forward"}
    mb = {k: statistics.median(v) / 2**20 for k, v in peaks.items()}
    a = loaded.adapter
    return {
        "tokens": int(inputs.input_ids.shape[1]),
        "visual_tokens": int(a.visual_positions(inputs).shape[1]),
        "layers": a.n_layers,
        "heads": a.n_heads,
        "d_model": a.d_model,
        "rounds": rounds,
        "forward_s": round(statistics.median(times["forward"]), 4),
        **{f"{k}_over_forward": round(v, 3) for k, v in ratios.items()},
        **{f"{k}_peak_growth_mb": round(v, 1) for k, v in mb.items()},
        **{f"{k}_above_forward_mb": round(mb[k] - mb["forward"], 1) for k in calls if k != "forward"},
    }


def line_fit(rows: list[dict], key: str) -> dict | None:
    """Least-squares ``peak = intercept + slope * T`` over the rows with the same depth (MB, MB per 1,000 tokens)."""
    pts = [(r["tokens"], r[key]) for r in rows if key in r]
    if len(pts) < 2:
        return None
    t, m = np.array(pts, dtype=float).T
    slope, intercept = np.polyfit(t, m, 1)
    residual = m - (intercept + slope * t)
    return {
        "mb_per_1000_tokens": round(float(slope * 1000), 2),
        "intercept_mb": round(float(intercept), 1),
        "max_residual_mb": round(float(np.abs(residual).max()), 1),
    }


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[600, 2900, 8000], help="sequence lengths (about)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="llava-1024")
    p.add_argument("--layers", type=int, nargs="+", default=None, help="the depth per length (default: the preset's)")
    p.add_argument("--rounds", type=int, nargs="+", default=None, help="rounds per length (default 9, 3, 1, ...)")
    p.add_argument("--eager-up-to", type=int, default=3000, help="also time an eager capture up to this length")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    default_rounds = [9, 3, 1]
    memory = Memory(args.device)
    rows = []
    rng = np.random.default_rng(0)
    for i, tokens in enumerate(args.tokens):
        side = image_side(tokens)
        layers = args.layers[min(i, len(args.layers) - 1)] if args.layers else None
        rounds = args.rounds[min(i, len(args.rounds) - 1)] if args.rounds else default_rounds[min(i, 2)]
        loaded = random_llava(args.preset, side, layers, dtype, args.device)
        image = Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8))
        row = bench_case(loaded, image, rounds, memory, eager=tokens <= args.eager_up_to)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del loaded
        gc.collect()
    unit = "peak CUDA MB" if memory.cuda else "peak RSS MB"
    print(
        f"\n| tokens | layers | forward s | capture / forward | analyze / forward | eager capture / forward | "
        f"forward {unit} | capture above forward MB | analyze above forward MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['layers']} | {r['forward_s']} | {r['capture_over_forward']} | "
            f"{r['analyze_over_forward']} | {r.get('capture_eager_over_forward', '-')} | "
            f"{r['forward_peak_growth_mb']} | {r['capture_above_forward_mb']} | {r['analyze_above_forward_mb']} |"
        )
    fits = {}
    for depth in sorted({r["layers"] for r in rows}):
        same = [r for r in rows if r["layers"] == depth]
        fits[str(depth)] = {k: line_fit(same, f"{k}_peak_growth_mb") for k in ("forward", "capture", "analyze")}
    print("\nline fit of peak growth against T (per depth):", json.dumps(fits))
    if args.json:
        out = {
            "commit": commit(),
            "machine": platform.machine(),
            "device": torch.cuda.get_device_name() if memory.cuda else "cpu",
            "torch": torch.__version__,
            "threads": args.threads,
            "dtype": args.dtype,
            "preset": args.preset,
            "rows": rows,
            "fits": fits,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=2) + "\n")
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
