"""Exactness checks shared by every family's tests: each compares what a
capture recorded with an independent computation, within the tolerance the
arithmetic of the two sides allows (tests/tolerances.py)."""

import numpy as np
import pytest
import torch
from PIL import Image

from core.methods.residual import component_stack, decompose, target_direction
from tests.tolerances import (
    NORM_ROUNDINGS,
    abs_terms,
    coarsest,
    forward_tol,
    gamma,
    half_rounding_tol,
    matmul_tol,
    opmath_dtype,
    rounding_tol,
    softmax_rtol,
    statistic_tol,
    step_dtype,
    sum_tol,
)

# How many terms each entry of a final "norm"'s frozen map adds up, per d_model:
# RMSNorm scales each coordinate (1), LayerNorm also takes a mean (2), BLIP's head
# transform a dense layer and a LayerNorm (3).
_FROZEN_MAP_DEPTH = {"rmsnorm": 1, "layernorm": 2, "head_transform": 3}


def norm_dtype(adapter, trace) -> torch.dtype:
    """The dtype the adapter's norms (:class:`core.models.norms.Norm`) run in on this
    trace: the family's norm step in the read-outs' accumulation dtype (a half model's
    read-outs normalise in float32; the model's rounding of its norm's output to its
    dtype is :func:`unembedding_tol`'s)."""
    return step_dtype(adapter.family, opmath_dtype(trace.final_resid.dtype), "norm")


def stream_writes(adapter, trace) -> list[torch.Tensor]:
    """``(batch, pos, d_model)`` each: what the model adds to the stream beside its
    blocks' attention and MLP (the adapter's ``stream_writes``: Qwen3-VL's DeepStack
    visual features); none for most families."""
    return [w for _, w in adapter.stream_writes(trace)]


def stream_roundings(adapter, trace) -> int:
    """How many elementwise roundings the model's residual stream commits between
    x_0 and x_L: a residual add per sublayer (two per block) and per extra write
    (:func:`stream_writes`), and in a post-norm model (BLIP) also each stream
    LayerNorm's output (and its add)."""
    if adapter.describe().get("norm_placement") == "post":
        return 2 * len(adapter.stream_norms())
    return 2 * trace.n_blocks + len(stream_writes(adapter, trace))


@torch.no_grad()
def norm_replay_tol(norm, magnitude: float, dtype: torch.dtype) -> float:
    """How far the adapter's :class:`Norm` may be from the model's own norm module
    on the same input, ``magnitude`` being the size of the terms the output feeds.

    Zero for RMSNorm: the adapter replays the module's torch ops in their order
    (checked bit for bit in test_norms and test_paligemma); and for BLIP's head
    transform, which calls the model's module. LayerNorm modules run
    one fused kernel (another summation order for the mean and variance), so the
    statistic and the normalisation's roundings may differ."""
    if norm.kind in ("rmsnorm", "identity", "head_transform"):  # BLIP's head calls the model's own transform
        return 0.0
    d = norm.weight.shape[-1] if norm.weight is not None else 1
    return (
        statistic_tol(magnitude, dtype, d)
        + rounding_tol(magnitude, dtype, NORM_ROUNDINGS)
        + sum_tol(magnitude, d, dtype)
    )


@torch.no_grad()
def assert_canonical_projections(adapter, attn, layer: int, x: torch.Tensor, z: torch.Tensor, out_gain: float = 1.0):
    """The adapter's canonical W_Q/b_Q, W_K/b_K and W_V/b_V (grouped K/V expanded
    to each query head) and W_O/b_O reproduce ``attn``'s q/k/v/o_proj on ``x
    (n, d_model)`` and ``z (n, heads, d_head)``, up to a product summed in another
    order (:func:`tests.tolerances.matmul_tol`). ``out_gain`` multiplies the model's
    o_proj where W_O has a gate folded in (Mllama's tanh(gate)): one more rounding."""
    n, a = x.shape[0], adapter
    q = attn.q_proj(x).view(n, a.n_heads, a.d_head)
    k = attn.k_proj(x).view(n, a.n_kv_heads, a.d_head)
    v = attn.v_proj(x).view(n, a.n_kv_heads, a.d_head)
    tol = matmul_tol(x, a.W_Q(layer), a.b_Q(layer))
    torch.testing.assert_close(torch.einsum("pm,hmd->phd", x, a.W_Q(layer)) + a.b_Q(layer), q, atol=tol, rtol=0)
    for h in range(a.n_heads):
        g = a.kv_group(h)
        for W, b, want in ((a.W_K(layer)[h], a.b_K(layer)[h], k[:, g]), (a.W_V(layer)[h], a.b_V(layer)[h], v[:, g])):
            torch.testing.assert_close(x @ W + b, want, atol=matmul_tol(x, W, b), rtol=0)
    flat = z.reshape(n, -1)
    W_O = a.W_O(layer).flatten(0, 1)
    tol = matmul_tol(flat, W_O, a.b_O(layer)) + rounding_tol(float(abs_terms(flat, W_O).max()), x.dtype)
    want = out_gain * attn.o_proj(flat) if out_gain != 1.0 else attn.o_proj(flat)
    torch.testing.assert_close(torch.einsum("phd,hdm->pm", z, a.W_O(layer)) + a.b_O(layer), want, atol=tol, rtol=0)


