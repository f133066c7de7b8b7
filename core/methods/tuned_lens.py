"""Tuned lens (docs/METHODS.md §4.9): a learned translator per layer, read through
the FROZEN final norm and unembedding,

    z^{tuned}_l = W_U Norm_f(T_l(x_l)) + b_U,

trained to minimise KL(final || lens) on a corpus of image-question pairs,
and always reported beside three baselines evaluated on the same tokens.

Translator forms (``T_l(h)``; ``h`` is ``(..., d_model)``, ``A h`` means
``h @ A.T``):

* ``identity``: ``h`` (the logit lens, exactly).
* ``affine``: ``h + A h + b``, ``A`` ``(d_model, d_model)``, ``b`` ``(d_model,)``;
  initialised to the identity (``A = 0, b = 0``).
* ``lowrank``: ``h + U V^T h + b``, ``U, V`` ``(d_model, rank)``; ``U = 0`` at
  the start, so it too starts at the identity.
* ``mlp``: the affine form plus ``rms(h) W_2 gelu(W_1 h / rms(h) + c)`` with
  ``W_2 = 0`` at the start. A STRONGER reader: a non-linear translator can
  compute features the model never formed, so its success says even less
  about what the layer holds.

Layers are the trace's blocks: row ``l`` reads ``trace.resid_pre[l]`` (the
residual entering block ``l``); one extra row ``l = n_blocks`` reads x_L, where
the trained reader is the identity (the final distribution itself, KL 0) and
no translator is trained.

Baselines, each evaluated on the same held-out tokens as the trained lens:

* ``identity``: the logit lens.
* ``mean``: the layer's state replaced by the training-set mean state of
  that layer (a constant reader).
* ``random``: the same form with random parameters of the same Frobenius
  norm as the trained ones, tensor by tensor (``A_rand = G ||A|| / ||G||``,
  ``G`` Gaussian, seeded), so ``h + A_rand h + b_rand``.
* ``orthogonal`` (affine / low-rank only, an extra): ``I + A`` replaced by its
  nearest scaled orthogonal map ``s U V^T`` (``I + A = U S V^T``,
  ``s = mean(S)``), bias kept: how much of the gain a pure change of scale and
  rotation already gives.

Metrics per layer and reader, pooled over the chosen tokens: ``kl_bits``
(KL(final || lens) in bits), ``cross_entropy`` (bits, against the model's
own greedy next token at each position), ``top1_agreement`` (share of
tokens whose lens top-1 is the final top-1), ``answer_rank_mean`` (rank of
the answer token at the answer position, 0 = top; the answer is the pair's
given answer, else the model's own top-1 there).

Training (the tuned-lens recipe): every step renders/loads a fresh batch,
runs the frozen model ONCE through :func:`core.capture.capture` with
``pattern_layers=[]`` and trains every layer's translator on the captured
residuals; loss = sum over layers of the token-mean KL in nats; SGD with
Nesterov momentum (or Adam), linear warm-up then linear decay, L2 weight
decay on the translator parameters, i.e. towards the identity.
"""

from __future__ import annotations

import io
import json
import math
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.audit import AuditRecord
from core.errors import ReadoutError, oom_guard
from core.methods.logit_lens import lens_logits, lens_row

SCHEMA_VERSION = 1
FORMS = ("identity", "affine", "lowrank", "mlp")
POSITION_SETS = ("all", "text", "visual", "answer")
LENS_CONFIG = "lens.json"
LENS_TENSORS = "lens.safetensors"
LENS_REPORT = "REPORT.md"
LN2 = math.log(2.0)

Progress = Callable[[int, int, str], None] | None
Cancel = Callable[[], bool] | None


class LensError(ReadoutError):
    """A lens that cannot be trained, saved, loaded or applied as asked."""


class LensMismatchError(LensError):
    """The lens was trained for other weights (fingerprint) or another shape of model."""


# ---------------------------------------------------------------- translators


@dataclass
class LensConfig:
    """How a lens is trained.

    Attributes:
        form: one of :data:`FORMS`.
        rank: ``lowrank`` only, the rank ``r`` of ``U V^T``.
        hidden: ``mlp`` only, the hidden width.
        positions: the token positions trained on: "all" (every real token),
            "text" (every real non-visual token: BOS, markup, question),
            "visual" (visual tokens in the stream) or "answer".
        steps, batch_size: optimizer steps; image-question pairs per step.
        optimizer: "sgd" (Nesterov momentum, the tuned-lens recipe) or "adam".
        lr, momentum, weight_decay: ``weight_decay`` is L2 on every translator
            parameter, i.e. towards the identity translator. The default lr is
            0.3, not the tuned-lens 1.0: on shapes-llava lr 1.0 (batch 16, 100
            steps) overshot (the last layer's held-out KL rose above the
            identity's); 0.1-0.3 with SGD and Adam at 3e-3 ended within ~10% of
            each other except at the first block, where Adam was better
            (bench/README.md, "Tuned lens", which gives the commands).
        warmup: share of the steps with a linear warm-up (then linear decay to 0).
        seed: initialisation, random baseline and corpus order.
        checkpoint_every: steps between checkpoints (when a checkpoint path is given).
    """

    form: str = "affine"
    rank: int | None = None
    hidden: int | None = None
    positions: str = "all"
    steps: int = 250
    batch_size: int = 32
    optimizer: str = "sgd"
    lr: float = 0.3
    momentum: float = 0.9
    weight_decay: float = 1e-3
    warmup: float = 0.1
    seed: int = 0
    checkpoint_every: int = 25

    def check(self) -> None:
        if self.form not in FORMS:
            raise LensError(f"unknown translator form {self.form!r}; expected one of {', '.join(FORMS)}")
        if self.form == "lowrank" and not (self.rank and self.rank > 0):
            raise LensError("the lowrank form needs --rank R >= 1")
        if self.form == "mlp" and self.hidden is not None and self.hidden < 1:
            raise LensError(f"--hidden must be at least 1, got {self.hidden}")
        if self.positions not in POSITION_SETS:
            raise LensError(f"unknown positions {self.positions!r}; expected one of {', '.join(POSITION_SETS)}")
        if self.optimizer not in ("sgd", "adam"):
            raise LensError(f"unknown optimizer {self.optimizer!r}; expected sgd or adam")
        if self.steps < 0 or self.batch_size < 1:
            raise LensError(f"steps must be >= 0 and batch size >= 1, got {self.steps} and {self.batch_size}")
        if not 0 <= self.warmup < 1:
            raise LensError(f"warmup is a share of the steps in [0, 1), got {self.warmup}")

    def to_dict(self) -> dict:
        return asdict(self)


