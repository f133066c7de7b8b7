"""QK and OV circuits (docs/METHODS.md §4.3): what a head *can* select and write
(weight level) next to what it *did* on this input (activation level).

Row-vector convention throughout (as TransformerLens): ``q = Norm(r) W_Q + b_Q``,
a head's write is ``z W_O``.

* QK bilinear form, position-free: ``s = x_p W_Q W_K^T x_j^T / sqrt(d_h)``
  (biases and the position scheme ignored), returned in factored form with its
  singular values.
* RoPE-aware score: ``s_{p,j} = (R_p q_p) . (R_j k_j) * scale``, i.e.
  ``r_p^T W_Q^T R_p^T R_j W_K r_j / sqrt(d_h)`` with biases, recomputed from the
  captured residuals (M-RoPE for Qwen). It equals the model's own pre-softmax
  scores; :func:`realized_scores` reconstructs them.
* OV map ``W_V W_O`` ``(d_model, d_model)`` with its SVD (rank <= d_head), and
  the token-copying circuit ``Norm(E) W_V W_O W_U`` over a token set.

Weight-level results are *potential*; only the activation-level ones say what
happened on a real input, and neither says the head is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.audit import AuditRecord


@dataclass
class LowRankMap:
    """A ``(d_model, d_model)`` map ``left @ right`` kept in factored form.

    Attributes:
        left: ``(d_model, d_head)``.
        right: ``(d_head, d_model)``.
        singular_values: ``(d_head,)`` descending.
        U: ``(d_model, d_head)`` left singular vectors.
        Vh: ``(d_head, d_model)`` right singular vectors (rows).
        level: "weight" (potential) or "activation" (realized on an input).
    """

    block: int
    head: int
    left: torch.Tensor
    right: torch.Tensor
    singular_values: torch.Tensor
    U: torch.Tensor
    Vh: torch.Tensor
    level: str = "weight"

    def full(self) -> torch.Tensor:
        """The dense ``(d_model, d_model)`` matrix (small models only)."""
        return self.left @ self.right

    def to_dict(self) -> dict:
        return {
            "block": self.block,
            "head": self.head,
            "level": self.level,
            "singular_values": self.singular_values.tolist(),
        }


def factored_svd(left: torch.Tensor, right: torch.Tensor):
    """SVD of ``left @ right`` (``(m, r) @ (r, n)``, r small) without forming it:
    QR of both factors, SVD of the ``(r, r)`` core."""
    ql, rl = torch.linalg.qr(left)
    qr_, rr = torch.linalg.qr(right.T)
    u, s, vh = torch.linalg.svd(rl @ rr.T)
    return ql @ u, s, vh @ qr_.T


def qk_circuit(adapter, block: int, head: int) -> LowRankMap:
    """The position-free QK form ``W_Q[h] W_K[h]^T * scale`` (biases and the
    position scheme left out: it is the full selection rule only for a
    position-free model; see :func:`realized_scores` for the real one). With
    per-head q/k norms their gains are folded in, and each real score is
    further divided by rms(q) rms(k): the form gives the direction only."""
    left = adapter.W_Q(block)[head].float() * adapter.score_scale(block)
    gain = adapter.qk_gain(block)  # per-head q/k RMSNorm gains (Mllama's cross blocks)
    if gain is not None:
        left = left * gain.float()
    right = adapter.W_K(block)[head].float().T
    U, s, Vh = factored_svd(left, right)
    return LowRankMap(block, head, left, right, s, U, Vh)


def ov_circuit(adapter, block: int, head: int) -> LowRankMap:
    """The OV map ``W_V[h] W_O[h]`` ``(d_model, d_model)``: what the head writes
    for a (normed) source vector, before the attention weight."""
    left = adapter.W_V(block)[head].float()
    right = adapter.W_O(block)[head].float()
    U, s, Vh = factored_svd(left, right)
    return LowRankMap(block, head, left, right, s, U, Vh)


@dataclass
class CopyingScore:
    """The token circuit ``M = Norm(E[T]) W_V W_O W_U[:, T]`` over tokens ``T``.

    Attributes:
        tokens: the token ids ``T``.
        matrix: ``(|T|, |T|)``: row i is the logit boost each token gets when
            the head attends to token i's embedding.
        eigen_copying: ``sum(lambda) / sum(|lambda|)`` over M's eigenvalues
            (+1: pure copying, -1: pure suppression), as in Elhage et al.
        diagonal_top1: share of tokens whose own logit is the largest in their row.
    """

    block: int
    head: int
    tokens: list[int]
    matrix: torch.Tensor
    eigen_copying: float
    diagonal_top1: float
    audit: AuditRecord = field(repr=False, default=None)

    def to_dict(self) -> dict:
        return {
            "block": self.block,
            "head": self.head,
            "tokens": self.tokens,
            "eigen_copying": self.eigen_copying,
            "diagonal_top1": self.diagonal_top1,
        }


def embedding_matrix(adapter) -> torch.Tensor:
    """``(vocab, d_model)`` the input embedding as the first block reads it
    (families that scale embeddings return the scaled rows)."""
    return adapter.input_embeddings().float()


@torch.no_grad()
def copying_score(adapter, block: int, head: int, tokens: list[int] | None = None) -> CopyingScore:
    """Embedding -> (the block's norm) -> OV -> unembedding for the tokens
    ``tokens`` (default: the whole vocabulary, fine for small vocabularies; pass
    the answer set for large ones). The final norm's gain is folded into W_U and
    its scale ignored: a weight-level potential, not what happens in context."""
    E = embedding_matrix(adapter)
    T = list(range(E.shape[0])) if tokens is None else list(tokens)
    x = (
        adapter.attn_norm(block)(E[T].to(adapter.W_V(block).dtype)).float()
        if adapter.blocks[block][1] == "self"
        else None
    )
    if x is None:
        raise ValueError("copying is defined for self-attention heads (cross-attention values are visual tokens)")
    ov = ov_circuit(adapter, block, head)
    norm_f = adapter.final_norm_layer()
    W_U = adapter.W_U.float()[:, T]
    if norm_f.weight is not None:
        W_U = W_U * (norm_f.weight_offset + norm_f.weight.float()).view(-1, 1)
    M = (x @ ov.left) @ (ov.right @ W_U)
    eig = torch.linalg.eigvals(M)
    eigen_copying = float(eig.real.sum() / eig.abs().sum().clamp_min(1e-12))
    diagonal_top1 = float((M.argmax(-1) == torch.arange(len(T))).float().mean())
    audit = AuditRecord.for_method(
        "qk/ov circuit",
        controls=["attention-block norm applied to embeddings", "final-norm gain folded into W_U, scale ignored"],
        parameters={"block": block, "head": head, "n_tokens": len(T), "level": "weight"},
        notes=["weight-level potential: says what the head could copy, not that it does on natural inputs"],
    )
    return CopyingScore(block, head, T, M, eigen_copying, diagonal_top1, audit)


@dataclass
class RealizedScores:
    """Pre-softmax scores of every head in one block, recomputed from the
    captured residuals with the canonical weights and the position scheme.

    Attributes:
        scores: ``(heads, n_query, keys)`` before the mask.
        allowed: ``(n_query, keys)`` bool, the mask the model applies.
        pattern: ``(heads, n_query, keys)`` softmax over the allowed keys.
        query_positions: ``(n_query,)``.
    """

    block: int
    query_positions: torch.Tensor
    scores: torch.Tensor
    allowed: torch.Tensor
    pattern: torch.Tensor
    level: str = "activation"
    audit: AuditRecord = field(repr=False, default=None)


@torch.no_grad()
def realized_scores(
    adapter, trace, block: int, query_positions: torch.Tensor | None = None, batch: int = 0
) -> RealizedScores:
    """``s_{p,j} = (R_p (W_Q Norm(r_p) + b_Q)) . (R_j (W_K Norm(r_j) + b_K)) * scale``.

    Args:
        query_positions: ``(n_query,)`` (default: the trace's kept query positions).
    """
    qpos = trace.query_positions if query_positions is None else torch.as_tensor(query_positions)
    q, k = adapter.queries_keys(trace, block, batch)  # (pos, heads, d), (keys, heads, d)
    scores = torch.einsum("qhd,khd->hqk", q[qpos], k) * adapter.score_scale(block)
    scores = adapter.score_transform(block, scores)
    allowed = adapter.allowed_keys(trace, block, batch)[qpos]
    pattern = scores.masked_fill(~allowed.to(scores.device), float("-inf")).softmax(-1)
    audit = AuditRecord.for_method(
        "qk/ov circuit",
        controls=["biases included", f"position scheme applied ({adapter.position_scheme})", "model's mask applied"],
        parameters={"block": block, "query_positions": qpos.tolist(), "level": "activation"},
        notes=["realized on this input: why the pattern is what it is, not whether the head matters"],
    )
    return RealizedScores(block, qpos, scores, allowed, pattern, audit=audit)


def model_scores(trace, block: int, batch: int = 0) -> torch.Tensor:
    """The model's own pre-softmax scores ``(heads, pos, keys)`` from the q/k a
    capture recorded (``keep_qk``), grouped keys expanded; before the mask."""
    if block not in trace.q:
        raise ValueError(f"capture with keep_qk to record block {block}'s queries and keys")
    q, k = trace.q[block][batch], trace.k[block][batch]  # (pos, heads, d), (keys, kv_heads, d)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.einsum("qhd,khd->hqk", q, k) * trace.score_scale[block]
