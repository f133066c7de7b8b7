"""The tuned lens's corpora of synthetic scenes: :class:`SyntheticCorpus` (the
default models' scene generator, or the independent renderer) and the default
models' held-out evaluation sets (:func:`default_eval_sets`). Kept beside the
zoo so that :mod:`core.methods.tuned_lens` imports no zoo module.
"""

from __future__ import annotations

import functools
from typing import Any

from core.methods.tuned_lens.data import Batch, Made
from core.zoo import scenes
from core.zoo.altrender import make_alt_sample


class SyntheticCorpus:
    """The default models' scene generator: step ``s`` takes samples
    ``s * batch_size ... (s + 1) * batch_size - 1`` of ``split`` (every sample
    a fresh scene; deterministic, so a resumed run sees the same data).

    Args:
        split: a :data:`core.zoo.scenes.SPLIT_SEEDS` split, or "alt" (the independent renderer).
        n_objects: objects per scene (None: the generator's 1-4); more than 4 is the shifted domain.
        kinds: question kinds to cycle through (None: drawn by the generator).
        offset: index of the first sample.
    """

    def __init__(self, split: str = "train", *, n_objects=None, kinds=None, offset: int = 0):
        self.split, self.n_objects, self.kinds, self.offset = split, n_objects, kinds, offset
        # take()'s images and questions each draw a sample: the batch being read is drawn once
        self.sample = functools.lru_cache(maxsize=256)(self._draw)

    def _draw(self, index: int):
        i = self.offset + index
        kind = self.kinds[i % len(self.kinds)] if self.kinds else None
        if self.split == "alt":
            return make_alt_sample(i, kind=kind)
        n = self.n_objects[i % len(self.n_objects)] if isinstance(self.n_objects, list | tuple) else self.n_objects
        return scenes.make_sample(self.split, i, kind=kind, n_objects=n)

    def batch(self, step: int, batch_size: int) -> Batch:
        ss = [self.sample(step * batch_size + k) for k in range(batch_size)]
        return Batch([s.image for s in ss], [s.question for s in ss], [None] * len(ss))

    def take(self, n: int) -> Batch:
        """Samples ``0 .. n - 1``, drawn as they are read (never all held in memory)."""
        images = Made(n, lambda k: self.sample(k).image)
        return Batch(images, Made(n, lambda k: self.sample(k).question), [None] * n)

    def describe(self) -> dict:
        d = {
            "source": "synthetic scene generator (core.zoo.scenes)" if self.split != "alt" else "alt renderer",
            "split": self.split,
            "objects_per_scene": self.n_objects if self.n_objects is not None else "1-4 (generator default)",
            "question_kinds": list(self.kinds) if self.kinds else "all (generator default)",
            "first_index": self.offset,
        }
        return d


def default_eval_sets(n_heldout: int = 1000, n_shifted: int = 500) -> dict[str, tuple[Any, int]]:
    """The default models' held-out evaluations: ``{name: (corpus, n)}``.

    * ``heldout``: new scenes of the generator's ``heldout`` split (never trained on).
    * ``shifted_more_objects``: the ``shifted`` split drawn with 5 or 6 objects
      per scene (training, of the model and of the lens, never had more than
      4); attribute, exist and relation questions (count answers stop at "four").
    * ``alt_renderer``: scenes drawn by the independent renderer of
      :mod:`core.zoo.altrender` (other anti-aliasing, textures and noise).
    """
    return {
        "heldout": (SyntheticCorpus("heldout"), n_heldout),
        "shifted_more_objects": (
            SyntheticCorpus("shifted", n_objects=[5, 6], kinds=("attribute", "exist", "relation")),
            n_shifted,
        ),
        "alt_renderer": (SyntheticCorpus("alt"), n_shifted),
    }
