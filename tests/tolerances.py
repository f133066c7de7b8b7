"""Tolerances that follow from the arithmetic a check compares.

An exactness check compares two computations of one quantity (a read-out and
autograd, a recomputation and the model's forward, a sum of parts and the
whole). How far apart they may be follows from three things, and every
tolerance in the tests is built from them here:

1. the unit roundoff ``u`` of the dtype each step *actually* runs in. A float64
   model does not compute everything in float64: transformers' RMSNorms cast to
   float32 for their statistics, eager attention takes its softmax in float32,
   and RoPE tables are built in float32 (:func:`step_dtype` says which step runs
   in which dtype, per family);
2. how many terms a reduction adds (``gamma(n)``: the error of an ``n``-term sum
   grows with ``n``);
3. the size of the *terms*, not of the result (``sum |a_i b_i|`` for a dot
   product, ``sum |components|`` for a decomposition): cancellation leaves the
   result small and the rounding as large as the terms made it.

The bounds are the worst-case ones of Higham, *Accuracy and Stability of
Numerical Algorithms* (2nd ed., ch. 3), so they hold whatever order a SIMD path
sums in (``ATEN_CPU_CAPABILITY`` default, avx2 or avx512). They are about
``sqrt(n)`` looser than the errors actually seen. In float64, and for one
float32 step inside a float64 model, that is still far below a bug (a term off
by 1e-4 of its size); for long float32 chains (the shipped float32 models'
recomputed attention patterns) the worst case is loose, and it is the float64
variant of each such test that resolves small bugs.

Half precision (bfloat16, float16). torch's CPU kernels accumulate a half
reduction (matmul / addmm, sum, mean, softmax, layer_norm) in float32
(``at::opmath_type``, ATen/OpMathType.h: "For FP16 or BFloat16 inputs, ops
should perform internal math in FP32"; a product of two half values is exact
there) and round the result once; elementwise ops (a residual add, a gate, a
cast) round once each. Higham's ``gamma_n`` taken in the half dtype would model
every addition rounding to 8 or 11 bits: useless (no bound at all above
``n = 256`` in bfloat16) and a check that cannot fail. So :func:`gamma` of a
half dtype is ``gamma_n(float32) + u_half`` (one float32 accumulation, one
rounding of the result, which is at most the terms' size), and the elementwise
roundings that float32 / float64 checks count among their ``n`` are counted
explicitly (:func:`half_rounding_tol`). The read-outs accumulate in float32
for a half model (core.shell.precision.accumulation_dtype): a comparison of two
read-outs uses float32's ``gamma`` (:func:`opmath_dtype`), so a read-out that
sums in the half dtype (``u_half`` of its result) is caught. float32 and
float64 numbers are unchanged.

Where two sides run the *same* ops on the same values (a capture against the
same eager forward, a write patched with its own value) the checks stay exact.
"""

from __future__ import annotations

import math

import torch

FLOAT32 = torch.float32
HALF_DTYPES = (torch.bfloat16, torch.float16)

# Steps that transformers computes in float32 whatever the model's dtype
# (transformers 5.x, modeling_<family>.py):
#   "norm"    RMSNorm casts its input to float32, normalises there, casts back
#             (LlamaRMSNorm, Qwen2RMSNorm, MllamaTextRMSNorm; GemmaRMSNorm also
#             applies its (1 + w) gain in float32);
#   "softmax" eager_attention_forward: softmax(..., dtype=torch.float32) (the
#             decoders and the CLIP / SigLIP / Qwen-ViT / Mllama vision towers);
#   "rope"    the rotary embedding builds cos/sin in float32 and casts them.
# BLIP (nn.LayerNorm, nn.Softmax in the model dtype) and open_clip's CoCa
# (LayerNorm cast back to the input dtype, attention in the model dtype) run
# every step in the model's dtype.
_HF_DECODER = frozenset({"norm", "softmax", "rope"})
FLOAT32_STEPS: dict[str, frozenset[str]] = {
    "aya_vision": _HF_DECODER,
    "llava": _HF_DECODER,
    "llava_next": _HF_DECODER,
    "llava_onevision": _HF_DECODER,
    "idefics2": _HF_DECODER,
    "idefics3": _HF_DECODER,
    "internvl": _HF_DECODER,
    "janus": _HF_DECODER,
    "smolvlm": _HF_DECODER,
    "qwen2_vl": _HF_DECODER,
    "qwen2_5_vl": _HF_DECODER,
    "qwen3_vl": _HF_DECODER,
    "qwen3_5": _HF_DECODER,
    "qwen3_vl_moe": _HF_DECODER,
    "qwen3_5_moe": _HF_DECODER,
    "lfm2_vl": _HF_DECODER,
    "llama4": _HF_DECODER,
    "gemma3n": _HF_DECODER,
    "mllama": _HF_DECODER,
    "paligemma": _HF_DECODER,
    "gemma3": _HF_DECODER,
    "mistral3": _HF_DECODER,
    "molmo2": _HF_DECODER,
    "glm4v": _HF_DECODER,
    "blip": frozenset(),
    "coca": frozenset(),
}

