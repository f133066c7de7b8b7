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

from core.answer_text import AnswerText, run_parameters
from core.errors import UndefinedReadoutError
from core.results.audit import AuditRecord
from core.shell.precision import accumulating


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
    # the tokens both read in and written out: an embedding can hold rows the unembedding has no
    # column for (Mllama's image token)
    T = list(range(min(E.shape[0], adapter.W_U.shape[1]))) if tokens is None else list(tokens)
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
    # half-precision q and k summed in float32, as the model's attention kernel does
    q = accumulating(trace.q[block][batch])  # (pos, heads, d)
    k = accumulating(trace.k[block][batch])  # (keys, kv_heads, d)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.einsum("qhd,khd->hqk", q, k) * trace.score_scale[block]


# ---------------------------------------------------------------- one head, both levels (vlm-readout qk-ov)

SCHEMA_VERSION = 1
# Above this many tokens the whole-vocabulary copying matrix (|V| x |V|, and its
# eigenvalues) is too large to compute by default: name the tokens instead.
COPYING_VOCAB_LIMIT = 2048
WEIGHT_FLAG = "weight level: position-free, no input"
ACTIVATION_FLAG = "activation level: this input, with the position scheme (RoPE/M-RoPE)"


def head_of(adapter, name: str) -> tuple[int, str, int]:
    """``(block, block name, head)`` of a head name such as ``L1.H2``
    (:func:`core.methods.component_ablation.parse_head`)."""
    from core.methods.component_ablation import parse_head

    head = parse_head(name, adapter)
    return head.block, adapter.blocks[head.block][0], head.head


@dataclass
class QkOvResult:
    """One head's QK and OV read-outs: the weight level (what it can select and
    write, position-free, no input) kept apart from the activation level (the
    scores it realised at the answer row of one input), as docs/METHODS.md §4.3 asks.

    Attributes:
        head: ``{"name", "block", "block_name", "block_kind", "head"}``.
        weight_level: ``{"flag", "qk", "ov", "copying", "copying_skipped"}``.
        activation_level: None without an input, else ``{"flag", "position",
            "scores", "allowed", "pattern", "top_keys", "agreement"}``.
        input: None without an input, else the question, image hash and size,
            the answer tokens read at.
    """

    model: dict
    head: dict
    weight_level: dict
    activation_level: dict | None = None
    input: dict | None = None
    audit: list[AuditRecord] = field(default_factory=list, repr=False)

    kind = "qk-ov"  # the session's run kind (core.results.readout.Readout)

    def to_dict(self) -> dict:
        """The ``qk-ov`` JSON (schema version 1)."""
        from core.results.readout import jsonable

        return {
            "schema_version": SCHEMA_VERSION,
            "kind": self.kind,
            "model": jsonable(self.model),
            "head": dict(self.head),
            "input": jsonable(self.input),
            "weight_level": jsonable(self.weight_level),
            "activation_level": jsonable(self.activation_level),
            "audit": [a.to_dict() for a in self.audit],
        }

    @classmethod
    def from_dict(cls, d: dict) -> QkOvResult:
        return cls(
            d["model"],
            d["head"],
            d["weight_level"],
            d.get("activation_level"),
            d.get("input"),
            [AuditRecord.from_dict(a) for a in d.get("audit", [])],
        )

    @property
    def name(self) -> str:
        """The head as named (``L1.H2``)."""
        return self.head["name"]

    @property
    def block_kind(self) -> str:
        """``self`` or ``cross``: the attention the head is part of."""
        return self.head["block_kind"]

    @property
    def block_and_head(self) -> tuple[int, int]:
        """``(block index, head index)``."""
        return int(self.head["block"]), int(self.head["head"])

    def weight_lines(self) -> list[str]:
        """The weight level as lines: the flag, QK and OV singular values, the copying score."""
        w = self.weight_level
        qk, ov = w["qk"], w["ov"]
        lines = [
            w["flag"],
            f"QK {qk['form']}: singular values {', '.join(f'{s:.3g}' for s in qk['singular_values'][:5])} "
            f"(left out: {qk['left_out']})",
            f"OV {ov['form']}: singular values {', '.join(f'{s:.3g}' for s in ov['singular_values'][:5])}"
            if ov["singular_values"] is not None
            else f"OV not defined: {ov['not_defined']}",
        ]
        copying = w.get("copying")
        if copying is not None:
            lines.append(f"copying score {copying['eigen_copying']:+.3f} over {len(copying['tokens'])} tokens")
        else:
            lines.append(f"copying score skipped: {w.get('copying_skipped')}")
        return lines

    def activation_lines(self) -> list[str]:
        """The activation level as lines: the flag, the top keys, the check against the model's scores."""
        act = self.activation_level
        if act is None:
            return ["no input: the weight level only"]
        lines = [act["flag"], f"answer position {act['position']} ({act['position_scheme']}); keys: {act['keys']}"]
        for k in act["top_keys"]:
            lines.append(
                f"  key {k['key']} {k['token']!r} ({k['role']}): weight {k['weight']:.3f}, score {k['score']:+.3f}"
            )
        agreement = act["agreement"]
        lines.append(
            f"against {agreement['against']}: max |score diff| {agreement['max_abs_score_difference']:.2e}, "
            f"max |pattern diff| {agreement['max_abs_pattern_difference']:.2e}"
        )
        return lines

    def summary(self) -> str:
        w = self.weight_level
        parts = [
            f"{self.head['name']} ({self.head['block_kind']}): QK sigma_1 {w['qk']['singular_values'][0]:.3f}",
            f"OV sigma_1 {w['ov']['singular_values'][0]:.3f}"
            if w["ov"]["singular_values"] is not None
            else "OV not defined",
        ]
        if w["copying"] is not None:
            parts.append(
                f"copying {w['copying']['eigen_copying']:+.3f} over {len(w['copying']['tokens'])} tokens (weight level)"
            )
        act = self.activation_level
        if act is not None:
            top = act["top_keys"][0]
            parts.append(
                f"at position {act['position']}: top key {top['key']} ({top['token']!r}) weight {top['weight']:.3f}, "
                f"scores vs the model's max |diff| {act['agreement']['max_abs_score_difference']:.2e}"
            )
        return ", ".join(parts)

    def parameters(self) -> dict:
        out = {"head": self.head["name"], "block": self.head["block"], "head_index": self.head["head"]}
        copying = self.weight_level.get("copying")
        out["n_copy_tokens"] = len(copying["tokens"]) if copying is not None else 0
        if self.input is not None:
            out.update(question=self.input["question"], position=self.activation_level["position"])
            out.update(run_parameters(AnswerText.from_dict(self.input)))
        return out

    def audit_records(self) -> list[AuditRecord]:
        return list(self.audit)


