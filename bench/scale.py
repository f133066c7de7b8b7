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

Each length runs in its own process (a length's allocator state and memory
never carry into the next), in two phases. Timing: rounds of the default
capture (the answer row of every block's pattern, every z, MLP output and
residual), ``core.analyze.analyze`` (every read-out, rollout included up to
FULL_PATTERN_LIMIT tokens) and, where it fits, an eager capture (the reference
the sdpa path replaces), each between two plain forwards (``model(**inputs)``,
the model's own sdpa attention, no hook): F C F A F E F. A call's ratio is its
time over the mean of its two forwards; the table gives medians over rounds.
Timing runs with glibc keeping what the process frees (no mmap for large
blocks, no trimming: a long-running app's steady state, which the warm-up
reaches), so no call is billed for pages the system hands back: on this
machine (a nested VM with free page reporting) memory freed for more than a
moment goes back to the host and costs 14-80 us per 4 KiB page to touch
again (bench/page_cost.py), against about 2 us for a warm page, which made a capture's time track how
much it keeps rather than what it computes (see bench/README.md). Memory:
then, glibc's mmap and trim thresholds pinned at 128 KiB (a freed tensor
leaves the resident set rather than staying on the heap) and ``malloc_trim(0)``
before every call, the peak resident set growth of each call above the
resident set before it (Linux VmHWM, reset by ``/proc/self/clear_refs``); on
CUDA the peak allocated memory above the allocated memory before the call.
The fit: peak growth against T, least squares, per depth.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import multiprocessing
import platform
import statistics
import subprocess
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from core.analyze import analyze
from core.files.atomic import write_text_atomic
from core.forward.capture import capture
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
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's mallopt options
QUESTION = "what color is the big circle in the picture ?"  # 588 tokens with 576 visual ones


def image_side(tokens: int) -> int:
    """The image side (pixels) whose patch grid gives about ``tokens`` visual tokens."""
    return max(1, round((max(tokens - 12, 1)) ** 0.5)) * PATCH