# Roundings one norm step adds to each element on the way (cast of the input,
# the normalised value, the gain or the cast back): three for every kind here.
NORM_ROUNDINGS = 3


def _scalar(x) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps / 2``: the largest relative error of one correctly rounded
    operation in ``dtype`` (1.1e-16 for float64, 6.0e-8 for float32)."""
    return torch.finfo(dtype).eps / 2


def opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch's kernels accumulate a ``dtype`` reduction in
    (``at::opmath_type``, ATen/OpMathType.h): float32 for bfloat16 and float16,
    the dtype itself otherwise."""
    return FLOAT32 if dtype in HALF_DTYPES else dtype


def gamma(n: int, dtype: torch.dtype) -> float:
    """The worst-case relative error of an ``n``-term sum or dot product whose
    result is stored in ``dtype``, evaluated in any order, relative to the sum of
    the ``|terms|``.

    float32 / float64: Higham's ``gamma_n = n u / (1 - n u)`` (Higham 2002,
    Lemma 3.1 and eq. 3.5). Half dtypes: the kernel accumulates in float32
    (:func:`opmath_dtype`; a product of two half values is exact there) and
    rounds the result once, ``gamma_n(float32) + u_half`` (the rounding is
    ``u_half |result| <= u_half sum |terms|``)."""
    if dtype in HALF_DTYPES:
        return gamma(n, opmath_dtype(dtype)) + unit_roundoff(dtype)
    nu = n * unit_roundoff(dtype)
    assert nu < 1, f"gamma({n}) is no bound in {dtype}"
    return nu / (1 - nu)


def half_rounding_tol(magnitude: float, dtype: torch.dtype, n_roundings: int) -> float:
    """What ``n_roundings`` elementwise roundings to ``dtype`` (a residual add, a
    gate, a cast of a norm's output) can add, ``magnitude`` being the size of the
    terms each rounded value is part of: ``n_roundings * u * magnitude`` for a
    half dtype, 0 for float32 / float64, whose checks count these steps among
    the ``n`` of their ``gamma_n`` (``u`` of one step is what ``gamma_{n+1}``
    adds to ``gamma_n``). In a half model they are not covered that way: the
    reductions accumulate in float32 (:func:`gamma`), each elementwise step
    rounds to the half dtype."""
    return rounding_tol(magnitude, dtype, n_roundings) if dtype in HALF_DTYPES else 0.0


def coarsest(*dtypes: torch.dtype) -> torch.dtype:
    """Of several dtypes, the one with the largest unit roundoff: a chain of steps
    is only as exact as its least exact one."""
    return max(dtypes, key=unit_roundoff)


def step_dtype(family: str, model_dtype: torch.dtype, step: str) -> torch.dtype:
    """The dtype ``family``'s model computes ``step`` ("norm", "softmax", "rope")
    in when its weights are ``model_dtype``: float32 for the steps transformers
    up-casts (:data:`FLOAT32_STEPS`; never *more* exact than float32), else the
    model's own dtype."""
    if step in FLOAT32_STEPS[family]:
        return coarsest(model_dtype, FLOAT32)
    return model_dtype