def _weight_level(adapter, block: int, head: int, copy_tokens: list[int] | None) -> tuple[dict, list[AuditRecord]]:
    qk = qk_circuit(adapter, block, head)
    try:
        ov, ov_refused = ov_circuit(adapter, block, head), None
    except UndefinedReadoutError as e:  # no linear value map (Gemma 3n's per-head value norm): QK stands alone
        ov, ov_refused = None, str(e)
    audits = [
        AuditRecord.for_method(
            "qk/ov circuit",
            controls=["biases and the position scheme left out of QK", "factored SVD (no d_model x d_model matrix)"],
            parameters={"block": block, "head": head, "level": "weight"},
            notes=["weight-level potential: what the head can select and write, not what it did on an input"]
            + (
                [
                    f"the head's output is multiplied before W_O by an input-dependent gate ({adapter.head_output_gate}): "
                    "the OV map and copying score here are the ungated map, not what the head writes"
                ]
                if adapter.head_output_gate
                else []
            ),
        )
    ]
    copying, skipped = None, None
    vocab = adapter.W_U.shape[1]
    if ov_refused is not None:
        skipped = f"not defined: {ov_refused}"
        audits.append(
            AuditRecord.not_defined("qk/ov circuit", ov_refused, {"block": block, "head": head, "part": "OV"})
        )
    elif adapter.blocks[block][1] != "self":
        skipped = "cross-attention head: its values are visual tokens, not token embeddings"
    elif copy_tokens is None and vocab > COPYING_VOCAB_LIMIT:
        skipped = f"vocabulary of {vocab} tokens (over {COPYING_VOCAB_LIMIT}): name the tokens to score"
    else:  # copy_tokens None: copying_score's default, every token both embedded and unembedded
        score = copying_score(adapter, block, head, copy_tokens)
        copying = {**score.to_dict(), "token_strings": [adapter.token_str(t) for t in score.tokens]}
        audits.append(score.audit)
    level = {
        "flag": WEIGHT_FLAG,
        "qk": {
            "form": "W_Q[h] W_K[h]^T * scale" + ("" if adapter.qk_gain(block) is None else " * the q/k norm gains"),
            "score_scale": float(adapter.score_scale(block)),
            "singular_values": qk.singular_values.tolist(),
            "left_out": "biases and the position scheme (" + str(adapter.position_scheme) + ")",
        },
        "ov": {
            "form": "W_V[h] W_O[h]"
            + (" (ungated: the model gates each query's output first)" if adapter.head_output_gate else ""),
            "singular_values": ov.singular_values.tolist() if ov is not None else None,
            **({"not_defined": ov_refused} if ov_refused is not None else {}),
        },
        "copying": copying,
        "copying_skipped": skipped,
    }
    return level, audits


