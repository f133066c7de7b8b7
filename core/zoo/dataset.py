"""Write synthetic scenes as an image-question dataset for ``vlm-readout audit``.

``python -m core.zoo.dataset --split heldout --n 500 --out DIR`` writes::

    DIR/dataset.jsonl           one sample a line (schema below), in index order
    DIR/images/<split>_NNNNNN.png
    DIR/masks/<split>_NNNNNN_objK.png   one per object: white (255) = every pixel
                                        the object's ink touches, black elsewhere
    DIR/manifest.json           split, n, filters, the scene vocabulary

Each JSONL row (paths are relative to the JSONL file's folder)::

    {"id", "image", "question", "answer", "foil", "kind", "template",
     "split", "index",                       # make_sample(split, index) redraws it
     "target", "reference",                  # object indices (or null)
     "target_mask", "reference_mask",        # PNG paths (or null)
     "distractors": [k...], "distractor_masks": [PNG...],
     "object_masks": [PNG...], "objects": [{color, shape, center, size, rotation_deg, box}]}

Every file is written atomically (temporary file, then ``os.replace``).
Samples come from :func:`core.zoo.scenes.make_sample`, so ``(split, index)``
fixes the image, the question and the masks exactly; ``--min-distractors``
and ``--kind`` select among consecutive indices (skipped indices are not
written, and the kept ones keep their own index).
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from core.errors import ReadoutError
from core.files.atomic import make_folder, write_bytes_atomic, write_text_atomic
from core.shell.arguments import Parser, non_negative_int, positive_int
from core.zoo import scenes

SCHEMA_VERSION = 1
JSONL_NAME = "dataset.jsonl"


def _png_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def mask_png(mask: np.ndarray) -> bytes:
    """``(H, W)`` bool -> 8-bit greyscale PNG bytes, 255 inside, 0 outside."""
    return _png_bytes(np.asarray(mask, dtype=bool).astype(np.uint8) * 255)


def sample_row(s: scenes.Sample, stem: str) -> dict:
    """The JSONL row of one sample whose files are named after ``stem``."""
    masks = [f"masks/{stem}_obj{k}.png" for k in range(len(s.objects))]
    d = s.to_dict()
    return {
        "id": stem,
        "image": f"images/{stem}.png",
        "question": s.question,
        "answer": s.answer,
        "foil": s.foil,
        "kind": s.kind,
        "template": s.template,
        "split": s.split,
        "index": s.index,
        "target": s.target,
        "reference": s.reference,
        "target_mask": masks[s.target] if s.target is not None else None,
        "reference_mask": masks[s.reference] if s.reference is not None else None,
        "distractors": s.distractors,
        "distractor_masks": [masks[k] for k in s.distractors],
        "object_masks": masks,
        "objects": d["objects"],
    }


def write_dataset(
    out: str | Path,
    split: str = "heldout",
    n: int = 100,
    *,
    start: int = 0,
    kind: str | None = None,
    min_distractors: int = 0,
    max_tries: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    cancel: Callable[[], bool] | None = None,
) -> list[dict]:
    """Write ``n`` samples of ``split`` (from index ``start`` on) to ``out``.

    Args:
        kind: only this question kind (passed to ``make_sample``).
        min_distractors: keep only samples with at least this many objects
            that are neither the target nor the reference.
        max_tries: give up after this many indices (default ``50 * n + 100``).
        progress: ``progress(done, total, message)``; cancel: returns True to
            stop (the samples written so far are listed in the JSONL).

    Returns:
        the JSONL rows written.
    """
    if split not in scenes.SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(scenes.SPLIT_SEEDS)}")
    if kind is not None and kind not in scenes.QUESTION_KINDS:
        raise ValueError(f"unknown question kind {kind!r}; expected one of {scenes.QUESTION_KINDS}")
    out = Path(out)
    make_folder(out / "images")
    make_folder(out / "masks")
    rows: list[dict] = []
    limit = max_tries if max_tries is not None else 50 * n + 100
    index = start
    while len(rows) < n and index < start + limit:
        if cancel is not None and cancel():
            break
        s = scenes.make_sample(split, index, kind=kind)
        index += 1
        if len(s.distractors) < min_distractors:
            continue
        stem = f"{split}_{s.index:06d}"
        write_bytes_atomic(out / "images" / f"{stem}.png", _png_bytes(s.image))
        for k, o in enumerate(s.objects):
            write_bytes_atomic(out / "masks" / f"{stem}_obj{k}.png", mask_png(o.mask))
        rows.append(sample_row(s, stem))
        if progress is not None:
            progress(len(rows), n, "writing samples")
    write_text_atomic(out / JSONL_NAME, "".join(json.dumps(r) + "\n" for r in rows))
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "generator": "core.zoo.dataset",
        "split": split,
        "n": len(rows),
        "n_requested": n,
        "start": start,
        "indices_scanned": [start, index],
        "kind": kind,
        "min_distractors": min_distractors,
        "jsonl": JSONL_NAME,
        "mask_convention": "8-bit greyscale PNG, 255 = every pixel the object's ink touches (coverage > 0)",
        "vocabulary": scenes.scene_vocabulary(),
    }
    write_text_atomic(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m core.zoo.dataset", description="Write synthetic scenes as an audit dataset.")
    p.add_argument("--split", default="heldout", choices=sorted(scenes.SPLIT_SEEDS))
    p.add_argument("--n", type=positive_int, default=100)
    p.add_argument("--out", required=True)
    p.add_argument("--start", type=non_negative_int, default=0, help="first sample index")
    p.add_argument("--kind", choices=scenes.QUESTION_KINDS, help="only this question kind")
    p.add_argument(
        "--min-distractors", type=non_negative_int, default=0, help="keep samples with at least this many distractors"
    )
    p.add_argument("--quiet", action="store_true")
    try:
        a = p.parse_args(argv)
    except SystemExit as e:  # -h, or a refused command line (its one line is printed)
        return e.code if isinstance(e.code, int) else 0
    from core.shell.terminal import progress_bar  # drawn on a terminal only, wiped before an error line

    try:
        with progress_bar("dataset", quiet=a.quiet, total=a.n) as progress:
            rows = write_dataset(
                a.out,
                a.split,
                a.n,
                start=a.start,
                kind=a.kind,
                min_distractors=a.min_distractors,
                progress=lambda done, total, msg: progress(done),
            )
    except ReadoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if len(rows) < a.n:
        print(f"warning: only {len(rows)} samples met the filters", file=sys.stderr)
    print(Path(a.out) / JSONL_NAME)
    return 0


if __name__ == "__main__":
    sys.exit(main())