@torch.no_grad()
def norm_output_tol(norm, x: torch.Tensor) -> float:
    """How far the adapter's ``norm(x)`` may be from the model's norm module on
    ``x (..., d_model)``: :func:`norm_replay_tol` relative to the output's terms
    (the gain times the centred, scaled input and its mean, plus the bias)."""
    xc = norm.center(x)
    terms = (xc.abs() + x.abs().mean(-1, keepdim=True)) * norm.scale(x)
    if norm.weight is not None:
        terms = terms * norm.weight.abs().to(x.dtype)
    if norm.bias is not None:
        terms = terms + norm.bias.abs().to(x.dtype)
    return norm_replay_tol(norm, terms.max(), x.dtype)


@torch.no_grad()
def head_write_terms(adapter, trace, block: int, positions, batch: int = 0) -> torch.Tensor:
    """``(n_pos, d_model)``: per entry of the attention block's write
    ``sum_h W_O^h z^h + b_O``, the size of its ``heads * d_head + 1`` terms."""
    z = trace.z[block][batch, positions]  # (n_pos, heads, d_head)
    W_O = adapter.W_O(block).to(z.dtype)  # (heads, d_head, d_model)
    return abs_terms(z.flatten(-2), W_O.flatten(0, 1), adapter.b_O(block).to(z.dtype))


def assert_heads_sum_to_attention_output(adapter, trace):
    """sum_h W_O^h z^h + b_O equals the attention block's recorded output, every block.

    Both sides are the output projection's ``heads * d_head``-term dot product in
    the model's dtype, summed in other orders; a gate or LayerScale folded into
    W_O (Mllama, CoCa) is one more rounding. The heads are added here in the
    accumulation dtype (float32 for a half model: no rounding of this side's own)."""
    acc = opmath_dtype(trace.final_resid.dtype)
    for block in trace.attention_blocks:  # a block without attention has no heads (its mixer_out is one write)
        pos = torch.arange(trace.input_ids.shape[1])
        heads = trace.head_output(adapter, block, pos)
        terms = head_write_terms(adapter, trace, block, pos).max()
        n = trace.z[block].shape[-2] * trace.z[block].shape[-1] + 2
        tol = sum_tol(terms, n, heads.dtype) + half_rounding_tol(terms, heads.dtype, 1)
        got = heads.to(acc).sum(1) + adapter.b_O(block).to(acc)
        torch.testing.assert_close(got, trace.attn_out[block][0].to(acc), atol=tol, rtol=0)


@torch.no_grad()
def reconstruction_tol(adapter, trace, positions=None, batch: int = 0) -> float:
    """How far ``x_0 + sum attn + sum mlp`` (or the component stack) may be from
    the recorded x_L: each head's write is a ``heads * d_head``-term product
    (model: one ``o_proj``; the stack: one per head), then ``n_blocks`` writes are
    added in another order; relative to the sizes of all those terms."""
    pos = torch.arange(trace.input_ids.shape[1]) if positions is None else positions
    terms = trace.resid_pre[0][batch, pos].abs()
    n = 1
    for block in range(trace.n_blocks):
        terms = terms + trace.mlp_out[block][batch, pos].abs()
        if block in trace.mixer_out:  # a token mixer without heads: one write
            terms, n = terms + trace.mixer_out[block][batch, pos].abs(), n + 4
            continue
        terms = terms + head_write_terms(adapter, trace, block, pos, batch)
        n += trace.z[block].shape[-2] * trace.z[block].shape[-1] + 4
    for write in stream_writes(adapter, trace):
        terms, n = terms + write[batch, pos].abs(), n + 1
    dtype = trace.final_resid.dtype
    return sum_tol(terms.max(), n, dtype) + half_rounding_tol(terms.max(), dtype, stream_roundings(adapter, trace))


@torch.no_grad()
def stack_tol(adapter, trace, position: int, batch: int = 0) -> float:
    """How far the component stack at ``position`` may sum from x_L, whichever the
    norm placement. Pre-norm: :func:`reconstruction_tol`. Post-norm (BLIP): each
    write reaches x_L through the frozen LayerNorms after it (a mean and a scale
    over ``d_model`` each), so the sum is relative to the propagated components'
    sizes, LayerNorm's mean coupling included."""
    if adapter.describe().get("norm_placement") != "post":
        return reconstruction_tol(adapter, trace, torch.tensor([position]), batch)
    _, C = component_stack(adapter, trace, position, batch)
    terms = (C.abs() + C.abs().mean(-1, keepdim=True)).sum(0).max()
    n = C.shape[0] + len(adapter.stream_norms()) * (2 * C.shape[-1] + 4)
    stream = half_rounding_tol(terms, trace.final_resid.dtype, stream_roundings(adapter, trace))
    return sum_tol(terms, n, C.dtype) + stream


