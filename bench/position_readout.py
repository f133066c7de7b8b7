"""How linearly readable each patch's own position is, before and after
LLaVA's projector (the evidence for the stage-2 `--projected-dense` read-out).

    python bench/position_readout.py --model resources/models/shapes-llava [--scenes 64]

Least-squares linear read-out of each patch's centre (x, y) in [-1, 1] from the
vision tower's output and from the projector's output, fitted on the first half
of the patches of ``--scenes`` training-split scenes and scored (mean squared
error per coordinate) on the second half, over all patches and over the patches
an object covers. The stage-1 shapes-llava is in git history (commit 4107125).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from core.zoo import train


def _rounded(values) -> list[float]:
    return [round(float(v), 4) for v in values]


def readout_errors(model_dir: str, n_scenes: int = 64, seed: int = 7) -> dict:
    trainer = train.LlavaTrainer(0)
    trainer.load_weights(model_dir)
    trainer.model.eval()
    batch = train.Batches(n_scenes, 1, seed).get(2, 0, 4)
    with torch.no_grad():
        vision = trainer.patch_tokens(batch["pixels"])
        projected = trainer.project(vision)
    xy = train._patch_xy().repeat(n_scenes, 1).numpy()
    on_object = (batch["color"].reshape(-1) > 0).numpy()
    half = len(xy) // 2
    # the scores' reference: predicting the mean has an error equal to the variance of what is scored
    out = {
        "n_scenes": n_scenes,
        "variance": _rounded(xy.var(0)),
        "variance_scored_object_patches": _rounded(xy[half:][on_object[half:]].var(0)),
    }
    for name, tokens in (("vision_out", vision), ("projector_out", projected)):
        x = tokens.reshape(-1, tokens.shape[-1]).numpy()
        x = np.c_[x, np.ones(len(x))]
        w, *_ = np.linalg.lstsq(x[:half], xy[:half], rcond=None)
        err = (x[half:] @ w - xy[half:]) ** 2
        out[name] = {
            "mse_all": _rounded(err.mean(0)),
            "mse_object_patches": _rounded(err[on_object[half:]].mean(0)),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resources/models/shapes-llava")
    p.add_argument("--scenes", type=int, default=64)
    a = p.parse_args()
    print(json.dumps(readout_errors(a.model, a.scenes), indent=1))


if __name__ == "__main__":
    main()
