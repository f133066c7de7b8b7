"""The bundled sample image-question pairs (``resources/samples/pairs.jsonl``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from core.models.loading import resources_dir


@dataclass(frozen=True)
class Sample:
    """One bundled pair; ``expected`` is the scene's ground-truth answer and
    ``target_mask_path`` the mask of the object the question is about (None
    for questions about the whole scene)."""

    image_path: Path
    question: str
    expected: str | None = None
    target_mask_path: Path | None = None


def bundled_samples() -> list[Sample]:
    """All bundled pairs in file order (the first is the default); [] if none."""
    pairs_file = resources_dir() / "samples" / "pairs.jsonl"
    if not pairs_file.is_file():
        return []
    samples = []
    for line in pairs_file.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            target = row.get("target")
            masks = row.get("masks") or []
            mask = pairs_file.parent / masks[target] if target is not None and target < len(masks) else None
            samples.append(Sample(pairs_file.parent / row["image"], row["question"], row.get("answer"), mask))
    return samples