@torch.no_grad()
def unembedding_tol(adapter, normed: torch.Tensor, token_ids=None) -> float:
    """How far two evaluations of ``normed @ W_U + b_U`` (the lens and the model's
    lm_head) may differ, over ``token_ids`` (default: every token): each in the
    coarser of the read-out's and the model's dtype. A half model's lm_head also
    reads its norm's output rounded to the model's dtype (the read-out's float32
    ``normed`` is not): one rounding of the terms."""
    W, b = adapter.W_U.to(normed.dtype), adapter.b_U.to(normed.dtype)
    if token_ids is not None:
        W, b = W[:, token_ids], b[token_ids]
    terms = abs_terms(normed, W, b).max()
    model = adapter.W_U.dtype
    return sum_tol(terms, normed.shape[-1] + 1, coarsest(normed.dtype, model)) + half_rounding_tol(terms, model, 1)


@torch.no_grad()
def logit_terms_bound(adapter) -> float:
    """An input-independent bound on the terms ``sum_i |h_i W_U[i, j]| + |b_U[j]|``
    of any logit: the final norm's output ``h`` has ``||h||_2 <= max|gain| sqrt(d)
    + ||bias||_2`` (a normalised vector has RMS 1), then Cauchy-Schwarz with the
    largest unembedding column."""
    norm_f = adapter.final_norm_layer()
    W = adapter.W_U
    d = W.shape[0]
    gain = 1.0 if norm_f.weight is None else float((norm_f.weight_offset + norm_f.weight).abs().max())
    bias = 0.0 if norm_f.bias is None else float(norm_f.bias.norm())
    return (gain * d**0.5 + bias) * float(W.norm(dim=0).max()) + float(adapter.b_U.abs().max())


@torch.no_grad()
def reader_at_last_layer_tol(adapter, dtype: torch.dtype) -> float:
    """How far a reader of x_L through the final norm and the unembedding, in
    ``dtype`` (the lens's), may be from the model's own logits, for any input:
    the unembedding in another order, the norm replayed, one rounding to
    ``dtype``; relative to :func:`logit_terms_bound`."""
    terms = logit_terms_bound(adapter)
    norm_f = adapter.final_norm_layer()
    norm = step_dtype(adapter.family, dtype, "norm")
    return (
        sum_tol(terms, adapter.W_U.shape[0] + 1, dtype)
        + norm_replay_tol(norm_f, terms, norm)
        + rounding_tol(terms, dtype)
    )


def assert_reconstruction_and_lens_at_last_layer(adapter, trace):
    """x_L = x_0 + sum attn + sum mlp (+ the family's :func:`stream_writes`), and
    the lens on x_L is the model's logits (the same final norm, then the
    unembedding summed in another order)."""
    acc = opmath_dtype(trace.final_resid.dtype)  # the sum here adds no rounding of its own in a half model
    # a block without attention writes its mixer's output where an attention block writes attn_out
    writes = [trace.mixer_out[b] if b in trace.mixer_out else trace.attn_out[b] for b in range(trace.n_blocks)]
    recon = trace.resid_pre[0].to(acc) + sum(o.to(acc) for o in writes) + sum(o.to(acc) for o in trace.mlp_out)
    recon = recon + sum(w.to(acc) for w in stream_writes(adapter, trace))
    assert (recon - trace.final_resid.to(acc)).abs().max() <= reconstruction_tol(adapter, trace)
    norm_f = adapter.final_norm_layer()
    normed = norm_f(trace.final_resid[0])
    W_U, b_U = adapter.W_U.to(normed.dtype), adapter.b_U.to(normed.dtype)
    logit_terms = abs_terms(normed, W_U, b_U).max()
    tol = unembedding_tol(adapter, normed) + norm_replay_tol(norm_f, logit_terms, norm_dtype(adapter, trace))
    lens = normed @ W_U + b_U
    torch.testing.assert_close(lens, trace.logits[0].to(lens.dtype), atol=tol, rtol=0)


@torch.no_grad()
def forwards_tol(adapter, reference, n_keys: int) -> float:
    """How far two forwards of the adapter's model on the same inputs may be
    apart in ``reference`` (their logits) when they reduce in other orders (a
    padded batch against single runs, sdpa against eager attention, a longer
    input's prefix): :func:`tests.tolerances.forward_tol` over the decoder's
    reductions, each in the dtype the family runs it in (float32 norms and
    softmax in a float64 Llama, float64 throughout a float64 BLIP): per block two
    norms and two projections of ``d_model`` (the MLP's hidden width taken as
    ``4 d_model``) and a softmax over ``n_keys`` keys; then the final norm and
    the unembedding. The model's dtype is its weights', whatever ``reference``'s is.

    Args:
        reference: the size the errors are relative to: a float (the compared
            quantity's terms, e.g. :func:`logit_terms_bound`, or ``|x| |W_V|`` for a
            head's z), or a tensor of the compared values (their largest size; for
            logits, about half their terms in these models)."""
    dtype = adapter.W_U.dtype
    if not isinstance(reference, torch.Tensor):
        reference = torch.tensor([float(reference)])
    family = adapter.family
    d = adapter.d_model
    norm, softmax = step_dtype(family, dtype, "norm"), step_dtype(family, dtype, "softmax")
    per_block = (
        forward_tol(reference, norm, 2, d)
        + forward_tol(reference, softmax, 1, n_keys)
        + forward_tol(reference, dtype, 2, 4 * d)
    )
    return len(adapter.blocks) * per_block + forward_tol(reference, norm, 1, d) + forward_tol(reference, dtype, 1, d)


