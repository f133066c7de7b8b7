"""Write bundled sample image-question pairs with their ground truth.

``python -m core.zoo.samples --out resources/samples --n 8`` writes
``sample_NN.png``, one mask per object ``sample_NN_objK.png`` (white = the
object's ink) and ``pairs.jsonl`` (the ``vlm-readout answer --pairs`` format
plus answer, foil, kind and the objects' boxes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image

from core.zoo import scenes

# One of each question kind first, so the app's default sample is varied.
KINDS = ("attribute", "relation", "count", "exist")


def write_samples(out: Path, n: int) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        s = scenes.make_sample("sample", i, kind=KINDS[i % len(KINDS)])
        name = f"sample_{i:02d}.png"
        Image.fromarray(s.image).save(out / name)
        masks = []
        for k, o in enumerate(s.objects):
            mname = f"sample_{i:02d}_obj{k}.png"
            Image.fromarray((o.mask * 255).astype(np.uint8)).save(out / mname)
            masks.append(mname)
        row = {"image": name, "question": s.question, **{k: v for k, v in s.to_dict().items() if k != "question"}}
        row["masks"] = masks
        # the region the question is about, in the pairs-file field every reader takes (core.files.pairs)
        row["target_mask"] = masks[s.target] if s.target is not None else None
        rows.append(row)
    (out / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="resources/samples")
    p.add_argument("--n", type=int, default=8)
    a = p.parse_args()
    write_samples(Path(a.out), a.n)


if __name__ == "__main__":
    main()
