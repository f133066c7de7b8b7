"""Norm: matches the library modules; frozen scale is additive; the Jacobian
equals autograd's."""

import pytest
import torch

from core.models.norms import Norm
from tests.core.exactness import frozen_map_terms, norm_output_tol
from tests.tolerances import abs_terms, sum_tol

D = 24
# reductions a norm's maps add per output entry: LayerNorm's mean and the
# variance's derivative, the scale, the gain (and a dot product with u on top)
N_TERMS = 3 * D + 4


def jacobian(norm, x):
    """``(D, D)``: row k is ``J(x) e_k``."""
    return norm.jvp(x, torch.eye(D, dtype=x.dtype))


def _norms():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(D, generator=g, dtype=torch.float64)
    b = torch.randn(D, generator=g, dtype=torch.float64)
    return {
        "rmsnorm": Norm("rmsnorm", w, None, 1e-6),
        "layernorm": Norm("layernorm", w, b, 1e-5),
        "gemma": Norm("rmsnorm", w * 0.1, None, 1e-6, weight_offset=1.0),
    }


@pytest.mark.parametrize("name", ["rmsnorm", "layernorm", "gemma"])
def test_jacobian_matches_autograd_and_vjp_is_its_transpose(name):
    norm = _norms()[name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(D, generator=g, dtype=torch.float64) * 3
    v = torch.randn(5, D, generator=g, dtype=torch.float64)
    u = torch.randn(D, generator=g, dtype=torch.float64)
    J = jacobian(norm, x)
    for row in v:
        _, expected = torch.autograd.functional.jvp(norm, x, row)
        tol = sum_tol(abs_terms(row, J).max(), N_TERMS, x.dtype)  # |J| |row|
        torch.testing.assert_close(norm.jvp(x, row), expected, atol=tol, rtol=0)
    tol = sum_tol((abs_terms(v, J) @ u.abs()).max(), N_TERMS + D, x.dtype)
    torch.testing.assert_close(v @ norm.vjp(x, u), norm.jvp(x, v) @ u, atol=tol, rtol=0)


@pytest.mark.parametrize("name", ["rmsnorm", "layernorm", "gemma"])
def test_frozen_scale_is_additive(name):
    norm = _norms()[name]
    g = torch.Generator().manual_seed(2)
    parts = torch.randn(7, D, generator=g, dtype=torch.float64)
    x = parts.sum(0)
    bias = norm.bias if norm.bias is not None else 0
    F = norm.frozen(x, torch.eye(D, dtype=x.dtype))  # (D, D): row k is the frozen map of e_k
    tol = sum_tol(abs_terms(parts, F).sum(0).max(), len(parts) + N_TERMS, x.dtype)
    torch.testing.assert_close(norm.frozen(x, parts).sum(0), norm(x) - bias, atol=tol, rtol=0)


def test_matches_library_modules():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(3, D, dtype=torch.float64)
    ln = torch.nn.LayerNorm(D, eps=1e-5).double()
    torch.nn.init.normal_(ln.weight)
    torch.nn.init.normal_(ln.bias)
    layer = Norm("layernorm", ln.weight, ln.bias, 1e-5)
    with torch.no_grad():  # the fused kernel sums the statistics in its own order
        torch.testing.assert_close(layer(x), ln(x), atol=norm_output_tol(layer, x), rtol=0)
    rms = LlamaRMSNorm(D, eps=1e-6).double()
    torch.nn.init.normal_(rms.weight)
    norm = Norm("rmsnorm", rms.weight, None, 1e-6, compute_dtype=torch.float32)
    torch.testing.assert_close(norm(x), rms(x), atol=0, rtol=0)


@pytest.mark.parametrize("name", ["rmsnorm", "layernorm", "gemma"])
def test_frozen_readout_is_the_frozen_map_transposed(name):
    norm = _norms()[name]
    g = torch.Generator().manual_seed(3)
    x, u = torch.randn(2, D, generator=g, dtype=torch.float64)
    c = torch.randn(6, D, generator=g, dtype=torch.float64)
    tol = sum_tol(frozen_map_terms(norm, x, c, u).max(), N_TERMS, x.dtype)
    torch.testing.assert_close(c @ norm.frozen_readout(x, u), norm.frozen(x, c) @ u, atol=tol, rtol=0)