@torch.no_grad()
def _activation_level(loaded, trace, block: int, head: int, top_k: int) -> tuple[dict, AuditRecord]:
    adapter = loaded.adapter
    position = int(trace.answer_positions[0])
    realised = realized_scores(adapter, trace, block, torch.tensor([position]))
    scores, allowed, pattern = realised.scores[head, 0], realised.allowed[0], realised.pattern[head, 0]
    theirs = model_scores(trace, block)[head, position].to(scores.dtype)
    recorded = trace.patterns[block][0, head, trace.query_positions.tolist().index(position)].to(pattern.dtype)
    score_diff = float((scores - theirs).abs()[allowed].max())
    pattern_diff = float((pattern - recorded).abs().max())
    cross = trace.kv_source[block] is not None
    visual = set(trace.visual_positions[0].tolist())
    ids = trace.input_ids[0].tolist()

    def describe(key: int) -> dict:
        if cross:  # the keys are the image's tokens (the kv source), not the text stream
            return {"role": "visual", "token": f"<visual {key}>"}
        return {"role": "visual" if key in visual else "text", "token": adapter.token_str(ids[key])}

    order = pattern.argsort(descending=True)[: min(top_k, int(allowed.sum()))].tolist()
    level = {
        "flag": ACTIVATION_FLAG,
        "position": position,
        "position_scheme": adapter.position_scheme,
        "keys": "visual tokens (cross-attention)" if cross else "sequence positions",
        "scores": scores.tolist(),
        "allowed": allowed.tolist(),
        "pattern": pattern.tolist(),
        "top_keys": [{"key": k, "score": float(scores[k]), "weight": float(pattern[k]), **describe(k)} for k in order],
        "agreement": {
            "max_abs_score_difference": score_diff,
            "max_abs_pattern_difference": pattern_diff,
            "against": "the model's own pre-softmax scores (its recorded q, k) and its recorded pattern",
        },
    }
    return level, realised.audit


@torch.no_grad()
def qk_ov(
    loaded,
    head_name: str,
    image=None,
    question: str | None = None,
    *,
    copy_tokens: list[int] | None = None,
    raw_prompt: bool = False,
    answer_text=None,
    top_k: int = 5,
) -> QkOvResult:
    """Both levels of one head (``L1.H2``): the weight-level QK form, OV map,
    their singular values and the copying score (over ``copy_tokens``, default
    the whole vocabulary up to :data:`COPYING_VOCAB_LIMIT` tokens); with an
    image and a question, the activation-level scores of the answer row
    (``answer_text``: at one of its tokens, teacher forcing), recomputed with the
    position scheme and checked against the model's own."""
    from core.errors import QuestionError

    adapter = loaded.adapter
    block, block_name, head = head_of(adapter, head_name)
    if (image is None) != (question is None):
        raise QuestionError("the activation level needs both an image and a question (or neither, weight level only)")
    weight_level, audits = _weight_level(adapter, block, head, copy_tokens)
    activation_level = inputs_doc = None
    if image is not None:
        from core.files.images import image_sha256, load_image
        from core.forward.capture import capture

        img = load_image(image)
        prefix = answer_text.prefix_ids if answer_text is not None else ()
        inputs = adapter.prepare([img], [question], raw_prompt=raw_prompt, answer_prefix=prefix)
        trace = capture(loaded, img, question, pattern_layers=[block], keep_qk=[block], inputs=inputs)
        activation_level, audit = _activation_level(loaded, trace, block, head, top_k)
        audits.append(audit)
        inputs_doc = {
            "question": question,
            "raw_prompt": raw_prompt,
            "image_sha256": image_sha256(img),
            "image_size": list(img.size),
            **(answer_text.to_dict() if answer_text is not None else {}),
            **adapter.dtype_and_device(),
        }
    return QkOvResult(
        model={"spec": loaded.spec, "fingerprint": loaded.fingerprint, **adapter.describe()},
        head={
            "name": f"{block_name}.H{head}",
            "block": block,
            "block_name": block_name,
            "block_kind": adapter.blocks[block][1],
            "head": head,
        },
        weight_level=weight_level,
        activation_level=activation_level,
        input=inputs_doc,
        audit=audits,
    )
