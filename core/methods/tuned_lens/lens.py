"""The translators of the tuned lens: :class:`TunedLens` (one translator per
block, stacked, read through the frozen final norm and unembedding), its
:class:`LensConfig`, errors and the shared constants.

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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from core.errors import ReadoutError

SCHEMA_VERSION = 1
FORMS = ("identity", "affine", "lowrank", "mlp")
POSITION_SETS = ("all", "text", "visual", "answer")

Progress = Callable[[int, int, str], None] | None
Cancel = Callable[[], bool] | None


class LensError(ReadoutError):
    """A lens that cannot be trained, saved, loaded or applied as asked."""


class LensMismatchError(LensError):
    """The lens was trained for other weights (fingerprint) or another shape of model."""


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
            "trained_dtype": self.meta.get("dtype"),  # None: a lens saved before the dtype was recorded
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


def _kl_nats(final_logp: torch.Tensor, lens_logp: torch.Tensor) -> torch.Tensor:
    """``KL(final || lens)`` per token: ``(..., vocab) -> (...)``."""
    return (final_logp.exp() * (final_logp - lens_logp)).sum(-1)