@torch.no_grad()
def abs_terms(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``|x| @ |W| (+ |b|)``: per entry of ``x @ W + b``, the sum of the sizes of
    the terms it adds (what its rounding error is relative to). Broadcasts as
    ``@`` does: ``(p, m) @ (h, m, d) -> (h, p, d)``."""
    out = x.abs() @ W.abs()
    return out + b.abs() if b is not None else out


def sum_tol(magnitude: float, n_terms: int, dtype: torch.dtype) -> float:
    """How far two evaluations of the same ``n_terms``-term sum (or dot product)
    may differ, each in ``dtype`` and in any order: ``2 gamma_n magnitude``, with
    ``magnitude`` the largest sum of ``|terms|`` over the entries compared."""
    return 2 * gamma(n_terms, dtype) * _scalar(magnitude)


def matmul_tol(
    x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> float:
    """:func:`sum_tol` for two evaluations of ``x @ W + b`` (an adapter's canonical
    weights against the model's own ``nn.Linear``): the inner length plus the bias
    term, relative to the largest ``|x| @ |W|`` plus the largest ``|b|``."""
    magnitude = abs_terms(x, W).max() + (b.detach().abs().max() if b is not None else 0.0)
    return sum_tol(magnitude, x.shape[-1] + (b is not None), dtype or x.dtype)


def rounding_tol(magnitude: float, dtype: torch.dtype, n_roundings: int = 1) -> float:
    """``n_roundings * u * magnitude``: what rounding each of a sum's terms to
    ``dtype`` ``n_roundings`` times (a float32 norm inside a float64 model) can
    change the sum by, ``magnitude`` being the sum of the ``|terms|``."""
    return n_roundings * unit_roundoff(dtype) * _scalar(magnitude)


@torch.no_grad()
def softmax_rtol(scores: torch.Tensor, dtype: torch.dtype, scores_tol: float = 0.0) -> float:
    """How far, *relative to each weight*, a softmax taken in ``dtype`` on scores
    rounded to ``dtype`` (eager attention's float32) may be from the exact
    softmax of ``scores``: a ``rtol`` for ``assert_close`` (masked weights are 0
    on both sides).

    With the scores off by at most ``d = u |s|_max + scores_tol`` (rounding to
    ``dtype``, plus the two sides' own disagreement ``scores_tol``), each weight
    moves by at most ``p_i * 2 d`` (softmax's sensitivity: ``dp_i = p_i (ds_i -
    sum_j p_j ds_j)``); the max subtraction, exp, ``n``-key sum and division
    add ``p_i * gamma_{n + 4}``.

    Args:
        scores: ``(..., keys)`` the reference pre-softmax scores, ``-inf`` where masked.
        dtype: the dtype the softmax being checked runs in.
        scores_tol: how far the two sides' scores may differ before the softmax.
    """
    s = scores.double()
    finite = torch.isfinite(s)
    s_max = float(s[finite].abs().max()) if finite.any() else 0.0
    d = unit_roundoff(dtype) * s_max + scores_tol
    return 2 * d + gamma(scores.shape[-1] + 4, dtype)


def forward_tol(reference: torch.Tensor, dtype: torch.dtype, n_steps: int, width: int) -> float:
    """How far two forwards of the same model on the same inputs may differ when
    they sum in different orders (a padded batch against a single run, sdpa
    against eager attention, another device): each of the ``n_steps`` reductions
    on the way (of at most ``width`` terms, in ``dtype``) commits at most
    ``gamma_width`` of its terms' size, and the errors add up along the path,
    ``n_steps * gamma_width * |reference|_max``.

    This is a first-order estimate, not a bound: it takes each block to pass its
    input's relative error on unamplified, which holds for these small,
    well-conditioned models. Callers count ``n_steps`` from the architecture
    (blocks times the rounded reductions in each).
    """
    return n_steps * gamma(width, dtype) * _scalar(reference.abs().max())


def statistic_tol(magnitude: float, dtype: torch.dtype, width: int) -> float:
    """How far a norm's output may move when its statistic (a ``width``-term mean
    of squares, then rsqrt, in ``dtype``) is summed in another order: the mean
    moves by ``gamma_width`` relative, ``1/sigma`` by half that plus two
    roundings; ``magnitude`` is the sum of the ``|terms|`` the scale multiplies."""
    return (gamma(width, dtype) / 2 + 2 * unit_roundoff(dtype)) * _scalar(magnitude)


def kl_tol(logit_error: float, vocab: int, dtype: torch.dtype, logit_max: float, spread: float = 0.0) -> float:
    """How far KL(p || q) in nats, evaluated in ``dtype`` over ``vocab`` tokens from
    logits no larger than ``logit_max``, may be from its value when a distribution's
    logits move by at most ``logit_error``.

    ``spread = 0`` (q is p up to that error, e.g. the lens at x_L against the
    model): KL itself is at most ``logit_error**2 / 2`` (Hoeffding's lemma: the
    log-ratio's range is ``2 logit_error``). Otherwise each log-probability moves
    by ``2 logit_error`` and each weight by that fraction of itself, so KL moves by
    ``2 logit_error (1 + spread)``, spread the largest ``|log p - log q|``. The
    evaluation adds: each log-softmax's log-sum-exp (``u`` of its size, a
    ``vocab``-term sum), the log-probabilities' roundings weighted by p (at most
    the entropy, ``log vocab``), and the ``vocab``-term sum of the KL's terms."""
    u, g, log_v = unit_roundoff(dtype), gamma(vocab, dtype), math.log(vocab)
    moved = logit_error**2 / 2 if spread == 0 else 2 * logit_error * (1 + spread)
    lse = 2 * (u * (logit_max + log_v) + g)
    return moved + lse + 2 * u * (log_v + spread) + g * (2 * logit_error + spread)


def prob_tol(p: float, logit_error: float, vocab: int, dtype: torch.dtype) -> float:
    """How far a softmax probability ``p`` over ``vocab`` tokens, evaluated in
    ``dtype``, may move when every logit moves by at most ``logit_error``:
    ``dp_i = p_i (dz_i - sum_j p_j dz_j)``, so at most ``2 p logit_error``; the
    evaluation adds ``gamma_{vocab + 4}`` of ``p`` (the max, exp, sum, division)."""
    return 2 * p * logit_error + gamma(vocab + 4, dtype) * p
