"""The bundled sample image-question pairs (``resources/samples/pairs.jsonl``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from core.models.loading import resources_dir


@dataclass(frozen=True)
class Sample:
    """One bundled pair; ``expected`` is the scene's ground-truth answer."""

    image_path: Path
    question: str
    expected: str | None = None


def bundled_samples() -> list[Sample]:
    """All bundled pairs in file order (the first is the default); [] if none."""
    pairs_file = resources_dir() / "samples" / "pairs.jsonl"
    if not pairs_file.is_file():
        return []
    samples = []
    for line in pairs_file.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            samples.append(Sample(pairs_file.parent / row["image"], row["question"], row.get("answer")))
    return samples
