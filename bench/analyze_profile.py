"""Where a capture and an analyze spend their time beyond the forward
(cProfile, cumulative seconds per call), on bench/scale.py's random LLaVA.
bench/README.md, the scale section's last paragraph.

    python bench/analyze_profile.py [--tokens 600] [--repeats 2]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import numpy as np
import torch
from PIL import Image
from scale import QUESTION, image_side, random_llava  # bench/scale.py (the script's folder is on sys.path)

from core.analyze import analyze
from core.forward.capture import capture

# (file suffix, function name) -> label
PARTS = {
    ("core/forward/capture.py", "capture"): "capture (all of it)",
    ("core/forward/capture.py", "record_pattern"): "kept rows and pattern streams",
    ("core/methods/patterns.py", "__call__"): "rollout stream",
    ("core/results/readout.py", "jsonable"): "results to JSON",
    ("core/methods/logit_lens.py", "logit_lens"): "logit lens",
}


def profile(fn, repeats: int) -> dict[str, float]:
    profiler = cProfile.Profile()
    for _ in range(repeats):
        profiler.enable()
        fn()
        profiler.disable()
    out = {}
    for (path, _, name), (_, _, _, cumulative, _) in pstats.Stats(profiler).stats.items():
        for (suffix, function), label in PARTS.items():
            if name == function and path.endswith(suffix):
                out[label] = out.get(label, 0.0) + cumulative / repeats
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    side = image_side(args.tokens)
    loaded = random_llava("llava-1024", side, None, torch.float32, "cpu")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (side, side, 3), dtype=np.uint8))
    inputs = loaded.adapter.prepare([image], [QUESTION])
    calls = {
        "capture": lambda: capture(loaded, None, "", inputs=inputs),
        "analyze": lambda: analyze(loaded, image, QUESTION),
    }
    for name, fn in calls.items():
        fn()  # warm-up
        parts = profile(fn, args.repeats)
        print(f"{name} ({inputs.input_ids.shape[1]} tokens), seconds per call:")
        for label, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"  {label}: {seconds:.3f}")


if __name__ == "__main__":
    main()