def frozen_map_terms(norm_f, x_ref: torch.Tensor, vectors: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``(n,)`` per vector ``c``, the size of the terms of ``u . frozen(x_ref, c)``:
    ``|c| @ |F| @ |u|`` with ``F`` the frozen map's matrix (its rows
    ``frozen(x_ref, e_k)``), so the centring, gains and scale are all counted."""
    d = x_ref.shape[-1]
    F = norm_f.frozen(x_ref, torch.eye(d, dtype=vectors.dtype, device=vectors.device))  # (d, d): row k = F e_k
    return (vectors.abs().to(F.dtype) @ F.abs()) @ u.abs().to(F.dtype)


@torch.no_grad()
def frozen_sum_tol(adapter, trace, position: int, answer_id: int, foil_id, batch: int = 0) -> float:
    """How far ``sum_c dla_frozen(c)`` may be from ``frozen_sum_expected`` (the
    model's logit difference through the norm, minus the biases).

    Each side is a dot product with ``u`` of ``n = depth * d_model + 4`` terms
    in the model's dtype, the components' sizes (``sum_c |c| |F| |u|``) on one
    side and x_L's on the other; and the model's norm rounds x_L and its output
    in the norm's own dtype (float32 for Llama-style RMSNorm even in a float64
    model, :data:`NORM_ROUNDINGS` times), which the frozen split, taken in the
    model's dtype, does not.

    In a half model both sides are read-outs accumulating in float32; the
    components sum to x_L only up to the model's roundings of its stream
    (:func:`stream_roundings`) and, where the stack is stored in the half dtype,
    one rounding of each component."""
    _, C = component_stack(adapter, trace, position, batch)
    x_L = trace.final_resid[batch, position]
    norm_f = adapter.final_norm_layer()
    acc = opmath_dtype(C.dtype)
    u = target_direction(adapter, answer_id, foil_id).to(acc)
    d = x_L.shape[-1]
    n = _FROZEN_MAP_DEPTH[norm_f.kind] * d + 4
    components = float(frozen_map_terms(norm_f, x_L, C, u).sum())
    whole = float(frozen_map_terms(norm_f, x_L, x_L[None], u)[0])
    bias_f = norm_f.frozen_bias(x_L)
    b_U = adapter.b_U.to(acc)
    biases = float(b_U[answer_id].abs() + (b_U[foil_id].abs() if foil_id is not None else 0))
    biases += float(bias_f.abs().to(acc) @ u.abs()) if bias_f is not None else 0.0
    # each side evaluates once, so gamma of both sides' terms (not sum_tol's two evaluations of one)
    half = half_rounding_tol(components, x_L.dtype, stream_roundings(adapter, trace))
    half += half_rounding_tol(components, C.dtype, 1)
    return (
        gamma(n, acc) * (components + whole + biases)
        + rounding_tol(whole, norm_dtype(adapter, trace), NORM_ROUNDINGS)
        + half
    )


@torch.no_grad()
def target_tol(adapter, trace, position: int, answer_id: int, foil_id=None, batch: int = 0) -> float:
    """How far decompose's ``target_logit`` (``norm(x_L) . u + u . b_U``) may be from
    the model's logit (difference): the same final norm (replayed), the unembedding
    summed in another order for each token, ``u``'s and the difference's roundings."""
    norm_f = adapter.final_norm_layer()
    normed = norm_f(trace.final_resid[batch, position])
    ids = [answer_id] + ([foil_id] if foil_id is not None else [])
    terms = float(abs_terms(normed, adapter.W_U[:, ids].to(normed.dtype)).sum())
    return (
        unembedding_tol(adapter, normed, ids) * len(ids)
        + rounding_tol(terms, normed.dtype, 2)
        + norm_replay_tol(norm_f, terms, norm_dtype(adapter, trace))
    )


def assert_decomposition_is_exact(adapter, trace, answer_id: int, foil_id=None, r=None):
    """decompose's three exactness claims at the answer position: the target is
    the model's own logit difference (the same norm; the unembedding summed in
    another order), the frozen split sums to it minus the biases
    (:func:`frozen_sum_tol`), and the components sum to x_L
    (:func:`stack_tol`). Returns the decomposition."""
    r = r if r is not None else decompose(adapter, trace, answer_id, foil_id)
    p = r.position
    logits = trace.logits[0, p]
    model_diff = float(logits[answer_id] - (logits[foil_id] if foil_id is not None else 0))
    assert r.target_logit == pytest.approx(model_diff, abs=target_tol(adapter, trace, p, answer_id, foil_id))
    tol = frozen_sum_tol(adapter, trace, p, answer_id, foil_id)
    assert sum(c.dla_frozen for c in r.components) == pytest.approx(r.frozen_sum_expected, abs=tol)
    assert r.reconstruction_max_abs_err <= stack_tol(adapter, trace, p)
    return r


@torch.no_grad()
def head_removal_tol(adapter, trace, block: int, position: int, batch: int = 0) -> float:
    """How far block ``block``'s write at ``position`` with one head zeroed (the
    model's output projection over the other heads) may be from the recorded
    write minus that head's ``W_O^h z^h``: the same terms summed in other orders,
    and a gate or LayerScale's product."""
    terms = head_write_terms(adapter, trace, block, [position], batch).max()
    z = trace.z[block]
    return sum_tol(terms, z.shape[-2] * z.shape[-1] + 3, z.dtype)


