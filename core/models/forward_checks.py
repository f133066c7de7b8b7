"""What a forward must give before its logits are a result, checked where
every forward runs (:meth:`core.models.adapter.Adapter.run_model`,
``next_token_logits``, the decoding steps and ``capture``), so that answer,
analyze, generate, counterfactual, audit, validate and the app all refuse the
same way:

* the model's own check that the processor's image tokens match its image
  features (or its input size), which a configuration the load-time checks
  (core/models/config_check.py) cannot foresee still trips, as one line naming
  the configs that disagree;
* non-finite logits (a broken epsilon, scale or normalisation, a float16
  overflow) are an error, never an answer of probability NaN.
"""

from __future__ import annotations

import contextlib

import torch

from core.errors import ModelLoadError, NonFiniteError

# the first line of the ValueError transformers raises when they disagree
_MISMATCH_MESSAGES = ("Image features and image tokens do not match", "Input image size")


@contextlib.contextmanager
def model_input_errors(spec: str):
    """The model's image-token / input-size check failing inside a forward of
    model ``spec``, as one :class:`ModelLoadError` line."""
    try:
        yield
    except ValueError as e:
        text = (str(e).splitlines() or [""])[0]
        if not text.startswith(_MISMATCH_MESSAGES):
            raise
        raise ModelLoadError(
            f"{spec}: the processor and the model disagree ({text[:200]}): the processor config "
            "(processor_config.json / preprocessor_config.json) and config.json describe different image sizes "
            "or image token counts"
        ) from None


def check_finite_logits(spec: str, logits: torch.Tensor, where: str = "the answer position") -> None:
    """:class:`NonFiniteError` naming model ``spec`` when any logit of the rows
    a result reads (``(..., vocab)``) is NaN or Inf."""
    finite = torch.isfinite(logits)
    if bool(finite.all()):
        return
    nan = int(torch.isnan(logits).sum())
    inf = int(finite.numel() - int(finite.sum())) - nan
    raise NonFiniteError(
        f"{spec}: the forward gave non-finite logits at {where} ({nan:,} NaN, {inf:,} Inf of "
        f"{logits.numel():,}), so there is no result: check the model's config and processor config (norm "
        "epsilons, rope_theta, image_std, rescale_factor) or, in float16, load it in float32"
    )