def random_llava(
    preset: str, side: int, layers: int | None, dtype: torch.dtype, device: str, heads: int | None = None
) -> LoadedModel:
    """A random LLaVA of ``preset``'s shape reading ``side`` px images (``layers``: the language
    model's depth; ``heads``: its heads, as many key / value heads, d_head following)."""
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
    if heads:
        lm.update(num_attention_heads=heads, num_key_value_heads=heads)
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
    """Seconds and peak memory growth of one call: resident set on the CPU, allocated memory on CUDA."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self._libc = None if self.cuda else ctypes.CDLL("libc.so.6")
        self._pinned = False
        if self._libc is not None:  # timing first: freed memory stays with the process (see the module docstring)
            self._mallopt(M_MMAP_MAX, 0)
            self._mallopt(M_TRIM_THRESHOLD, 2**31 - 1)

    def _mallopt(self, option: int, value: int) -> None:
        if not self._libc.mallopt(option, value):
            raise RuntimeError(f"mallopt({option}, {value}) failed")

    def _rss(self, field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {field}")

    def _settle(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
        elif self._pinned:
            self._libc.malloc_trim(0)  # free heap pages returned: the start is what is live

    def pin(self) -> None:
        """From now on a freed tensor leaves the resident set (CPU; see the module docstring)."""
        if self._libc is not None:
            self._mallopt(M_MMAP_MAX, 65536)  # glibc's default
            self._mallopt(M_MMAP_THRESHOLD, 128 * 1024)
            self._mallopt(M_TRIM_THRESHOLD, 128 * 1024)
            self._pinned = True

    def seconds(self, fn) -> float:
        self._settle()
        t = time.perf_counter()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        del out
        return seconds

    def peak(self, fn) -> int:
        """Peak bytes above the start during ``fn()``; its result is dropped after the peak is read."""
        self._settle()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            start = self._rss("VmRSS")
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() if self.cuda else self._rss("VmHWM")
        del out
        return peak - start


@torch.no_grad()
def bench_case(
    loaded: LoadedModel, image, rounds: int, memory_rounds: int, memory: Memory, eager: bool, warm_up: bool
) -> dict:
    inputs = loaded.adapter.prepare([image], [QUESTION])
    forward = lambda: loaded.model(**inputs.tensors, use_cache=False)  # noqa: E731
    calls = {
        "capture": lambda: capture(loaded, None, "", inputs=inputs),
        "analyze": lambda: analyze(loaded, image, QUESTION),
    }
    if eager:
        calls["capture_eager"] = lambda: capture(loaded, None, "", inputs=inputs, attention="eager")
    for fn in (forward, *calls.values()) if warm_up else (forward,):  # warm-up
        fn()
    # Each call between two forwards (F C F A F E F): its ratio is over the mean of the two.
    forwards: list[float] = []
    ratios: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):
        before = memory.seconds(forward)
        forwards.append(before)
        for k, fn in calls.items():
            seconds = memory.seconds(fn)
            after = memory.seconds(forward)
            forwards.append(after)
            ratios[k].append(seconds / ((before + after) / 2))
            before = after
    memory.pin()
    peaks: dict[str, list[int]] = {k: [] for k in ("forward", *calls)}
    for _ in range(memory_rounds):
        for k, fn in (("forward", forward), *calls.items()):
            peaks[k].append(memory.peak(fn))
    mb = {k: statistics.median(v) / 2**20 for k, v in peaks.items()}
    a = loaded.adapter
    return {
        "device": torch.cuda.get_device_name() if memory.cuda else "cpu",
        "tokens": int(inputs.input_ids.shape[1]),
        "visual_tokens": int(a.visual_positions(inputs).shape[1]),
        "layers": a.n_layers,
        "heads": a.n_heads,
        "d_model": a.d_model,
        "rounds": rounds,
        # how the heap stood between timed calls: "kept" (this protocol) or "trimmed" (rows of commit 5a1becc)
        "timing_heap": "cuda" if memory.cuda else "kept",
        "memory_rounds": memory_rounds,
        "forward_s": round(statistics.median(forwards), 4),
        **{f"{k}_over_forward": round(statistics.median(v), 3) for k, v in ratios.items()},
        **{f"{k}_over_forward_rounds": [round(r, 3) for r in v] for k, v in ratios.items()},
        **{f"{k}_peak_growth_mb": round(v, 1) for k, v in mb.items()},
        **{f"{k}_above_forward_mb": round(mb[k] - mb["forward"], 1) for k in calls},
    }


def run_case(preset, tokens, layers, rounds, memory_rounds, dtype_name, device, threads, eager, warm_up, seed) -> dict:
    """One length, in the calling process (``main`` runs each in a fresh one)."""
    torch.set_num_threads(threads)
    memory = Memory(device)  # first: the allocator's options hold for the model's weights too
    side = image_side(tokens)
    loaded = random_llava(preset, side, layers, getattr(torch, dtype_name), device)
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8))
    return {"commit": commit(), **bench_case(loaded, image, rounds, memory_rounds, memory, eager, warm_up)}


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
    p.add_argument("--rounds", type=int, nargs="+", default=None, help="timing rounds per length (default 9, 3, 1)")
    p.add_argument("--memory-rounds", type=int, nargs="+", default=[2, 1], help="memory rounds per length")
    p.add_argument("--eager-up-to", type=int, default=3000, help="also time an eager capture up to this length")
    p.add_argument(
        "--warm-up-to", type=int, default=3000, help="warm every call up to this length (beyond: the forward only)"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--json", default=None, help="write here, keeping its rows of other lengths (same setup)")
    args = p.parse_args()
    default_rounds = [9, 3, 1]
    rows = []
    spawn = multiprocessing.get_context("spawn")
    for i, tokens in enumerate(args.tokens):
        layers = args.layers[min(i, len(args.layers) - 1)] if args.layers else None
        rounds = args.rounds[min(i, len(args.rounds) - 1)] if args.rounds else default_rounds[min(i, 2)]
        memory_rounds = args.memory_rounds[min(i, len(args.memory_rounds) - 1)]
        case = (args.preset, tokens, layers, rounds, memory_rounds, args.dtype, args.device, args.threads)
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:  # a fresh process per length
            row = pool.submit(run_case, *case, tokens <= args.eager_up_to, tokens <= args.warm_up_to, i).result()
        rows.append(row)
        print(json.dumps(row), flush=True)
    setup = {
        "machine": platform.machine(),
        "device": rows[0]["device"] if rows else args.device,
        "torch": torch.__version__,
        "threads": args.threads,
        "dtype": args.dtype,
        "preset": args.preset,
    }
    if args.json and Path(args.json).is_file():  # keep the file's other lengths when they were measured alike
        old = json.loads(Path(args.json).read_text())
        if all(old.get(k) == v for k, v in setup.items()):
            measured = {r["tokens"] for r in rows}
            rows = sorted([r for r in old["rows"] if r["tokens"] not in measured] + rows, key=lambda r: r["tokens"])
    unit = "peak CUDA MB" if args.device.startswith("cuda") else "peak RSS MB"
    print(
        f"\n| tokens | commit | layers | forward s | capture / forward | analyze / forward | eager capture / forward | "
        f"forward {unit} | capture above forward MB | analyze above forward MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r.get('commit', '')} | {r['layers']} | {r['forward_s']} | {r['capture_over_forward']} | "
            f"{r['analyze_over_forward']} | {r.get('capture_eager_over_forward', '-')} | "
            f"{r['forward_peak_growth_mb']} | {r['capture_above_forward_mb']} | {r['analyze_above_forward_mb']} |"
        )
    fits = {}
    for depth in sorted({r["layers"] for r in rows}):
        same = [r for r in rows if r["layers"] == depth]
        fits[str(depth)] = {k: line_fit(same, f"{k}_peak_growth_mb") for k in ("forward", "capture", "analyze")}
    print("\nline fit of peak growth against T (per depth):", json.dumps(fits))
    if args.json:
        out = {**setup, "rows": rows, "fits": fits}
        write_text_atomic(args.json, json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