@torch.no_grad()
def removal_tol(adapter, trace, position: int, answer_id: int, foil_id, c: torch.Tensor, batch: int = 0) -> float:
    """How far a re-run without the last block's write ``c`` (``total_removal``)
    may be from recomputing the final norm on ``x_L - c`` (``direct_removal``).

    Nothing but the final norm follows that write, so the two differ only in
    rounding: the model's residual without ``c`` against ``x_L - c`` (two
    roundings in the model's dtype), the norm of those slightly different inputs
    (each may round differently in the norm's dtype: float32 for Llama-style
    RMSNorm), and the unembedding against ``@ u`` for the base and the edited run."""
    x_L = trace.final_resid[batch, position]
    norm_f = adapter.final_norm_layer()
    u = target_direction(adapter, answer_id, foil_id).to(x_L.dtype)
    ids = [answer_id] + ([foil_id] if foil_id is not None else [])
    terms = float(frozen_map_terms(norm_f, x_L, (x_L.abs() + c.abs())[None], u)[0])
    n = _FROZEN_MAP_DEPTH[norm_f.kind] * x_L.shape[-1] + 4
    dtype = norm_dtype(adapter, trace)
    return (
        2 * len(ids) * unembedding_tol(adapter, norm_f(x_L), ids)
        + rounding_tol(terms, dtype, 2 * NORM_ROUNDINGS)
        + 2 * norm_replay_tol(norm_f, terms, dtype)
        + sum_tol(terms, n, x_L.dtype)
    )


@torch.no_grad()
def jacobian_tol(adapter, trace, x_L: torch.Tensor, c: torch.Tensor, u: torch.Tensor) -> float:
    """How far the adapter's ``u . J(x_L) c`` may be from autograd's directional
    derivative through the model's norm: autograd differentiates the norm's own
    arithmetic (its float32 statistics, in a Llama-style model), the adapter the
    closed form in the model's dtype; the terms' sizes are ``|u| |J| |c|``."""
    norm_f = adapter.final_norm_layer()
    d = x_L.shape[-1]
    J = norm_f.jvp(x_L, torch.eye(d, dtype=x_L.dtype, device=x_L.device))  # (d, d): row k = J e_k
    terms = float((c.abs().to(J.dtype) @ J.abs()) @ u.abs().to(J.dtype))
    depth = _FROZEN_MAP_DEPTH[norm_f.kind]
    # autograd: the norm's own ops on the tangent (the d-term statistic's derivative, a few
    # products) in the norm's dtype; the closed form (vjp, then C @ w): two more d-term dots
    n_norm, n_model = depth * d + 6, (depth + 1) * d + 6
    return (gamma(n_norm, norm_dtype(adapter, trace)) + gamma(n_model, opmath_dtype(x_L.dtype))) * terms


def assert_jacobian_dla_is_autograd(adapter, trace, answer_id, foil_id, which=None):
    """u^T J_Norm(x_L) c equals autograd's directional derivative for a few components."""
    r = decompose(adapter, trace, answer_id, foil_id)
    x_L = trace.final_resid[0, r.position].detach()
    u = target_direction(adapter, answer_id, foil_id).detach()
    norm_f = adapter.final_norm_layer()
    names, C = component_stack(adapter, trace, r.position)
    acc = opmath_dtype(x_L.dtype)  # a half x_L: autograd's own backward would round its gradients to the half dtype
    for i in which or (0, 3, len(names) - 1):
        c = C[i].detach()
        _, d = torch.autograd.functional.jvp(lambda x: norm_f(x) @ u.to(acc), x_L.to(acc), c.to(acc))
        assert r.components[i].dla_jacobian == pytest.approx(float(d), abs=jacobian_tol(adapter, trace, x_L, c, u))
    return r, names


@torch.no_grad()
def scores_tol(x_q, x_k, W_Q, b_Q, W_K, b_K, scale: float, rotated: bool, input_rtol: float = 0.0) -> float:
    """How far pre-softmax scores recomputed from canonical weights may be from
    the model's (the same normed stream, products summed in other orders).

    ``s = scale * q . k``: q and k are each a ``(d_in + 1)``-term product, off by
    at most ``gamma`` of their terms ``|x| |W| + |b|``; RoPE mixes each
    coordinate with its rotate_half partner (``d_head / 2`` away) in three more
    roundings; the dot product adds ``d_head`` terms. To first order the score
    is off by ``gamma * scale * (terms(q) . |k| + |q| . terms(k) + |q| . |k|)``
    on each side.

    Args:
        x_q, x_k: ``(pos, d_in)`` the normed stream the queries and keys read.
        W_Q, W_K: ``(heads, d_in, d_head)``; b_Q, b_K: ``(heads, d_head)`` or None.
        input_rtol: how far, relative to their terms, the model's normed stream may
            be from ``x_q`` / ``x_k`` (another norm kernel: :func:`norm_replay_tol`).
    """

    def projected(x, W, b):  # (heads, pos, d_head): |values| and their terms, RoPE mixing bounded
        value = torch.einsum("pm,hmd->hpd", x, W) + (0 if b is None else b[:, None])
        terms = abs_terms(x, W, None if b is None else b[:, None])
        value = value.abs()
        if rotated:  # |x cos + rotate_half(x) sin| <= |x| + |partner|
            half = value.shape[-1] // 2
            value, terms = value + value.roll(half, -1), terms + terms.roll(half, -1)
        return value, terms

    q, q_terms = projected(x_q, W_Q, b_Q)
    k, k_terms = projected(x_k, W_K, b_K)
    mixed = q_terms @ k.transpose(-1, -2) + q @ k_terms.transpose(-1, -2) + q @ k.transpose(-1, -2)
    n = x_q.shape[-1] + 1 + 3 + q.shape[-1]
    terms = float(mixed.max()) * abs(scale)
    return sum_tol(terms, n, x_q.dtype) + 2 * input_rtol * terms