def _work(x: torch.Tensor) -> torch.Tensor:
    """Half-precision states are read in float32 (translators train and read in
    float32, or float64 for a float64 model); float32/float64 pass unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt()


class TunedLens(torch.nn.Module):
    """One translator per block, stacked, plus the training-set mean state of
    every row (the mean baseline) and the metadata that ties it to a model.

    Parameters (``n = n_blocks``, ``d = d_model``): ``affine``: ``A (n, d, d)``,
    ``b (n, d)``; ``lowrank``: ``U, V (n, d, rank)``, ``b``; ``mlp``: ``A``,
    ``b``, ``W1 (n, d, hidden)``, ``c1 (n, hidden)``, ``W2 (n, hidden, d)``;
    ``identity``: none. Buffer ``mean (n + 1, d)``: row ``l`` is the mean of
    ``resid_pre[l]`` over the training tokens, row ``n`` the mean of x_L.

    Attributes:
        meta: ``{"fingerprint", "spec", "family", "block_names", "vocab_size",
            "final_norm"}`` of the model it was trained for.
        training, capacity, report: what :func:`train_lens` and the evaluations recorded.
    """

    def __init__(
        self,
        n_blocks: int,
        d_model: int,
        form: str = "affine",
        *,
        rank: int | None = None,
        hidden: int | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        LensConfig(form=form, rank=rank, hidden=hidden).check()
        self.n_blocks, self.d_model, self.form, self.seed = n_blocks, d_model, form, seed
        self.rank = rank if form == "lowrank" else None
        self.hidden = (hidden or 64) if form == "mlp" else None
        n, d = n_blocks, d_model
        g = torch.Generator().manual_seed(seed)
        if form in ("affine", "mlp"):
            self.A = torch.nn.Parameter(torch.zeros(n, d, d, dtype=dtype))
        if form == "lowrank":
            self.U = torch.nn.Parameter(torch.zeros(n, d, self.rank, dtype=dtype))
            self.V = torch.nn.Parameter(torch.randn(n, d, self.rank, generator=g, dtype=dtype) / math.sqrt(d))
        if form != "identity":
            self.b = torch.nn.Parameter(torch.zeros(n, d, dtype=dtype))
        if form == "mlp":
            h = self.hidden
            self.W1 = torch.nn.Parameter(torch.randn(n, d, h, generator=g, dtype=dtype) / math.sqrt(d))
            self.c1 = torch.nn.Parameter(torch.zeros(n, h, dtype=dtype))
            self.W2 = torch.nn.Parameter(torch.zeros(n, h, d, dtype=dtype))
        self.register_buffer("mean", torch.zeros(n + 1, d, dtype=dtype))
        self.meta: dict[str, Any] = {}
        self.training_info: dict[str, Any] = {}
        self.capacity: dict[str, Any] = {}
        self.report: dict[str, Any] = {}
        self.path: Path | None = None

    # ---- the translator
    @property
    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def delta(self, layer: int) -> torch.Tensor | None:
        """``A`` of layer ``layer`` as a ``(d_model, d_model)`` matrix (``U V^T``
        for low-rank), the linear part minus the identity; None for identity."""
        if self.form in ("affine", "mlp"):
            return self.A[layer]
        if self.form == "lowrank":
            return self.U[layer] @ self.V[layer].T
        return None

    def translate(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``T_layer(x)``: ``(..., d_model) -> (..., d_model)``. Row ``n_blocks``
        (x_L) and the identity form return ``x`` itself."""
        if self.form == "identity" or layer >= self.n_blocks:
            return x
        return self.translate_all(x.reshape(1, -1, x.shape[-1]), first=layer).reshape(x.shape)

    def translate_all(self, xs: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Several layers at once: ``xs (k, n_tok, d_model) -> (k, n_tok, d_model)``,
        row ``i`` through the translator of layer ``first + i`` (default: every layer)."""
        if self.form == "identity":
            return xs
        dt, sl = xs.dtype, slice(first, first + xs.shape[0])
        if self.form == "lowrank":
            y = xs + torch.einsum(
                "lnr,ldr->lnd", torch.einsum("lnd,ldr->lnr", xs, self.V[sl].to(dt)), self.U[sl].to(dt)
            )
        else:
            y = xs + torch.einsum("lnd,led->lne", xs, self.A[sl].to(dt))
        y = y + self.b[sl].to(dt)[:, None]
        if self.form == "mlp":
            r = _rms(xs)
            hid = torch.nn.functional.gelu(
                torch.einsum("lnd,ldh->lnh", xs / r, self.W1[sl].to(dt)) + self.c1[sl].to(dt)[:, None]
            )
            y = y + r * torch.einsum("lnh,lhd->lnd", hid, self.W2[sl].to(dt))
        return y

    # ---- the baselines that share this lens's form and norm
    @torch.no_grad()
    def random_like(self, seed: int | None = None) -> TunedLens:
        """The random translator: same form, every parameter tensor of every
        layer replaced by a seeded Gaussian of the same Frobenius norm."""
        seed = self.seed + 1 if seed is None else seed
        other = TunedLens(
            self.n_blocks, self.d_model, self.form, rank=self.rank, hidden=self.hidden, seed=seed, dtype=self.mean.dtype
        ).to(self.mean.device)
        other.meta = dict(self.meta)
        g = torch.Generator().manual_seed(seed)  # on the CPU: the same draws on every device
        for p, q in zip(self.parameters(), other.parameters()):
            for layer in range(self.n_blocks):
                target = p[layer].double().norm().cpu()
                r = torch.randn(p[layer].shape, generator=g, dtype=torch.float64)
                q[layer] = (r * (target / r.norm().clamp_min(1e-30))).to(q.dtype)
        if self.form == "lowrank":  # match the norm of the product U V^T, not of each factor
            for layer in range(self.n_blocks):
                want, have = self.delta(layer).double().norm(), other.delta(layer).double().norm()
                other.U[layer] *= (want / have.clamp_min(1e-30)).to(other.U.dtype)
        other.mean.copy_(self.mean)
        return other

    @torch.no_grad()
    def orthogonal_like(self) -> TunedLens | None:
        """The nearest scaled-orthogonal translator: ``I + A`` replaced by
        ``s U V^T`` (its polar factor times the mean singular value), bias kept.
        None for the identity and mlp forms."""
        if self.form not in ("affine", "lowrank"):
            return None
        other = TunedLens(self.n_blocks, self.d_model, "affine", seed=self.seed, dtype=self.mean.dtype)
        other = other.to(self.mean.device)
        other.meta = dict(self.meta)
        eye = torch.eye(self.d_model, dtype=torch.float64, device=self.mean.device)
        for layer in range(self.n_blocks):
            m = eye + self.delta(layer).double()
            u, s, vh = torch.linalg.svd(m)
            other.A[layer] = (s.mean() * (u @ vh) - eye).to(other.A.dtype)
        other.b.copy_(self.b)
        other.mean.copy_(self.mean)
        return other

    @torch.no_grad()
    def capacity_report(self, resid_norms: Sequence[float] | None = None) -> dict:
        """How far each translator is from the identity.

        Per layer: ``rel_frobenius`` = ``||A||_F / ||I||_F``; the singular
        values of ``M = I + A`` (min, max, mean) and their spread
        ``(max - min) / mean``; ``orthogonal_residual_share`` =
        ``||M - s U V^T||_F / ||M||_F`` (0: ``M`` is exactly a scaled
        rotation/reflection, so the translator only fixes scale and
        orientation); ``bias_norm`` and, given the mean residual norms,
        ``bias_relative`` = ``||b|| / mean ||x_l||``; ``mlp_out_norm`` for mlp.
        """
        layers = []
        eye = torch.eye(self.d_model, dtype=torch.float64)
        for layer in range(self.n_blocks):
            row: dict[str, Any] = {"layer": layer, "block": self._block_name(layer)}
            a = self.delta(layer)
            if a is None:
                row.update(rel_frobenius=0.0, orthogonal_residual_share=0.0, sv_min=1.0, sv_max=1.0, sv_mean=1.0)
                row["sv_spread"] = 0.0
            else:
                a = a.double()
                m = eye + a
                s = torch.linalg.svdvals(m)
                row["rel_frobenius"] = float(a.norm() / math.sqrt(self.d_model))
                row["sv_min"], row["sv_max"], row["sv_mean"] = float(s.min()), float(s.max()), float(s.mean())
                row["sv_spread"] = float((s.max() - s.min()) / s.mean())
                row["orthogonal_residual_share"] = float((s - s.mean()).norm() / s.norm())
            if self.form != "identity":
                row["bias_norm"] = float(self.b[layer].double().norm())
                if resid_norms is not None and resid_norms[layer] > 0:
                    row["bias_relative"] = row["bias_norm"] / float(resid_norms[layer])
            if self.form == "mlp":
                row["mlp_W2_norm"] = float(self.W2[layer].double().norm())
            layers.append(row)
        return {
            "form": self.form,
            "rank": self.rank,
            "hidden": self.hidden,
            "parameters": self.n_parameters,
            "parameters_per_layer": self.n_parameters // max(self.n_blocks, 1),
            "stronger_reader": self.form == "mlp",
            "equation": _EQUATIONS[self.form],
            "layers": layers,
        }

    def _block_name(self, layer: int) -> str:
        names = self.meta.get("block_names") or []
        if layer < len(names):
            return names[layer]
        return "final" if layer == self.n_blocks else f"L{layer}"

    def summary(self) -> dict:
        """``{"form", "rank", "hidden", "parameters", ...}``: the ``lens`` entry of eval-lens JSON."""
        t = self.training_info
        return {
            "form": self.form,
            "rank": self.rank,
            "hidden": self.hidden,
            "parameters": self.n_parameters,
            "stronger_reader": self.form == "mlp",
            "equation": _EQUATIONS[self.form],
            "positions": t.get("config", {}).get("positions"),
            "fingerprint": self.meta.get("fingerprint"),
            "model_spec": self.meta.get("spec"),
            "path": str(self.path) if self.path else None,
            "data": t.get("data"),
            "steps": t.get("steps_done"),
            "objective": t.get("objective"),
            "regularisation": t.get("regularisation"),
            "optimizer": t.get("optimizer"),
        }

    # ---- model checks
    def check_model(self, loaded) -> None:
        """Raise :class:`LensMismatchError` unless ``loaded`` is the model this lens was trained for."""
        fp = self.meta.get("fingerprint")
        have = getattr(loaded, "fingerprint", "") or ""
        where = f"the lens at {self.path}" if self.path else "this lens"
        if fp and have and fp != have:
            raise LensMismatchError(
                f"{where} was trained for model fingerprint {fp} ({self.meta.get('spec')}); "
                f"the loaded model {getattr(loaded, 'spec', '?')} has fingerprint {have}: retrain the lens for it"
            )
        if fp and not have:
            raise LensMismatchError(f"{where} needs a model with fingerprint {fp}; the loaded model has none")
        adapter = loaded.adapter
        n, d = len(adapter.blocks), adapter.d_model
        if (n, d) != (self.n_blocks, self.d_model):
            raise LensMismatchError(
                f"{where} has {self.n_blocks} blocks of width {self.d_model}; the model has {n} of width {d}"
            )


_EQUATIONS = {
    "identity": "T(h) = h",
    "affine": "T(h) = h + A h + b",
    "lowrank": "T(h) = h + U V^T h + b",
    "mlp": "T(h) = h + A h + b + rms(h) W2 gelu(W1 h / rms(h) + c1)",
}


# ---------------------------------------------------------------- positions


def position_mask(adapter, trace, positions: str) -> torch.Tensor:
    """``(batch, pos)`` bool: the tokens of ``positions`` (see :class:`LensConfig`);
    padding is never selected. Cross-attention models have no visual tokens
    in the stream, so "visual" selects nothing there."""
    if positions not in POSITION_SETS:
        raise LensError(f"unknown positions {positions!r}; expected one of {', '.join(POSITION_SETS)}")
    b, p = trace.input_ids.shape
    mask = torch.zeros(b, p, dtype=torch.bool)
    if positions == "answer":
        mask[torch.arange(b), trace.answer_positions.cpu()] = True
        return mask
    for row in range(b):
        roles = adapter.token_roles(trace, row)
        for i, r in enumerate(roles):
            if r == "padding":
                continue
            if positions == "all" or (positions == "visual") == (r == "visual"):
                mask[row, i] = True
    return mask


# ---------------------------------------------------------------- corpora


@dataclass
class Batch:
    """Images, questions and (optional) answers of one step."""

    images: list
    questions: list[str]
    answers: list[str | None]


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

    def sample(self, index: int):
        from core.zoo import scenes

        i = self.offset + index
        kind = self.kinds[i % len(self.kinds)] if self.kinds else None
        if self.split == "alt":
            from core.zoo.altrender import make_alt_sample

            return make_alt_sample(i, kind=kind)
        n = self.n_objects[i % len(self.n_objects)] if isinstance(self.n_objects, list | tuple) else self.n_objects
        return scenes.make_sample(self.split, i, kind=kind, n_objects=n)

    def batch(self, step: int, batch_size: int) -> Batch:
        ss = [self.sample(step * batch_size + k) for k in range(batch_size)]
        return Batch([s.image for s in ss], [s.question for s in ss], [None] * len(ss))

    def take(self, n: int) -> Batch:
        ss = [self.sample(k) for k in range(n)]
        return Batch([s.image for s in ss], [s.question for s in ss], [None] * len(ss))

    def describe(self) -> dict:
        d = {
            "source": "synthetic scene generator (core.zoo.scenes)" if self.split != "alt" else "alt renderer",
            "split": self.split,
            "objects_per_scene": self.n_objects if self.n_objects is not None else "1-4 (generator default)",
            "question_kinds": list(self.kinds) if self.kinds else "all (generator default)",
            "first_index": self.offset,
        }
        return d


class PairsCorpus:
    """A list of ``{"image_path", "question"[, "answer"]}`` pairs (e.g. from
    :func:`read_pairs`), cycled in a seeded order that is reshuffled every
    epoch (deterministic per step, so resume sees the same data)."""

    def __init__(self, pairs: Sequence[dict], *, seed: int = 0, source: str = ""):
        if not pairs:
            raise LensError("the corpus has no pairs")
        self.pairs, self.seed, self.source = list(pairs), seed, source
        self._taken: dict[int, Batch] = {}  # take() loads each image once (a CLI checks them before the model loads)

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        return torch.randperm(len(self.pairs), generator=g).tolist()

    def batch(self, step: int, batch_size: int) -> Batch:
        from core.pairs import load_pair_image

        n = len(self.pairs)
        out, orders = [], {}
        for k in range(step * batch_size, (step + 1) * batch_size):
            epoch, i = divmod(k, n)
            if epoch not in orders:  # one shuffle per epoch the batch touches, not one per item
                orders[epoch] = self._order(epoch)
            out.append(self.pairs[orders[epoch][i]])
        return Batch([load_pair_image(p) for p in out], [p["question"] for p in out], [p.get("answer") for p in out])

    def take(self, n: int | None = None) -> Batch:
        from core.pairs import load_pair_image

        ps = self.pairs[:n] if n else self.pairs
        if len(ps) not in self._taken:
            self._taken[len(ps)] = Batch(
                [load_pair_image(p) for p in ps], [p["question"] for p in ps], [p.get("answer") for p in ps]
            )
        return self._taken[len(ps)]

    def describe(self) -> dict:
        return {"source": self.source or "image-question pairs", "n_pairs": len(self.pairs), "order": "seeded shuffle"}


def read_pairs(path: Path) -> list[dict]:
    """Pairs from a JSONL file (as ``vlm-readout answer --pairs``: one
    ``{"image", "question"[, "answer"]}`` per line, image paths relative to the
    file) or from a folder (every ``*.jsonl`` in it, sorted)."""
    from core.pairs import read_pairs as read_jsonl

    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise LensError(f"{path}: no *.jsonl pairs files in this folder")
    else:
        files = [path]
    pairs = []
    for f in files:
        pairs += read_jsonl(f)
    return pairs


# ---------------------------------------------------------------- training


@dataclass
class TrainResult:
    """What :func:`train_lens` returns: the lens, and whether it stopped early."""

    lens: TunedLens
    steps_done: int
    cancelled: bool
    seconds: float
    loss_history: list[float]


def _captured(loaded, batch: Batch):
    """One frozen, no-grad forward over the batch (no attention patterns kept): a Trace."""
    from core.capture import capture

    adapter = loaded.adapter
    with torch.no_grad():
        inputs = adapter.prepare(batch.images, batch.questions)
        trace = capture(loaded, None, "", inputs=inputs, pattern_layers=[])
    return trace


def _schedule(cfg: LensConfig):
    warm = max(1, int(round(cfg.warmup * cfg.steps))) if cfg.warmup > 0 else 0

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        return max(0.0, (cfg.steps - step) / max(1, cfg.steps - warm))

    return f


def _make_optimizer(lens: TunedLens, cfg: LensConfig):
    params = list(lens.parameters())
    if not params:
        return None, None
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=True, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, _schedule(cfg))


def _kl_nats(final_logp: torch.Tensor, lens_logp: torch.Tensor) -> torch.Tensor:
    """``KL(final || lens)`` per token: ``(..., vocab) -> (...)``."""
    return (final_logp.exp() * (final_logp - lens_logp)).sum(-1)


def _save_checkpoint(path: Path, state: dict) -> None:
    from core.atomic import write_bytes_atomic

    buf = io.BytesIO()
    torch.save(state, buf)
    write_bytes_atomic(Path(path), buf.getvalue())


def _load_checkpoint(path: Path) -> dict:
    try:
        return torch.load(Path(path), map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise LensError(f"{path}: not a readable lens checkpoint ({type(e).__name__})") from None


def train_lens(
    loaded,
    corpus,
    config: LensConfig | None = None,
    *,
    checkpoint: Path | str | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    progress: Progress = None,
    cancel: Cancel = None,
) -> TrainResult:
    """Train one translator per block to minimise ``KL(final || lens)``.

    Each step takes ``config.batch_size`` pairs from ``corpus.batch(step, ...)``,
    runs the frozen model once (:func:`core.capture.capture`,
    ``pattern_layers=[]``) and takes one optimizer step for every layer's
    translator on the selected tokens' residuals. The mean baseline's state is
    accumulated over the same tokens.

    Args:
        corpus: :class:`SyntheticCorpus`, :class:`PairsCorpus` or anything with
            ``batch(step, batch_size) -> Batch`` and ``describe() -> dict``.
        checkpoint: file written every ``config.checkpoint_every`` steps, on
            cancel and at the end; with ``resume=True`` training continues
            from it (same config and model required) and ends where an
            uninterrupted run would.
        stop_after: stop (and checkpoint) after this many steps in total
            without finishing the schedule (used to test resume).
        progress: ``progress(done, total, message)``; cancel: returns True to stop.
    """
    cfg = config or LensConfig()
    cfg.check()
    adapter = loaded.adapter
    n, d = len(adapter.blocks), adapter.d_model
    dtype = torch.float64 if next(loaded.model.parameters()).dtype == torch.float64 else torch.float32
    torch.manual_seed(cfg.seed)
    lens = TunedLens(n, d, cfg.form, rank=cfg.rank, hidden=cfg.hidden, seed=cfg.seed, dtype=dtype)
    lens.to(adapter.device)
    lens.meta = _model_meta(loaded)
    opt, sched = _make_optimizer(lens, cfg)
    mean_sum = torch.zeros(n + 1, d, dtype=torch.float64)
    norm_sum = torch.zeros(n + 1, dtype=torch.float64)
    n_tok = 0
    n_samples = 0
    start_step = 0
    elapsed = 0.0
    losses: list[float] = []
    if resume:
        if checkpoint is None or not Path(checkpoint).is_file():
            raise LensError(f"--resume: no checkpoint at {checkpoint}")
        st = _load_checkpoint(Path(checkpoint))
        same = {k: v for k, v in cfg.to_dict().items() if k != "checkpoint_every"}
        if {k: v for k, v in (st.get("config") or {}).items() if k != "checkpoint_every"} != same:
            raise LensError(f"{checkpoint}: the checkpoint was written with another configuration; train from scratch")
        if st.get("fingerprint") != lens.meta.get("fingerprint"):
            raise LensMismatchError(f"{checkpoint}: the checkpoint belongs to another model ({st.get('fingerprint')})")
        lens.load_state_dict(st["lens"])
        if opt is not None:
            opt.load_state_dict(st["optimizer"])
            sched.load_state_dict(st["scheduler"])
        mean_sum, norm_sum = st["mean_sum"], st["norm_sum"]
        n_tok, n_samples, start_step = int(st["n_tokens"]), int(st["n_samples"]), int(st["step"])
        elapsed, losses = float(st["seconds"]), list(st["losses"])

    def state(step: int) -> dict:
        return {
            "step": step,
            "config": cfg.to_dict(),
            "fingerprint": lens.meta.get("fingerprint"),
            "lens": lens.state_dict(),
            "optimizer": opt.state_dict() if opt is not None else {},
            "scheduler": sched.state_dict() if sched is not None else {},
            "mean_sum": mean_sum,
            "norm_sum": norm_sum,
            "n_tokens": n_tok,
            "n_samples": n_samples,
            "seconds": elapsed,
            "losses": losses,
        }

    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    step = start_step
    cancelled = False
    t0 = time.perf_counter()
    with _frozen(loaded.model):  # the model's own weights get no gradients: only the translators train
        try:
            while step < end:
                if cancel is not None and cancel():
                    cancelled = True
                    break
                batch = corpus.batch(step, cfg.batch_size)
                with oom_guard(f"training the lens on a batch of {cfg.batch_size} (try a smaller --batch-size)"):
                    trace = _captured(loaded, batch)
                    mask = position_mask(adapter, trace, cfg.positions).to(trace.final_resid.device)
                    xs = _work(torch.stack([r[mask] for r in trace.resid_pre]))  # (n, n_tok, d)
                    x_final = _work(trace.final_resid[mask])  # (n_tok, d)
                    target = _work(trace.logits[mask]).log_softmax(-1)  # (n_tok, vocab)
                    k = int(mask.sum())
                    if not k:
                        raise LensError(
                            f"no {cfg.positions} tokens in the batch of step {step}"
                            + (
                                ": this model has no visual tokens in the text stream (cross-attention)"
                                if cfg.positions == "visual"
                                else ""
                            )
                        )
                    states = torch.cat([xs, x_final[None]]).double()  # (n + 1, n_tok, d)
                    mean_sum += states.sum(1).cpu()
                    norm_sum += states.norm(dim=-1).sum(1).cpu()
                    n_tok += k
                    n_samples += len(batch.questions)
                    if opt is not None:  # every layer's translator, one step on this batch
                        lens_logp = lens_logits(adapter, lens.translate_all(xs)).log_softmax(-1)  # (n, n_tok, vocab)
                        loss = _kl_nats(target[None], lens_logp).mean(-1).sum()
                        opt.zero_grad(set_to_none=True)
                        loss.backward()
                        opt.step()
                        sched.step()
                        losses.append(float(loss.detach()) / n)
                step += 1
                if progress is not None:
                    progress(step, cfg.steps, "training lens")
                if checkpoint is not None and cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < end:
                    elapsed_now = elapsed + time.perf_counter() - t0
                    s = state(step)
                    s["seconds"] = elapsed_now
                    _save_checkpoint(Path(checkpoint), s)
        finally:
            elapsed += time.perf_counter() - t0
    if checkpoint is not None:
        _save_checkpoint(Path(checkpoint), state(step))
    with torch.no_grad():
        if n_tok:
            lens.mean.copy_((mean_sum / n_tok).to(lens.mean.dtype))
    resid_norms = (norm_sum / max(n_tok, 1)).tolist()
    desc = corpus.describe() if hasattr(corpus, "describe") else {"source": type(corpus).__name__}
    lens.training_info = {
        "config": cfg.to_dict(),
        "data": {**desc, "n_samples": n_samples, "n_tokens": n_tok, "positions": cfg.positions},
        "objective": "sum over layers of the token-mean KL(final || lens) in nats, through the frozen final norm "
        "and unembedding",
        "regularisation": f"L2 weight decay {cfg.weight_decay} on every translator parameter (towards the identity "
        "translator); translators initialised to the identity",
        "optimizer": (
            f"SGD, Nesterov momentum {cfg.momentum}, lr {cfg.lr}" if cfg.optimizer == "sgd" else f"Adam, lr {cfg.lr}"
        )
        + f", linear warm-up over {cfg.warmup:.0%} of the steps then linear decay to 0",
        "steps_done": step,
        "steps_planned": cfg.steps,
        "seconds": round(elapsed, 2),
        "threads": torch.get_num_threads(),
        "final_loss_nats_per_layer": losses[-1] if losses else None,
        "loss_first_nats_per_layer": losses[0] if losses else None,
        "mean_resid_norm": resid_norms,
    }
    lens.capacity = lens.capacity_report(resid_norms)
    return TrainResult(lens, step, cancelled, elapsed, losses)


def _model_meta(loaded) -> dict:
    adapter = loaded.adapter
    return {
        "fingerprint": getattr(loaded, "fingerprint", "") or "",
        "spec": getattr(loaded, "spec", ""),
        "family": getattr(loaded, "family", ""),
        "block_names": [name for name, _ in adapter.blocks],
        "d_model": adapter.d_model,
        "vocab_size": int(adapter.W_U.shape[-1]),
        "final_norm": getattr(adapter, "final_norm", None),
    }


# ---------------------------------------------------------------- evaluation


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

    def markdown(self, group: str | None = None) -> str:
        """The per-layer KL table (bits), one column per reader."""
        t = self.kl_table(group)
        readers = [r for r in t if r not in ("layer", "block")]
        lines = ["| layer | block | " + " | ".join(readers) + " |", "|---|---|" + "---|" * len(readers)]
        for i, layer in enumerate(t["layer"]):
            cells = ["-" if t[r][i] is None else f"{t[r][i]:.4f}" for r in readers]
            lines.append(f"| {layer} | {t['block'][i]} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _readers(lens: TunedLens, extra: bool = True) -> dict[str, TunedLens | str]:
    """The readers compared on the same tokens. The random (and orthogonal)
    translators are built once per state of the lens's weights and kept on the
    lens: an app re-reading a large model's lens would otherwise redraw
    gigabytes of Gaussians on every Run."""
    state = tuple((t.data_ptr(), t._version) for t in (*lens.parameters(), lens.mean))
    cached = getattr(lens, "_baseline_readers", None)
    if cached is None or cached[0] != state:
        cached = (state, {"random": lens.random_like()})
        lens._baseline_readers = cached
    out: dict[str, TunedLens | str] = {"identity": "identity", "mean": "mean", "random": cached[1]["random"]}
    out["trained"] = lens
    if extra:
        if "orthogonal" not in cached[1]:
            cached[1]["orthogonal"] = lens.orthogonal_like()
        if cached[1]["orthogonal"] is not None:
            out["orthogonal"] = cached[1]["orthogonal"]
    return out


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
                x = _work(states[layer])  # (b, pos, d)
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


def _reader_logits(adapter, lens: TunedLens, name: str, reader, layer: int, x: torch.Tensor) -> torch.Tensor:
    """``(..., d_model) -> (..., vocab)`` for one reader at one layer, through
    the model's final norm and unembedding as the logit lens applies them."""
    if name == "identity":
        return lens_logits(adapter, x)
    if name == "mean":
        return lens_logits(adapter, lens.mean[layer].to(x.dtype).expand_as(x))
    return lens_logits(adapter, reader.translate(layer, x))


@contextmanager
def _frozen(model):
    """The model's parameters without gradients for the duration (restored after)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p_ in trainable:
        p_.requires_grad_(False)
    try:
        yield
    finally:
        for p_ in trainable:
            p_.requires_grad_(True)


def lens_audit(lens: TunedLens, data: dict | None = None, positions: str | None = None) -> AuditRecord:
    """The tuned-lens audit row (docs/METHODS.md §4.13) for a result of this lens."""
    t = lens.training_info
    notes = [
        "decodability by this reader, not evidence that the model already holds explicit logits at that layer; "
        "the stronger the reader, the more a success means 'an external model can extract it'",
        "compare the trained reader with the identity (logit lens), mean and random readers on the same tokens",
    ]
    if lens.form == "mlp":
        notes.append("non-linear translator: a STRONGER reader than the affine tuned lens; it can compute features")
    if positions == "visual" or t.get("config", {}).get("positions") == "visual":
        notes.append(
            "visual tokens are not trained to predict a next token; their final distribution is what the "
            "head would read there, not what the model uses them for"
        )
    return AuditRecord.for_method(
        "tuned lens",
        controls=[
            f"capacity: {lens.form} translator, {lens.n_parameters} parameters"
            + (f", rank {lens.rank}" if lens.rank else "")
            + (f", hidden {lens.hidden}" if lens.hidden else ""),
            f"data: trained on {t.get('data', {}).get('n_samples', '?')} pairs / {t.get('data', {}).get('n_tokens', '?')} "
            f"tokens ({t.get('data', {}).get('source', '?')}, split {t.get('data', {}).get('split', '-')}, "
            f"positions {t.get('config', {}).get('positions', '?')})",
            "identity baseline (logit lens)",
            "mean baseline (training-set mean state)",
            "random baseline (same form, same Frobenius norm per tensor)",
            "frozen final norm and unembedding",
        ],
        parameters={
            "form": lens.form,
            "rank": lens.rank,
            "hidden": lens.hidden,
            "fingerprint": lens.meta.get("fingerprint"),
            "training": {k: t.get(k) for k in ("objective", "regularisation", "optimizer", "steps_done", "seconds")},
            "evaluated_on": data or {},
            "positions": positions,
        },
        notes=notes,
    )


# ---------------------------------------------------------------- analyze / app


@torch.no_grad()
def tuned_lens_rows(
    lens: TunedLens,
    adapter,
    trace,
    answer_id: int,
    foil_id: int | None = None,
    *,
    reader: str = "trained",
    position: int | None = None,
    top_k: int = 5,
    batch: int = 0,
    readers: dict | None = None,
) -> list[dict]:
    """Rows like :class:`core.methods.logit_lens.LensRow` dicts for one position
    (default the answer position), one per block plus x_L:
    ``{"layer", "answer_rank", "answer_logit", "logit_diff", "kl_to_final" (nats), "top"}``,
    so the app's ``LensPanel.set_readers({"tuned": rows})`` overlays them on the logit lens.

    Args:
        reader: "trained" (default), "identity", "mean" or "random"; the
            random and orthogonal readers have no row for x_L.
        readers: :func:`_readers` of this lens, when the caller already built them.
    """
    if lens.n_blocks != trace.n_blocks or lens.d_model != trace.final_resid.shape[-1]:
        raise LensMismatchError(
            f"the lens has {lens.n_blocks} blocks of width {lens.d_model}; the trace has {trace.n_blocks} of "
            f"width {trace.final_resid.shape[-1]}"
        )
    readers = readers if readers is not None else _readers(lens, extra=reader == "orthogonal")
    if reader not in readers:
        raise LensError(f"unknown reader {reader!r}; expected one of {', '.join(readers)}")
    pos = int(trace.answer_positions[batch]) if position is None else int(position)
    states = [r[batch, pos] for r in trace.resid_pre] + [trace.final_resid[batch, pos]]
    final = trace.logits[batch, pos].float().log_softmax(-1)
    rows = []
    for layer, x in enumerate(states):
        x = _work(x)
        if layer == lens.n_blocks and reader in ("random", "orthogonal"):
            continue
        lg = _reader_logits(adapter, lens, reader, readers[reader], layer, x).float()
        rows.append({**lens_row(adapter, layer, lg, final, answer_id, foil_id, top_k).to_dict(), "reader": reader})
    return rows


def tuned_lens_readers(
    lens: TunedLens, adapter, trace, answer_id: int, foil_id: int | None = None, **kw
) -> dict[str, list[dict]]:
    """``{"tuned lens": rows, "tuned lens: mean baseline": rows, "tuned lens:
    random baseline": rows}`` (:func:`tuned_lens_rows` for each reader): what
    ``LensPanel.set_readers`` overlays beside the logit lens of the same analysis."""
    readers = _readers(lens, extra=False)  # built once for the three
    return {
        name: tuned_lens_rows(lens, adapter, trace, answer_id, foil_id, reader=reader, readers=readers, **kw)
        for name, reader in (
            ("tuned lens", "trained"),
            ("tuned lens: mean baseline", "mean"),
            ("tuned lens: random baseline", "random"),
        )
    }


# ---------------------------------------------------------------- persistence


def save_lens(lens: TunedLens, directory: Path | str) -> Path:
    """Write ``lens.safetensors`` (translators + mean states), ``lens.json``
    (schema version, model fingerprint, form, training, capacity, report) and
    ``REPORT.md`` into ``directory``; each file atomically."""
    from safetensors.torch import save

    from core.atomic import write_bytes_atomic, write_text_atomic

    directory = Path(directory)
    tensors = {k: v.detach().cpu().contiguous() for k, v in lens.state_dict().items()}
    blob = save(tensors, metadata={"fingerprint": lens.meta.get("fingerprint", ""), "form": lens.form})
    write_bytes_atomic(directory / LENS_TENSORS, blob)
    config = {
        "schema_version": SCHEMA_VERSION,
        "kind": "vlm-readout tuned lens",
        "model": lens.meta,
        "translator": {
            "form": lens.form,
            "rank": lens.rank,
            "hidden": lens.hidden,
            "seed": lens.seed,
            "n_blocks": lens.n_blocks,
            "d_model": lens.d_model,
            "dtype": str(lens.mean.dtype).removeprefix("torch."),
            "parameters": lens.n_parameters,
            "equation": _EQUATIONS[lens.form],
            "stronger_reader": lens.form == "mlp",
            "final_row": "row n_blocks reads x_L with the identity (no translator)",
        },
        "training": lens.training_info,
        "capacity": lens.capacity,
        "report": lens.report,
        "tensors": LENS_TENSORS,
    }
    write_text_atomic(directory / LENS_CONFIG, json.dumps(config, indent=1) + "\n")
    write_text_atomic(directory / LENS_REPORT, report_markdown(lens))
    lens.path = directory
    return directory


def load_lens(directory: Path | str, loaded=None) -> TunedLens:
    """Read a lens saved by :func:`save_lens`; with ``loaded``, refuse a lens
    trained for other weights (:class:`LensMismatchError`)."""
    from safetensors import safe_open

    directory = Path(directory)
    cfg_path = directory / LENS_CONFIG
    if not cfg_path.is_file():
        raise LensError(f"{directory}: no {LENS_CONFIG} (not a tuned-lens folder)")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except OSError as e:
        raise LensError(f"{cfg_path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise LensError(f"{cfg_path}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise LensError(f"{cfg_path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(config, dict):
        raise LensError(f"{cfg_path}: expected a JSON object, got {type(config).__name__}")
    if config.get("schema_version") != SCHEMA_VERSION:
        raise LensError(
            f"{cfg_path}: schema version {config.get('schema_version')!r}, this build reads {SCHEMA_VERSION}"
        )
    tr = config.get("translator", {})
    if not isinstance(tr, dict):
        raise LensError(f"{cfg_path}: 'translator' must be an object, got {type(tr).__name__}")
    for key in ("model", "training", "capacity", "report"):
        if not isinstance(config.get(key, {}), dict):
            raise LensError(f"{cfg_path}: '{key}' must be an object, got {type(config[key]).__name__}")
    tensors_name = config.get("tensors", LENS_TENSORS)
    if not isinstance(tensors_name, str) or Path(tensors_name).name != tensors_name:
        raise LensError(f"{cfg_path}: 'tensors' must name a file inside the lens folder, got {tensors_name!r}")
    try:
        dtype = getattr(torch, tr.get("dtype", "float32"))
        lens = TunedLens(
            int(tr["n_blocks"]),
            int(tr["d_model"]),
            tr["form"],
            rank=tr.get("rank"),
            hidden=tr.get("hidden"),
            seed=int(tr.get("seed", 0)),
            dtype=dtype,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise LensError(f"{cfg_path}: incomplete translator entry ({e})") from None
    tpath = directory / tensors_name
    if not tpath.is_file():
        raise LensError(f"{directory}: {tpath.name} is missing")
    try:
        with safe_open(str(tpath), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            meta_fp = (f.metadata() or {}).get("fingerprint", "")
    except Exception as e:
        raise LensError(f"{tpath}: unreadable safetensors ({type(e).__name__})") from None
    bad = [k for k, t in tensors.items() if not t.is_floating_point() or not bool(torch.isfinite(t).all())]
    if bad:
        raise LensError(f"{tpath}: tensors that are not finite floating-point numbers: {', '.join(sorted(bad)[:4])}")
    want = set(lens.state_dict())
    if set(tensors) != want:
        raise LensError(f"{tpath}: tensors {sorted(tensors)} do not match a {tr['form']} lens ({sorted(want)})")
    try:
        lens.load_state_dict(tensors)
    except RuntimeError as e:
        raise LensError(f"{tpath}: tensor shapes do not match the config ({str(e).splitlines()[0]})") from None
    lens.meta = dict(config.get("model", {}))
    if meta_fp and lens.meta.get("fingerprint") != meta_fp:
        raise LensError(f"{directory}: the config and the tensors name different model fingerprints")
    lens.training_info = config.get("training", {})
    lens.capacity = config.get("capacity", {})
    lens.report = config.get("report", {})
    lens.path = directory
    if loaded is not None:
        lens.check_model(loaded)
        lens.to(loaded.adapter.device)
    return lens


def report_markdown(lens: TunedLens) -> str:
    """A human-readable report: capacity, training, and the KL tables of the evaluations."""
    t, c, m = lens.training_info, lens.capacity, lens.meta
    lines = [
        f"# Tuned lens for {m.get('spec', '?')} (fingerprint {m.get('fingerprint', '?')})",
        "",
        f"Form: **{lens.form}** ({_EQUATIONS[lens.form]})"
        + (f", rank {lens.rank}" if lens.rank else "")
        + (f", hidden {lens.hidden}" if lens.hidden else "")
        + f"; {lens.n_parameters} parameters over {lens.n_blocks} translators"
        + ("; a STRONGER (non-linear) reader" if lens.form == "mlp" else "")
        + ".",
        "",
        f"Data: {json.dumps(t.get('data', {}))}",
        f"Objective: {t.get('objective')}",
        f"Regularisation: {t.get('regularisation')}",
        f"Optimizer: {t.get('optimizer')}",
        f"Steps: {t.get('steps_done')} of {t.get('steps_planned')}; {t.get('seconds')} s on {t.get('threads')} "
        "thread(s), model forwards included.",
        "",
        "Reading: decodability by this reader, not evidence that the model already holds explicit logits. "
        "Row `final` reads x_L (no translator; identity = trained = the model's own distribution).",
        "",
        "## Distance from the identity",
        "",
        "| layer | block | ‖A‖/‖I‖ | σ min | σ max | σ spread | off scaled-orthogonal | ‖b‖/mean‖x‖ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in c.get("layers", []):
        lines.append(
            f"| {r['layer']} | {r['block']} | {r['rel_frobenius']:.4f} | {r['sv_min']:.4f} | {r['sv_max']:.4f} | "
            f"{r['sv_spread']:.4f} | {r['orthogonal_residual_share']:.4f} | "
            + (f"{r['bias_relative']:.4f}" if r.get("bias_relative") is not None else "-")
            + " |"
        )
    for name, ev in lens.report.get("evaluations", {}).items():
        lines += ["", f"## KL(final || lens) in bits: {name}", "", f"Data: {json.dumps(ev.get('data', {}))}", ""]
        for group, table in ev.get("kl_tables", {}).items():
            readers = [k for k in table if k not in ("layer", "block")]
            lines += [f"Positions: **{group}**", "", "| layer | block | " + " | ".join(readers) + " |"]
            lines.append("|---|---|" + "---|" * len(readers))
            for i, layer in enumerate(table["layer"]):
                cells = ["-" if table[r][i] is None else f"{table[r][i]:.4f}" for r in readers]
                lines.append(f"| {layer} | {table['block'][i]} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines) + "\n"


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


# ---------------------------------------------------------------- the whole job


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


def build_lens(
    loaded,
    corpus,
    config: LensConfig | None = None,
    *,
    out: Path | str | None = None,
    eval_sets: dict[str, tuple[Any, int | None]] | None = None,
    checkpoint: Path | str | None = None,
    resume: bool = False,
    batch_size: int = 32,
    progress: Progress = None,
    cancel: Cancel = None,
) -> tuple[TunedLens, dict[str, LensEvaluation], TrainResult]:
    """Train a lens, evaluate it with its baselines on every set of
    ``eval_sets`` (``{name: (corpus, n)}``), store the KL tables and the
    capacity report in the lens, and save it to ``out`` (when given).

    The report keeps each evaluation set's per-layer KL of the identity, mean,
    random and trained readers (and the orthogonal one) by token group
    (:func:`attach_evaluation`).
    """
    result = train_lens(loaded, corpus, config, checkpoint=checkpoint, resume=resume, progress=progress, cancel=cancel)
    lens = result.lens
    evaluations: dict[str, LensEvaluation] = {}
    if not result.cancelled:
        for name, (ev_corpus, n) in (eval_sets or {}).items():
            t0 = time.perf_counter()
            ev = evaluate_lens(loaded, lens, ev_corpus, n, batch_size=batch_size, progress=progress, cancel=cancel)
            ev.data["seconds"] = round(time.perf_counter() - t0, 2)
            evaluations[name] = ev
            attach_evaluation(lens, name, ev)
    lens.report["audit"] = lens_audit(lens).to_dict()
    if out is not None:
        save_lens(lens, out)
    return lens, evaluations, result
