"""Evaluating a tuned lens beside its baselines on the same held-out tokens
(:func:`evaluate_lens`, :class:`LensEvaluation`) and storing the result in the
lens's report (:func:`attach_evaluation`).

Metrics per layer and reader, pooled over the chosen tokens: ``kl_bits``
(KL(final || lens) in bits), ``cross_entropy`` (bits, against the model's
own greedy next token at each position), ``top1_agreement`` (share of
tokens whose lens top-1 is the final top-1), ``answer_rank_mean`` (rank of
the answer token at the answer position, 0 = top; the answer is the pair's
given answer, else the model's own top-1 there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from core.errors import oom_guard
from core.methods.tuned_lens.data import Batch, _captured, position_mask
from core.methods.tuned_lens.lens import (
    POSITION_SETS,
    SCHEMA_VERSION,
    Cancel,
    LensError,
    Progress,
    TunedLens,
    _kl_nats,
)
from core.methods.tuned_lens.readers import _reader_logits, _readers, lens_audit
from core.results.audit import AuditRecord
from core.shell.precision import accumulating

LN2 = math.log(2.0)


@dataclass
class ReaderMetrics:
    """One reader at one layer, pooled over tokens.

    Attributes:
        kl_bits: mean KL(final || lens) in bits.
        cross_entropy: mean cross-entropy in bits against the model's own greedy next token.
        top1_agreement: share of tokens whose lens top-1 is the final top-1.
        answer_rank_mean: mean rank of the answer token at the answer position (0 = top).
        n_tokens: tokens pooled.
    """

    kl_bits: float | None
    cross_entropy: float | None
    top1_agreement: float | None
    answer_rank_mean: float | None
    n_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ReaderMetrics:
        return cls(d["kl_bits"], d["cross_entropy"], d["top1_agreement"], d["answer_rank_mean"], int(d["n_tokens"]))


class _Acc:
    def __init__(self):
        self.kl = self.ce = self.agree = 0.0
        self.n = 0
        self.rank = 0.0
        self.n_rank = 0

    def metrics(self) -> ReaderMetrics:
        n = self.n
        return ReaderMetrics(
            self.kl / n / LN2 if n else None,
            self.ce / n / LN2 if n else None,
            self.agree / n if n else None,
            self.rank / self.n_rank if self.n_rank else None,
            n,
        )


@dataclass
class LensEvaluation:
    """Every reader at every layer on one set of pairs, by token group.

    Attributes:
        lens: :meth:`TunedLens.summary`.
        data: what was evaluated (source, split, n_samples).
        primary: the token group of ``layers`` (the lens's training positions by default).
        layers: per row (``n_blocks + 1``, the last is x_L): ``{"layer", "block",
            "readers": {reader: ReaderMetrics}, "by_positions": {group: {reader: ReaderMetrics}}}``.
        audit: the tuned-lens audit row.
    """

    lens: dict
    data: dict
    primary: str
    layers: list[dict]
    audit: AuditRecord = field(repr=False, default=None)

    def kl_table(self, group: str | None = None) -> dict[str, list[float | None]]:
        """``{reader: [kl_bits per layer]}`` (``layer`` too) for ``group`` (default: primary)."""
        out: dict[str, list] = {"layer": [r["layer"] for r in self.layers], "block": [r["block"] for r in self.layers]}
        for reader in self.readers():
            col = []
            for row in self.layers:
                src = row["readers"] if group in (None, self.primary) else row["by_positions"].get(group, {})
                m = src.get(reader)
                col.append(None if m is None else m.kl_bits)
            out[reader] = col
        return out

    def readers(self) -> list[str]:
        return list(self.layers[0]["readers"]) if self.layers else []

    kind = "lens"  # the session's run kind (core.results.readout.Readout)

    def summary(self) -> str:
        """``lens on 64 samples (answer): mean KL over layers, bits: trained 0.412, identity 2.310, ...``."""
        means = []
        for reader, col in self.kl_table().items():
            if reader in ("layer", "block"):
                continue
            vals = [v for v in col if v is not None]
            means.append(f"{reader} {sum(vals) / len(vals):.3f}" if vals else f"{reader} n/a")
        n = self.data.get("n_samples")
        return f"lens on {n} samples ({self.primary}): mean KL over layers, bits: " + ", ".join(means)

    def parameters(self) -> dict:
        return {"positions": self.primary, **self.data}

    def audit_records(self) -> list[AuditRecord]:
        return [self.audit] if self.audit else []

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "lens": self.lens,
            "data": self.data,
            "positions": self.primary,
            "units": {
                "kl_bits": "bits",
                "cross_entropy": "bits, against the model's own greedy next token",
                "top1_agreement": "share of tokens whose lens top-1 is the model's final top-1",
                "answer_rank_mean": "mean rank of the answer token at the answer position (0 = top); the answer "
                "is the pair's given answer, else the model's own top-1",
            },
            "layers": [
                {
                    "layer": row["layer"],
                    "block": row["block"],
                    "readers": {k: v.to_dict() for k, v in row["readers"].items()},
                    "by_positions": {
                        g: {k: v.to_dict() for k, v in rs.items()} for g, rs in row["by_positions"].items()
                    },
                }
                for row in self.layers
            ],
            "audit": [self.audit.to_dict()] if self.audit else [],
        }

    @classmethod
    def from_dict(cls, d: dict) -> LensEvaluation:
        """The evaluation a ``lens`` JSON (:meth:`to_dict`, a stored run's) describes."""

        def readers(by_reader: dict) -> dict[str, ReaderMetrics]:
            return {name: ReaderMetrics.from_dict(m) for name, m in by_reader.items()}

        layers = [
            {
                "layer": row["layer"],
                "block": row["block"],
                "readers": readers(row["readers"]),
                "by_positions": {group: readers(rs) for group, rs in row["by_positions"].items()},
            }
            for row in d["layers"]
        ]
        audits = d.get("audit") or []
        return cls(
            dict(d["lens"]),
            dict(d["data"]),
            str(d["positions"]),
            layers,
            AuditRecord.from_dict(audits[0]) if audits else None,
        )

    def markdown(self, group: str | None = None) -> str:
        """The per-layer KL table (bits), one column per reader."""
        t = self.kl_table(group)
        readers = [r for r in t if r not in ("layer", "block")]
        lines = ["| layer | block | " + " | ".join(readers) + " |", "|---|---|" + "---|" * len(readers)]
        for i, layer in enumerate(t["layer"]):
            cells = ["-" if t[r][i] is None else f"{t[r][i]:.4f}" for r in readers]
            lines.append(f"| {layer} | {t['block'][i]} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


@torch.no_grad()
def evaluate_lens(
    loaded,
    lens: TunedLens,
    corpus,
    n: int | None = None,
    *,
    groups: Sequence[str] = POSITION_SETS,
    primary: str | None = None,
    batch_size: int = 16,
    extra_readers: bool = True,
    progress: Progress = None,
    cancel: Cancel = None,
) -> LensEvaluation:
    """Evaluate the trained lens and its baselines on the same tokens.

    Args:
        corpus: anything with ``take(n) -> Batch`` and ``describe()``.
        n: pairs to evaluate (None: all of a pairs corpus).
        groups: token groups reported in ``by_positions``.
        primary: the group of ``layers[*]["readers"]`` (default: the lens's training positions).
        extra_readers: also the ``orthogonal`` reader (affine / low-rank).
    """
    lens.check_model(loaded)
    adapter = loaded.adapter
    primary = primary or lens.training_info.get("config", {}).get("positions") or "all"
    groups = list(dict.fromkeys([primary, *groups]))
    for g in groups:
        if g not in POSITION_SETS:
            raise LensError(f"unknown positions {g!r}; expected one of {', '.join(POSITION_SETS)}")
    readers = _readers(lens, extra_readers)
    nb = lens.n_blocks
    acc = {g: [{r: _Acc() for r in readers} for _ in range(nb + 1)] for g in groups}
    rank_acc = [{r: _Acc() for r in readers} for _ in range(nb + 1)]
    data = corpus.take(n) if n is not None else corpus.take()
    total = len(data.questions)
    if total == 0:
        raise LensError("nothing to evaluate: no pairs")
    done = 0
    for start in range(0, total, batch_size):
        if cancel is not None and cancel():
            break
        sl = slice(start, start + batch_size)
        batch = Batch(data.images[sl], data.questions[sl], data.answers[sl])
        with oom_guard(f"evaluating the lens on a batch of {len(batch.questions)}"):
            trace = _captured(loaded, batch)
            dev = trace.final_resid.device
            b = trace.input_ids.shape[0]
            ans_pos = trace.answer_positions.to(dev)
            rows = torch.arange(b, device=dev)
            final_ans = trace.logits[rows, ans_pos]  # (b, vocab)
            ans_ids = final_ans.argmax(-1)
            for i, given in enumerate(batch.answers):
                if given:
                    ans_ids[i] = adapter.token_id(given)
            masks = {g: position_mask(adapter, trace, g).to(dev) for g in groups}
            final_logp_all = trace.logits.float().log_softmax(-1)  # (b, pos, vocab)
            greedy = final_logp_all.argmax(-1)  # (b, pos)
            states = [*trace.resid_pre, trace.final_resid]
            for layer in range(nb + 1):
                x = accumulating(states[layer])  # (b, pos, d)
                for name, reader in readers.items():
                    if layer == nb and name not in ("identity", "mean", "trained"):
                        continue  # no translator at x_L: the random/orthogonal readers are undefined there
                    logits = _reader_logits(adapter, lens, name, reader, layer, x).float()  # (b, pos, vocab)
                    logp = logits.log_softmax(-1)
                    kl = _kl_nats(final_logp_all, logp)  # (b, pos)
                    ce = -logp.gather(-1, greedy[..., None])[..., 0]
                    agree = (logp.argmax(-1) == greedy).double()
                    for g in groups:
                        m = masks[g]
                        k = int(m.sum())
                        if k:
                            a = acc[g][layer][name]
                            a.kl += float(kl[m].double().sum())
                            a.ce += float(ce[m].double().sum())
                            a.agree += float(agree[m].sum())
                            a.n += k
                    la = logits[rows, ans_pos]  # (b, vocab)
                    ranks = (la > la.gather(-1, ans_ids[:, None])).sum(-1)
                    ra = rank_acc[layer][name]
                    ra.rank += float(ranks.sum())
                    ra.n_rank += b
        done += len(batch.questions)
        if progress is not None:
            progress(done, total, "evaluating lens")
    layers = []
    for layer in range(nb + 1):
        by = {}
        for g in groups:
            rs = {}
            for name in readers:
                a = acc[g][layer][name]
                if layer == nb and name not in ("identity", "mean", "trained"):
                    continue
                a.rank, a.n_rank = rank_acc[layer][name].rank, rank_acc[layer][name].n_rank
                rs[name] = a.metrics()
            by[g] = rs
        layers.append(
            {
                "layer": layer,
                "block": lens._block_name(layer),
                "readers": by[primary],
                "by_positions": {g: v for g, v in by.items() if g != primary},
            }
        )
    desc = corpus.describe() if hasattr(corpus, "describe") else {}
    data_d = {**desc, "n_samples": done}
    return LensEvaluation(lens.summary(), data_d, primary, layers, lens_audit(lens, data_d, primary))


def attach_evaluation(lens: TunedLens, name: str, ev: LensEvaluation) -> None:
    """Store an evaluation's per-layer KL tables (every token group) and its
    full metrics in ``lens.report["evaluations"][name]``."""
    groups = [ev.primary, *ev.layers[0]["by_positions"]] if ev.layers else [ev.primary]
    tables = {}
    for g in groups:
        t = ev.kl_table(g)
        if any(v is not None for r, col in t.items() if r not in ("layer", "block") for v in col):
            tables[g] = t
    lens.report.setdefault("evaluations", {})[name] = {
        "data": ev.data,
        "positions": ev.primary,
        "kl_tables": tables,
        "metrics": ev.to_dict()["layers"],
    }
