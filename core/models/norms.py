"""Norms in canonical form: apply, freeze the scale, and the Jacobian.

Every read-out that passes a residual vector through a model's norm uses
:class:`Norm`, so the final-norm convention (recomputed, frozen scale, or
linearised) is stated in one place.

Every method computes in the accumulation dtype of its inputs
(:func:`core.shell.precision.accumulating`): a bfloat16 or float16 residual is
upcast to float32 first and the result is float32 (the read-outs sum in it); a
float32 or float64 input is computed as it always was, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.shell.precision import accumulating


@dataclass
class Norm:
    """A LayerNorm or RMSNorm over the last axis.

    Attributes:
        kind: "rmsnorm" or "layernorm".
        weight: ``(d_model,)`` or None.
        bias: ``(d_model,)`` or None (LayerNorm only).
        eps: added to the variance.
        weight_offset: the scale is ``weight_offset + weight`` (Gemma uses
            ``1 + w``; everyone else 0).
        compute_dtype: the dtype the model computes the statistics in
            (Llama and Gemma up-cast to float32).
    """

    kind: str
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float
    weight_offset: float = 0.0
    compute_dtype: torch.dtype | None = None

    def _gain(self, like: torch.Tensor) -> torch.Tensor | None:
        if self.weight is None:
            return None
        return (self.weight_offset + self.weight.to(like.device, like.dtype)).to(
            like.dtype
        )  # the input's device: a device map

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """``1 / sigma(x)``, shape ``(..., 1)``: the per-vector factor the norm divides by."""
        x = accumulating(x)
        xf = x.to(self.compute_dtype) if self.compute_dtype else x
        if self.kind == "rmsnorm":
            return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype)
        return torch.rsqrt(xf.var(-1, keepdim=True, unbiased=False) + self.eps).to(x.dtype)

    def center(self, x: torch.Tensor) -> torch.Tensor:
        """The linear part before scaling: identity for RMSNorm, mean removal for LayerNorm."""
        x = accumulating(x)
        return x if self.kind == "rmsnorm" else x - x.mean(-1, keepdim=True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., d_model) -> (..., d_model)``, as the model computes it
        (statistics and normalisation in ``compute_dtype``, gain after); a
        half-precision ``x`` is normalised in float32 and stays float32 (the
        model rounds its output to its dtype; a read-out does not)."""
        x = accumulating(x)
        if self.compute_dtype is not None:
            xf = x.to(self.compute_dtype)
            y = (self.center(xf) * self.scale(xf)).to(x.dtype)
        else:
            y = self.center(x) * self.scale(x)
        gain = self._gain(y)
        if gain is not None:
            y = y * gain
        if self.bias is not None:
            y = y + self.bias.to(y.device, y.dtype)
        return y

    def frozen(self, x_ref: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """The norm's linear map at ``x_ref`` with the scale frozen, applied to
        components ``c`` (no bias): ``gain * center(c) / sigma(x_ref)``.

        Args:
            x_ref: ``(d_model,)`` the vector whose scale is frozen (usually x_L).
            c: ``(..., d_model)`` components.

        Summed over an additive split of ``x_ref`` this gives
        ``norm(x_ref) - bias`` exactly.
        """
        x_ref, c = accumulating(x_ref), accumulating(c)
        y = self.center(c) * self.scale(x_ref)
        gain = self._gain(y)
        return y * gain if gain is not None else y

    def frozen_bias(self, x_ref: torch.Tensor) -> torch.Tensor | None:
        """What the frozen map leaves out: ``norm(x_ref) - frozen(x_ref, x_ref)``,
        the norm's own bias (None without one)."""
        return self.bias

    def frozen_readout(self, x_ref: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The vector ``g`` with ``g . c == u . frozen(x_ref, c)`` for every ``c``:
        ``center(gain * u) / sigma(x_ref)`` (the frozen map is symmetric but for the gain)."""
        x_ref, u = accumulating(x_ref), accumulating(u)
        gain = self._gain(u)
        return self.center(u * gain if gain is not None else u) * self.scale(x_ref)

    def jvp(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The Jacobian of the norm at ``x`` applied to ``v``: ``J(x) v``.

        Args:
            x: ``(d_model,)`` linearisation point.
            v: ``(..., d_model)`` directions.
        """
        x, v = accumulating(x), accumulating(v)
        d = x.shape[-1]
        s = self.scale(x)  # 1/sigma
        xc = self.center(x)
        vc = self.center(v)
        # d/dx [xc * s] v = s * vc - s^3 * xc * (xc . vc) / d   (both kinds, xc centred for LayerNorm)
        y = s * vc - (s**3) * xc * (vc * xc).sum(-1, keepdim=True) / d
        gain = self._gain(y)
        return y * gain if gain is not None else y

    def vjp(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``J(x)^T u`` for ``u (d_model,)``: the direction whose dot product with
        any ``c`` is ``u^T J(x) c`` (one vector for all components)."""
        x, u = accumulating(x), accumulating(u)
        gain = self._gain(u)
        g = u * gain if gain is not None else u
        d = x.shape[-1]
        s = self.scale(x)
        xc = self.center(x)
        # J is symmetric apart from the gain on the left: J = G (s P - s^3 xc xc^T / d) C
        w = s * g - (s**3) * xc * (xc * g).sum(-1, keepdim=True) / d
        return self.center(w)


class GemmaNorm(Norm):
    """Gemma's RMSNorm exactly as the model computes it: statistics,
    normalisation *and* the ``(1 + w)`` gain in ``compute_dtype`` (float32),
    then cast back (``GemmaRMSNorm`` multiplies by the gain before the cast,
    Llama after it). ``frozen``/``jvp``/``vjp`` are the base class's (in the
    input's dtype)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., d_model) -> (..., d_model)``."""
        dt = self.compute_dtype or x.dtype
        xf = x.to(dt)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = y * (self.weight_offset + self.weight.to(dt))
        return y.to(x.dtype)


class CohereNorm(Norm):
    """Cohere's LayerNorm exactly as the model computes it: centring, scale
    *and* gain in ``compute_dtype`` (float32), then cast back (as
    :class:`GemmaNorm` for Gemma's RMSNorm)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(self.compute_dtype or x.dtype)
        xc = xf - xf.mean(-1, keepdim=True)
        y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(xf) * y).to(x.dtype)


class IdentityNorm(Norm):
    """No norm at all, where a sublayer reads its input as it is (BLIP's
    post-LN sublayers read the previous LayerNorm's output; Mllama's and BLIP's
    cross-attention keys and values read the vision output directly): every
    method reduces to the identity (in the accumulation dtype, as every Norm's result)."""

    def __init__(self):
        super().__init__("identity", None, None, 0.0)

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(accumulating(x[..., :1]))

    def center(self, x: torch.Tensor) -> torch.Tensor:
        return accumulating(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return accumulating(x)

    def frozen(self, x_ref: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return accumulating(c)

    def frozen_readout(self, x_ref: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return accumulating(u)

    def jvp(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return accumulating(v)

    def vjp(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return accumulating(u)
