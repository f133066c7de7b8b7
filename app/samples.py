"""The bundled sample image-question pairs (``resources/samples/pairs.jsonl``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core.files.pairs import read_pairs
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


def bundled_pairs_file() -> Path:
    """The bundled pairs file (it may be missing in a stripped install)."""
    return resources_dir() / "samples" / "pairs.jsonl"


def bundled_samples() -> list[Sample]:
    """All bundled pairs in file order (the first is the default); [] if none.
    Read by :func:`core.files.pairs.read_pairs`, as every pairs file is: a damaged
    file is its one-line :class:`core.errors.ReadoutError`."""
    pairs_file = bundled_pairs_file()
    if not pairs_file.is_file():
        return []
    return [Sample(p.image_path, p.question, p.answer, p.target_mask) for p in read_pairs(pairs_file)]
