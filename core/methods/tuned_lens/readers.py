"""The readers of a tuned lens and its baselines at one layer
(:func:`_readers`, :func:`_reader_logits`), their per-layer rows for analyze
and the app (:func:`tuned_lens_rows`, :func:`tuned_lens_readers`) and the
tuned-lens audit row (:func:`lens_audit`).

Baselines, each evaluated on the same tokens as the trained lens:

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
"""

from __future__ import annotations

from dataclasses import replace

import torch

from core.methods.logit_lens import LensRow, lens_logits, lens_row
from core.methods.tuned_lens.lens import LensError, LensMismatchError, TunedLens
from core.results.audit import AuditRecord
from core.shell.precision import accumulating


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


def _reader_logits(adapter, lens: TunedLens, name: str, reader, layer: int, x: torch.Tensor) -> torch.Tensor:
    """``(..., d_model) -> (..., vocab)`` for one reader at one layer, through
    the model's final norm and unembedding as the logit lens applies them."""
    if name == "identity":
        return lens_logits(adapter, x)
    if name == "mean":
        return lens_logits(adapter, lens.mean[layer].to(x.dtype).expand_as(x))
    return lens_logits(adapter, reader.translate(layer, x))


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


@torch.no_grad()
def reader_rows(
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
) -> list[LensRow]:
    """:class:`core.methods.logit_lens.LensRow` s (naming their ``reader``) for one position
    (default the answer position), one per block plus x_L, like the logit lens's rows, so
    the app's ``LensPanel.set_readers({"tuned": rows})`` overlays them on the logit lens.

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
        x = accumulating(x)  # half-precision states read in float32, as the lens trained on them
        if layer == lens.n_blocks and reader in ("random", "orthogonal"):
            continue
        lg = _reader_logits(adapter, lens, reader, readers[reader], layer, x).float()
        rows.append(replace(lens_row(adapter, layer, lg, final, answer_id, foil_id, top_k), reader=reader))
    return rows


def tuned_lens_rows(lens: TunedLens, adapter, trace, answer_id: int, foil_id: int | None = None, **kw) -> list[dict]:
    """:func:`reader_rows` as dicts (``LensRow.to_dict``, with ``reader``)."""
    return [r.to_dict() for r in reader_rows(lens, adapter, trace, answer_id, foil_id, **kw)]


def tuned_lens_readers(
    lens: TunedLens, adapter, trace, answer_id: int, foil_id: int | None = None, **kw
) -> dict[str, list[LensRow]]:
    """``{"tuned lens": rows, "tuned lens: mean baseline": rows, "tuned lens:
    random baseline": rows}`` (:func:`reader_rows` for each reader): what
    ``LensPanel.set_readers`` overlays beside the logit lens of the same analysis."""
    readers = _readers(lens, extra=False)  # built once for the three
    return {
        name: reader_rows(lens, adapter, trace, answer_id, foil_id, reader=reader, readers=readers, **kw)
        for name, reader in (
            ("tuned lens", "trained"),
            ("tuned lens: mean baseline", "mean"),
            ("tuned lens: random baseline", "random"),
        )
    }
