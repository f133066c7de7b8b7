"""A real-size model on this machine: a LLaVA-1.5-7B-shaped random model saved
in bfloat16, loaded with ``--dtype bfloat16`` and read out with ``analyze`` at
588 tokens; float32 refused for it in one line (issue 25).

    python bench/real_size.py [--preset llava-1.5-7b] [--folder /tmp/llava-1.5-7b-shaped] \\
        [--json bench/results/real_size.json] [--keep]

Model: bench/scale.py's ``random_llava`` of the ``llava-7b`` shape, built from
a config (no download): Llama d_model 4096 x 32 layers of 32 heads, SwiGLU
11008, vocabulary 32000, behind CLIP ViT-L/14 at 336 px (576 visual tokens)
and LLaVA-1.5's two-layer GELU projector, initialised at random in bfloat16
and saved with ``save_pretrained`` (safetensors shards, ~14 GB) with its
word-level tokenizer and CLIP's image processor, as a user's folder is. The folder is deleted after unless ``--keep``.

Each step runs in a fresh process (nothing one leaves in memory reaches the next):

1. ``refuse``: ``vlm-readout analyze --dtype float32`` on the folder: the exit
   status, the one stderr line, and how long the refusal took (it must come
   before any weight is read).
2. ``cli``: ``vlm-readout analyze --dtype bfloat16 --json ...`` end to end: wall
   time and the peak resident set of the command's process (``ru_maxrss`` of
   the child), the bar being under 18 GB.
3. ``paired``: in one process, ``core.load_model(folder, dtype="bfloat16")``
   (load time, resident set after the load against the weights' bytes), then
   rounds of a plain forward (``model(**inputs)``, the model's own sdpa), then
   ``core.analyze.analyze`` on the same image and question, then a forward
   again (F A F ...): analyze's time over the mean of the two forwards beside it.
   The process's peak resident set (VmHWM) covers the load and every call.

``--preset tiny`` runs the same steps on a small model in seconds (the smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scale import QUESTION  # bench/scale.py (the script's folder is on sys.path); 588 tokens with 576 visual

ROOT = Path(__file__).resolve().parents[1]

PRESETS = {"llava-1.5-7b": "llava-7b", "tiny": "tiny"}  # bench/scale.py's shapes of the same names
SIDE = 336  # CLIP ViT-L/14-336: 24 x 24 = 576 visual tokens
GB = 1e9


def build(preset: str, folder: Path) -> dict:
    """Build the random model in bfloat16 (bench/scale.py's ``random_llava``) and save it as a user's folder."""
    import torch
    from scale import random_llava

    t = time.perf_counter()
    loaded = random_llava(PRESETS[preset], SIDE, None, torch.bfloat16, "cpu")
    built = time.perf_counter() - t
    model = loaded.model
    model.config.architectures = ["LlavaForConditionalGeneration"]
    folder.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    model.save_pretrained(folder, max_shard_size="2GB")
    loaded.processor.save_pretrained(folder)
    saved = time.perf_counter() - t
    n_params = sum(p.numel() for p in model.parameters())
    on_disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return {"parameters": n_params, "safetensors_bytes": on_disk, "build_s": round(built, 1), "save_s": round(saved, 1)}


def noise_image(path: Path, side: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(path)


def cli(args: list[str]) -> dict:
    """Run ``vlm-readout ARGS`` in a child process: exit status, stderr, wall time, the child's peak RSS."""
    exe = Path(sys.executable).with_name("vlm-readout")
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    done = subprocess.run([str(exe), *args], capture_output=True, text=True)
    seconds = time.perf_counter() - t
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {
        "exit_status": done.returncode,
        # the lines a user reads as the command's verdict (the progress bar's are left out)
        "stderr": "\n".join(line for line in done.stderr.splitlines() if line.startswith(("error:", "warning:"))),
        "stdout": done.stdout.strip()[-500:],
        "wall_s": round(seconds, 1),
        # ru_maxrss of the children is the largest of any child so far: each step runs in its own bench process
        "peak_rss_gb": round(peak_kib * 1024 / GB, 2) if peak_kib > before else None,
    }


def vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def paired(folder: Path, image: Path, rounds: int) -> dict:
    """Load, then F A F ... in this process (see the module docstring)."""
    import torch

    from core import load_model
    from core.analyze import analyze
    from core.files.images import load_image

    base = vm("VmRSS")
    t = time.perf_counter()
    loaded = load_model(folder, dtype="bfloat16")
    load_s = time.perf_counter() - t
    after_load = vm("VmRSS")
    load_peak = vm("VmHWM")
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    img = load_image(image)
    inputs = loaded.adapter.prepare([img], [QUESTION])

    @torch.no_grad()
    def forward():
        return loaded.model(**inputs.tensors, use_cache=False)

    def timed(fn) -> float:
        t = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t
        del out
        return seconds

    forward()  # warm-up: first-touch of the weights' pages and the kernels' set-up
    before = timed(forward)
    forwards, ratios, analyze_s = [before], [], []
    result = None
    for _ in range(rounds):
        t = time.perf_counter()
        result = analyze(loaded, img, QUESTION)
        a = time.perf_counter() - t
        after = timed(forward)
        forwards.append(after)
        analyze_s.append(a)
        ratios.append(a / ((before + after) / 2))
        before = after
    d = result.to_dict()
    return {
        "dtype": d["model"]["dtype"],
        "device": d["model"]["device"],
        "tokens": len(d["input"]["input_ids"]),
        "visual_tokens": len(d["input"]["visual_tokens"]),
        "weights_gb": round(weights / GB, 2),
        "load_s": round(load_s, 1),
        "rss_after_load_gb": round((after_load - base) / GB, 2),
        "load_peak_rss_gb": round(load_peak / GB, 2),
        "forward_s": round(statistics.median(forwards), 2),
        "analyze_s": round(statistics.median(analyze_s), 2),
        "analyze_over_forward": round(statistics.median(ratios), 3),
        "analyze_over_forward_rounds": [round(r, 3) for r in ratios],
        "peak_rss_gb": round(vm("VmHWM") / GB, 2),
        "reconstruction": {k: v for k, v in d["residual_decomposition"].items() if k.startswith("reconstruction")},
        "answer": d["target"]["predicted"],
    }


def step(name: str, *argv: str) -> dict:
    """One step in a fresh Python process; its JSON result."""
    done = subprocess.run([sys.executable, __file__, "--step", name, *argv], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"step {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    except OSError:
        return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="llava-1.5-7b")
    p.add_argument("--folder", default=None, help="where the model is saved (default /tmp/<preset>-shaped)")
    p.add_argument("--rounds", type=int, default=1, help="analyze rounds, each between two forwards")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--keep", action="store_true", help="keep the model folder")
    p.add_argument("--step", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    folder = Path(args.folder or f"/tmp/{args.preset}-shaped")
    image = folder.with_name(folder.name + "-image.png")
    if args.step == "build":
        print(json.dumps(build(args.preset, folder)))
        return
    if args.step == "paired":
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(paired(folder, image, args.rounds)))
        return

    out: dict = {
        "commit": commit(),
        "preset": args.preset,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
    }
    try:
        import torch

        out["torch"] = torch.__version__
        out["memory_available_gb"] = round(
            int(next(line for line in open("/proc/meminfo") if line.startswith("MemAvailable")).split()[1]) * 1024 / GB,
            2,
        )
        if not (folder / "config.json").is_file():
            out["build"] = step("build", "--preset", args.preset, "--folder", str(folder))
            print("built:", json.dumps(out["build"]), flush=True)
        noise_image(image, SIDE)
        analyze_args = ["analyze", "--model", str(folder), "--image", str(image), "--question", QUESTION]
        refuse = cli([*analyze_args, "--dtype", "float32", "--json", str(folder.with_name("refused.json"))])
        out["float32_refusal"] = {k: refuse[k] for k in ("exit_status", "stderr", "wall_s")}
        print("float32:", json.dumps(out["float32_refusal"]), flush=True)
        env_threads = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        os.environ.update(env_threads)
        readout = folder.with_name(folder.name + "-readout.json")
        run = cli([*analyze_args, "--dtype", "bfloat16", "--json", str(readout)])
        out["cli_bfloat16"] = {k: run[k] for k in ("exit_status", "stderr", "stdout", "wall_s", "peak_rss_gb")}
        print("cli bfloat16:", json.dumps(out["cli_bfloat16"]), flush=True)
        out["paired"] = step(
            "paired", "--folder", str(folder), "--rounds", str(args.rounds), "--threads", str(args.threads)
        )
        print("paired:", json.dumps(out["paired"]), flush=True)
        out["bar_peak_rss_gb"] = 18.0
        out["under_bar"] = max(out["paired"]["peak_rss_gb"], out["cli_bfloat16"]["peak_rss_gb"] or 0) < 18.0
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
        for f in (image, folder.with_name(folder.name + "-readout.json"), folder.with_name("refused.json")):
            f.unlink(missing_ok=True)
    if args.json:
        from core.files.atomic import write_text_atomic

        write_text_atomic(args.json, json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