@torch.no_grad()
def realized_scores_tol(adapter, trace, block: int, batch: int = 0) -> float:
    """How far scores from :meth:`adapter.queries_keys` (canonical weights on the
    recorded stream) may be from the model's own (its recorded q and k).

    Without per-head q/k norms: :func:`scores_tol`, RoPE where the family rotates
    self-attention, the adapter's norm against the model's kernel. With them
    (Mllama's cross blocks): each normalised q and k may round differently in
    the norm's dtype (float32 even in a float64 model: a float64 difference in
    its input can land on the other side of a float32 rounding), then a
    ``d_head``-term dot product."""
    a = adapter
    x = a.attn_norm(block)(trace.resid_pre[block][batch])
    source = trace.kv_source[block]
    kv = x if source is None else a.kv_norm(block)(source[batch])
    scale = a.score_scale(block)
    if a.qk_gain(block) is not None:
        q, k = a.queries_keys(trace, block, batch)
        terms = float(torch.einsum("qhd,khd->hqk", q.abs(), k.abs()).max()) * abs(scale)
        return rounding_tol(terms, norm_dtype(a, trace), 2 * NORM_ROUNDINGS) + sum_tol(terms, a.d_head, q.dtype)
    rotated = source is None and a.position_scheme in ("rope", "mrope")
    input_rtol = norm_replay_tol(a.attn_norm(block), 1.0, x.dtype)
    return scores_tol(x, kv, a.W_Q(block), a.b_Q(block), a.W_K(block), a.b_K(block), scale, rotated, input_rtol)


@torch.no_grad()
def pattern_rtol(adapter, trace, scores: torch.Tensor, scores_error: float) -> float:
    """How far, relative to each weight, the pattern the model's attention took
    may be from a softmax of recomputed ``scores`` (``-inf`` where masked): its
    softmax runs in the family's softmax dtype (float32 under eager attention
    for transformers' models, whatever the model's dtype)."""
    return softmax_rtol(scores, step_dtype(adapter.family, trace.final_resid.dtype, "softmax"), scores_error)


@torch.no_grad()
def values_tol(pattern: torch.Tensor, x: torch.Tensor, W_V: torch.Tensor, b_V) -> float:
    """How far ``z = pattern @ (x W_V + b_V)`` recomputed may be from the model's
    (the same pattern; v a ``(d_in + 1)``-term product, then an ``n_keys``-term
    weighted sum, both in other orders).

    Args:
        pattern: ``(heads, n_query, keys)``; x: ``(keys, d_in)``;
        W_V: ``(heads, d_in, d_head)``; b_V: ``(heads, d_head)`` or None.
    """
    v = abs_terms(x, W_V, None if b_V is None else b_V[:, None])  # (heads, keys, d_head)
    terms = float((pattern.abs() @ v).max())
    return sum_tol(terms, x.shape[-1] + 1 + pattern.shape[-1], x.dtype)


@torch.no_grad()
def readout_terms(adapter, trace, answer_id: int, foil_id, position: int, batch: int = 0) -> dict[str, torch.Tensor]:
    """Per convention of a direct read-out ("projection", "dla_frozen",
    "dla_jacobian"), the ``(d_model,)`` vector ``|M|^T |u|`` whose dot product with
    ``|c|`` bounds the terms of that read-out of a write ``c`` (``M`` the identity,
    the frozen map, the Jacobian at x_L)."""
    x_L = trace.final_resid[batch, position]
    u = target_direction(adapter, answer_id, foil_id).to(x_L.dtype).abs()
    norm_f = adapter.final_norm_layer()
    eye = torch.eye(x_L.shape[-1], dtype=x_L.dtype, device=x_L.device)
    return {
        "projection": u,
        "dla_frozen": norm_f.frozen(x_L, eye).abs() @ u,
        "dla_jacobian": norm_f.jvp(x_L, eye).abs() @ u,
    }


