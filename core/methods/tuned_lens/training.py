"""Training a tuned lens (:func:`train_lens`), the tuned-lens recipe: every
step renders/loads a fresh batch, runs the frozen model ONCE through
:func:`core.forward.capture.capture` with ``pattern_layers=[]`` and trains every
layer's translator on the captured residuals; loss = sum over layers of the
token-mean KL in nats; SGD with Nesterov momentum (or Adam), linear warm-up
then linear decay, L2 weight decay on the translator parameters, i.e. towards
the identity. Checkpoints let a run resume where it stopped.
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import oom_guard
from core.files.atomic import write_bytes_atomic
from core.methods.logit_lens import lens_logits
from core.methods.tuned_lens.data import _captured, position_mask
from core.methods.tuned_lens.lens import (
    Cancel,
    LensConfig,
    LensError,
    LensMismatchError,
    Progress,
    TunedLens,
    _kl_nats,
)
from core.shell.precision import accumulating


@dataclass
class TrainResult:
    """What :func:`train_lens` returns: the lens, and whether it stopped early."""

    lens: TunedLens
    steps_done: int
    cancelled: bool
    seconds: float
    loss_history: list[float]


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


def _save_checkpoint(path: Path, state: dict) -> None:

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
    runs the frozen model once (:func:`core.forward.capture.capture`,
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
    dtype = torch.float64 if adapter.parameters_dtype == torch.float64 else torch.float32
    check_training_fits(loaded, cfg, dtype)  # before the translators are allocated
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
    with adapter.frozen():  # the model's own weights get no gradients: only the translators train
        try:
            while step < end:
                if cancel is not None and cancel():
                    cancelled = True
                    break
                batch = corpus.batch(step, cfg.batch_size)
                with oom_guard(f"training the lens on a batch of {cfg.batch_size} (try a smaller --batch-size)"):
                    trace = _captured(loaded, batch)
                    mask = position_mask(adapter, trace, cfg.positions).to(trace.final_resid.device)
                    xs = accumulating(torch.stack([r[mask] for r in trace.resid_pre]))  # (n, n_tok, d)
                    x_final = accumulating(trace.final_resid[mask])  # (n_tok, d)
                    target = accumulating(trace.logits[mask]).log_softmax(-1)  # (n_tok, vocab)
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
                        _check_finite(cfg, step, loss=float(loss.detach()))
                        opt.zero_grad(set_to_none=True)
                        loss.backward()
                        opt.step()
                        sched.step()
                        _check_finite(cfg, step, lens=lens)  # the step itself may overflow
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


def _check_finite(cfg: LensConfig, step: int, *, loss: float = 0.0, lens: TunedLens | None = None) -> None:
    """LensError (one line) once the loss or a translator is no longer finite: the
    lens diverged (a learning rate or weight decay too large for this model), and
    training on would only save NaN; nothing is saved (the checkpoint keeps its
    last finite state)."""
    what = None
    if not math.isfinite(loss):
        what = f"the training loss became {loss}"
    elif lens is not None and not all(bool(torch.isfinite(p).all()) for p in lens.parameters()):
        what = "the translators' weights overflowed"
    if what is not None:
        raise LensError(
            f"--lr {cfg.lr:g}: {what} at step {step} (the lens diverged; --weight-decay {cfg.weight_decay:g}); "
            "try a smaller --lr; nothing was saved"
        )


def lens_parameters(cfg: LensConfig, n: int, d: int) -> int:
    """How many values the translators of a ``cfg.form`` lens hold for ``n`` blocks of width ``d``
    (:class:`TunedLens`'s parameters)."""
    hidden = (cfg.hidden or 64) if cfg.form == "mlp" else 0
    per_block = {
        "identity": 0,
        "affine": d * d + d,
        "lowrank": 2 * d * (cfg.rank or 0) + d,
        "mlp": d * d + d + 2 * d * hidden + hidden,
    }[cfg.form]
    return n * per_block


def check_training_fits(loaded, cfg: LensConfig, dtype: torch.dtype) -> None:
    """Before anything is allocated: LensError (one line, naming the option that
    sizes it) for a ``--rank`` above the model's residual width, or a lens whose
    training would not fit in the memory available (:func:`core.models.memory.available_bytes`):
    the translators with their gradients and optimizer state, and one step's
    capture (:func:`core.models.memory.working_set_bytes`) and lens logits
    (``blocks x tokens x vocabulary``, with their log-softmax and gradients)."""
    from core.models.memory import (
        NOMINAL_TEXT_TOKENS,
        ModelSizes,
        _gb,
        available_bytes,
        working_set_bytes,
    )
    from core.shell.precision import placement

    adapter = loaded.adapter
    n, d = len(adapter.blocks), adapter.d_model
    for option, value in (("--lr", cfg.lr), ("--weight-decay", cfg.weight_decay)):
        # the command line takes up to 10; past 1e30 the optimizer's own step size overflows float32
        if not (isinstance(value, (int, float)) and 0 <= value <= 1e30):
            raise LensError(f"{option} {value!r}: expected a number from 0 to 1e30 (the command line takes up to 10)")
    if cfg.form == "lowrank" and cfg.rank > d:
        raise LensError(
            f"--rank {cfg.rank} is more than the model's residual width {d} (a rank-{d} lens is already "
            "full: --form affine)"
        )
    sizes = ModelSizes.of_adapter(adapter)
    size = dtype.itemsize
    copies = 3 if cfg.optimizer == "sgd" else 4  # the values, their gradients, momentum (Adam: two moments)
    lens_bytes = lens_parameters(cfg, n, d) * size * copies
    per_input = {"answer": 1, "text": NOMINAL_TEXT_TOKENS}.get(cfg.positions, sizes.nominal_tokens)
    tokens = cfg.batch_size * per_input
    hidden = (cfg.hidden or 64) if cfg.form == "mlp" else 0
    step_bytes = working_set_bytes(sizes, sizes.nominal_tokens, adapter.parameters_dtype, batch=cfg.batch_size)
    step_bytes += n * tokens * (3 * sizes.vocab + 3 * d + 2 * hidden) * size  # lens logits, states, hidden layer
    devices = placement(adapter.model).split("+")
    available = available_bytes("auto" if len(devices) > 1 else devices[0])
    if lens_bytes + step_bytes <= available:
        return
    sizing = {"lowrank": f"--form lowrank --rank {cfg.rank}", "mlp": f"--form mlp --hidden {hidden}"}.get(
        cfg.form, f"--form {cfg.form}"
    )
    if lens_bytes > available:
        raise LensError(
            f"{sizing}: the lens needs ~{_gb(lens_bytes)} for {n} blocks of width {d} (translators, gradients and "
            f"{cfg.optimizer} state) and {_gb(available)} is available"
        )
    raise LensError(
        f"--batch-size {cfg.batch_size}: a training step needs ~{_gb(step_bytes)} (the model's capture of "
        f"{cfg.batch_size:,} inputs and the lens logits at ~{tokens:,} {cfg.positions} tokens of {n} blocks) "
        f"beside the lens's {_gb(lens_bytes)}, and {_gb(available)} is available; try a smaller --batch-size"
        + ("" if cfg.positions == "answer" else " or --positions answer")
    )


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
        **adapter.dtype_and_device(),  # what the lens was fitted on: a bfloat16 model's residuals are not float32's
    }
