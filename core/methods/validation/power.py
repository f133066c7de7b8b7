"""Whether a held-out set is large enough for the chain to support anything, decided
before any forward (docs/METHODS.md §4.11, "Power"): :func:`power_refusal`.

Step 1 gates every status: a chain whose step 1 cannot pass supports nothing. Its
exact test (:func:`core.methods.validation.stats.poisson_binomial_tail`) is most
favourable when every sample hits; then ``p = prod_i chance_i`` over the samples
that can hit. If even that exceeds :data:`~core.methods.validation.setting.HIT_P_MAX`,
no outcome on this set passes: the claim is refused with the smallest n that
could (at this set's mean chance), instead of a chain that reads as evidence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from core.methods.validation.setting import HIT_P_MAX


@dataclass(frozen=True)
class StepOnePower:
    """Step 1's test on a held-out set at its best (every sample a hit).

    Attributes:
        n: the held-out samples; ``chances`` each one's chance (a uniform head's).
        best_p: the exact p-value were every sample that can hit a hit.
        level: the pre-registered level it must reach.
        minimum_n: the smallest n whose best case passes, at this set's mean chance
            (None: no n could, the targets cover every patch token).
    """

    n: int
    chances: tuple[float, ...]
    best_p: float
    level: float
    minimum_n: int | None

    @classmethod
    def of(cls, chances, level: float = HIT_P_MAX) -> StepOnePower:
        """``level``: the specification's step 1 level (``ClaimSpec.hit_p``)."""
        c = [float(x) for x in chances]
        can_hit = [x for x in c if x > 0]
        best_p = float(np.prod(can_hit)) if can_hit else 1.0
        mean = float(np.mean(can_hit)) if can_hit else 0.0
        if not 0 < mean < 1:
            minimum = None
        else:  # mean ** m <= level, with a margin for rounding at the boundary
            minimum = max(1, math.ceil(math.log(level) / math.log(mean) - 1e-12))
        return cls(len(c), tuple(c), best_p, level, minimum)

    @property
    def can_pass(self) -> bool:
        return self.best_p <= self.level

    def refusal(self) -> str:
        """The one line that refuses a held-out set too small for step 1."""
        mean = np.mean([x for x in self.chances if x > 0]) if any(x > 0 for x in self.chances) else 0.0
        smallest = (
            f"the smallest n at which step 1 could pass is {self.minimum_n} (at this set's mean chance {mean:.3g})"
            if self.minimum_n is not None
            else "no n could: the targets cover every patch token, so a hit is no evidence"
        )
        return (
            f"held-out n={self.n} is too small: step 1's exact test cannot pass at p <= {self.level:g} on it (were "
            f"every sample a hit, p = {self.best_p:.2g}), so no step could support the claim; {smallest}"
        )


def power_refusal(spec, chances) -> str | None:
    """The one line refusing a held-out set (each sample's step 1 chance, from its
    :class:`core.methods.validation.relations.Row`) on which ``spec``'s claim cannot be
    supported: step 1's exact test cannot pass, or steps 3 and 5's intervals cannot exclude
    zero at the effects the specification states; None where it can."""
    power = StepOnePower.of(chances, spec.hit_p)
    if not power.can_pass:
        return power.refusal()
    n = len(chances)
    for step, least, stated in (
        (3, spec.minimum_n_step3(), f"a correlation of {spec.stated_r or 0:g}"),
        (5, spec.minimum_n_step5(), f"a standardised effect of {spec.effect_size or 0:g}"),
    ):
        if least is not None and n < least:
            interval = "Fisher 95% interval of r" if step == 3 else "95% interval of the mean effect"
            return (
                f"held-out n={n} is too small for the stated effect: step {step}'s {interval} excludes zero at "
                f"{stated} only from n={least}"
            )
    return None