@torch.no_grad()
def source_sum_tol(adapter, trace, block: int, head: int, position: int, read: torch.Tensor, batch: int = 0) -> float:
    """How far one head's source contributions, summed over sources, may be from
    the same read-out of the head's write in the decomposition: both are the
    value path ``A (x W_V + b_V) W_O . g`` summed in other orders (v from
    canonical weights on one side, the model's on the other; the same pattern and norm).

    Args:
        read: ``(d_model,)`` the convention's :func:`readout_terms` vector.
    """
    source = trace.kv_source[block]
    r = trace.resid_pre[block][batch] if source is None else source[batch]
    x = adapter.kv_norm(block)(r)  # (keys, d_in)
    qi = int((trace.query_positions == position).nonzero()[0])
    A = trace.patterns[block][batch, head, qi, : r.shape[0]].to(x.dtype).abs()  # (keys,)
    v = abs_terms(x, adapter.W_V(block)[head].to(x.dtype), adapter.b_V(block)[head].to(x.dtype))  # (keys, d_head)
    W_O = adapter.W_O(block)[head].to(x.dtype).abs()  # (d_head, d_model)
    terms = float(A @ v @ W_O @ read.to(x.dtype))
    n = x.shape[-1] + 1 + v.shape[-1] + W_O.shape[-1] + A.shape[-1] + 4
    return sum_tol(terms, n, x.dtype)


def assert_source_contributions_sum_to_each_heads_terms(
    adapter, trace, sc, r, fields=("projection", "dla_frozen", "dla_jacobian")
):
    """Summed over sources, each head's contributions equal its residual
    component ``r.components`` under each convention in ``fields``."""
    by_name = {c.name: c for c in r.components}
    reads = readout_terms(adapter, trace, r.answer_id, r.foil_id, sc.position)
    for block in trace.attention_blocks:
        name = trace.block_names[block]
        for h in range(adapter.n_heads):
            comp = by_name[f"{name}.H{h}"]
            for field in fields:
                got = float(getattr(sc, field)[block][h].sum())
                tol = source_sum_tol(adapter, trace, block, h, sc.position, reads[field])
                assert got == pytest.approx(getattr(comp, field), abs=tol), (block, h, field)


@torch.no_grad()
def lens_logit_tol(adapter, trace, position: int, token_ids, batch: int = 0) -> float:
    """How far the logit lens's last row (x_L through the final norm and the
    unembedding, reported in float32) may be from the model's logits of
    ``token_ids`` summed: the unembedding in another order, the norm replayed,
    and one float32 rounding per logit and per difference."""
    norm_f = adapter.final_norm_layer()
    normed = norm_f(trace.final_resid[batch, position])
    W = adapter.W_U[:, token_ids].to(normed.dtype)
    terms = float(abs_terms(normed, W).sum())
    logits = float(trace.logits[batch, position, token_ids].abs().sum())
    return (
        unembedding_tol(adapter, normed, token_ids) * len(token_ids)
        + norm_replay_tol(norm_f, terms, norm_dtype(adapter, trace))
        + rounding_tol(2 * logits, torch.float32)
    )


def assert_lens_last_row_is_the_model(adapter, trace, lens, answer_id: int, foil_id=None):
    """The lens's last row reads x_L: the model's own logit and logit
    difference, and KL to the final distribution exactly 0 (the final
    distribution is that same row)."""
    last, p = lens.rows[-1], lens.position
    logits = trace.logits[0, p]
    assert last.answer_logit == pytest.approx(
        float(logits[answer_id]), abs=lens_logit_tol(adapter, trace, p, [answer_id])
    )
    if foil_id is not None:
        diff = float(logits[answer_id] - logits[foil_id])
        assert last.logit_diff == pytest.approx(diff, abs=lens_logit_tol(adapter, trace, p, [answer_id, foil_id]))
    assert last.kl_to_final == 0.0


def capture_every_position(loaded, image, question: str):
    """``(trace, inputs)``: one default capture of ``question`` on ``image`` with every
    query position's pattern row and each block's attention output kept: what a
    family file's ``traced_case`` shares with the conformance checks."""
    from core.forward.capture import capture

    inputs = loaded.adapter.prepare([image], [question])
    n_pos = inputs.input_ids.shape[1]
    return capture(loaded, image, question, query_positions=range(n_pos), inputs=inputs, keep_attn_out=True), inputs


def noise_image(size: tuple[int, int], seed: int = 0) -> Image.Image:
    """A random RGB image of ``size = (width, height)``."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def module_hook_counts(model) -> list[tuple[int, int]]:
    """(forward hooks, forward pre-hooks) of every module: equal before and after a capture."""
    return [(len(mod._forward_hooks), len(mod._forward_pre_hooks)) for mod in model.modules()]


def invert_around_box_centre(pixels: np.ndarray, box, shrink: int = 5) -> np.ndarray:
    """A copy of ``pixels (height, width, 3)`` with the patch around ``box``'s
    centre inverted: half-extents of ``1 / shrink`` of the box (at least a pixel),
    clipped at the image's top-left edge. The geometry experiments' probe."""
    x0, y0, x1, y1 = box
    cx, cy = int((x0 + x1) / 2), int((y0 + y1) / 2)
    rx, ry = max(1, int((x1 - x0) / shrink)), max(1, int((y1 - y0) / shrink))
    out = pixels.copy()
    ys, xs = slice(max(0, cy - ry), cy + ry), slice(max(0, cx - rx), cx + rx)
    out[ys, xs] = 255 - out[ys, xs]
    return out


def projected_visual_tokens(loaded, image: Image.Image, question: str, *tensor_names: str) -> torch.Tensor:
    """``(n_visual, d_model)``: ``image``'s visual tokens as the decoder receives them
    (the library's ``get_image_features`` on the prepared tensors ``tensor_names``,
    in its argument order; every frame or tile in order)."""
    inputs = loaded.adapter.prepare([image], [question])
    with torch.no_grad():
        out = loaded.model.model.get_image_features(*(inputs.tensors.get(n) for n in tensor_names), return_dict=True)
    return torch.cat(list(out.pooler_output), dim=0)


@torch.no_grad()
def assert_recomputed_rows_are_eager(loaded, inputs) -> None:
    """The sdpa path's pattern rows (core/forward/attention_rows.py) against eager attention's own weights.

    1. On the same attention calls (one eager forward, recorded): every row
       :class:`core.forward.attention_rows.RecomputedRows` gives is the weights eager
       attention returned, to eager's float32 softmax rounding (``softmax_rtol``
       of the scores; masked weights 0 on both sides) and the queries and keys
       recorded are the ones an eager capture keeps (``keep_qk``), bitwise.
    2. Across runs: a default capture's rows (its attention calls went to sdpa,
       with sdpa's own masks: None for causal, bool, prefix-LM) are an eager
       capture's to within two forwards' distance (``forwards_tol``).

    Families without a fast path (``attention_functions`` False: BLIP, CoCa)
    compute the same pattern either way: the two captures agree bitwise."""
    from core.forward.attention_rows import RecomputedRows, recording
    from core.forward.capture import capture, eager_attention, hooks

    adapter = loaded.adapter
    n = inputs.input_ids.shape[1]
    rows = torch.arange(n)
    first = next(b for b, (_, kind) in enumerate(adapter.blocks) if kind in ("self", "cross"))
    sdpa = capture(loaded, None, "", inputs=inputs, query_positions=rows, keep_qk=[first])
    eager = capture(loaded, None, "", inputs=inputs, query_positions=rows, keep_qk=[first], attention="eager")
    assert sdpa.attention == "sdpa" and eager.attention == "eager"
    blocks = sdpa.attention_blocks
    if not adapter.attention_functions:
        for b in blocks:
            torch.testing.assert_close(sdpa.patterns[b], eager.patterns[b], atol=0, rtol=0)
        return
    recomputed, weights = {}, {}

    def on_call(block, call):
        r = RecomputedRows(call)
        recomputed[block] = (r.rows(rows), r.scores(rows), call)

    def weights_hook(block):
        def keep(module, args, out):
            weights[block] = out[1]

        return keep

    modules = {b: adapter.attention_module(b) for b in blocks}
    with eager_attention(loaded.model), hooks([(modules[b], "fwd", weights_hook(b)) for b in blocks]):
        with recording(modules, on_call) as seen:
            adapter.forward_logits(inputs)
    assert seen == set(blocks)
    call = recomputed[first][2]  # what the capture records as q / k: (batch, pos, heads, d_head)
    torch.testing.assert_close(call.query.transpose(1, 2), eager.q[first], atol=0, rtol=0)
    torch.testing.assert_close(call.key.transpose(1, 2), eager.k[first], atol=0, rtol=0)
    for b in blocks:
        got, scores, _ = recomputed[b]
        scores = scores.double().masked_fill(scores <= torch.finfo(scores.dtype).min / 2, float("-inf"))
        # eager's softmax runs in float32 and its weights are cast to the model's dtype (a half model's: one rounding)
        softmax = coarsest(weights[b].dtype, torch.float32)
        # a weight below the half dtype's normal range is rounded absolutely: half a subnormal step
        info = torch.finfo(weights[b].dtype)
        floor = info.smallest_normal * info.eps / 2 if weights[b].dtype in (torch.float16, torch.bfloat16) else 0.0
        torch.testing.assert_close(got, weights[b].to(got.dtype), atol=floor, rtol=softmax_rtol(scores, softmax))
        n_keys = got.shape[-1]
        # a weight moves by at most twice the largest score error, and the two runs' scores differ
        # relative to their own size: unscaled scores (Gemma 3n's scaling 1) are far larger than 1
        finite = scores[torch.isfinite(scores)]
        size = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
        tol = forwards_tol(adapter, size, n_keys)
        torch.testing.assert_close(sdpa.patterns[b], eager.patterns[b].to(sdpa.patterns[b].dtype), atol=tol, rtol=0)


@torch.no_grad()
def assert_queries_keys_are_the_models(m, trace, blocks, inputs) -> None:
    """``adapter.queries_keys`` of ``trace`` gives the model's own scores at each of ``blocks``
    (every attention layer): the q and k its attention function received on ``inputs`` (the
    trace's input), grouped keys expanded, each scaled as that layer scales its scores."""
    from core.forward.capture import capture

    a = m.adapter
    kept = capture(m, None, "", inputs=inputs, keep_qk=True)
    assert sorted(kept.q) == sorted(blocks)
    for block in blocks:
        q, k = a.queries_keys(trace, block)
        model_k = kept.k[block][0].repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)
        ours = torch.einsum("qhd,khd->hqk", q, k) * a.score_scale(block)
        theirs = torch.einsum("qhd,khd->hqk", kept.q[block][0], model_k) * kept.score_scale[block]
        torch.testing.assert_close(ours, theirs, atol=realized_scores_tol(a, trace, block), rtol=0)
