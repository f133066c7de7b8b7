"""The window's worker jobs: plain functions that run in :class:`app.workers.Worker`
threads, called as ``job(*args, progress=..., cancel=...)``; each loads (or
reuses) the model from the window's ``model_cache`` and calls the engine.
Nothing here touches a widget.

The engine modules are imported inside each job: the window opens without
loading torch's method code until a job runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image

import core
from app.panels.dla_panel import visual_token_values


@dataclass(frozen=True)
class Ask:
    """What a follow-up job asks about: the model spec, the image, the question,
    and the answer and foil tokens as typed (``""``: the model's top token, no foil)."""

    spec: str
    image: Image.Image
    question: str
    answer: str = ""
    foil: str = ""

    def tokens(self) -> dict:
        """``answer=`` / ``foil=`` for the engine (None where nothing was typed)."""
        return {"answer": self.answer or None, "foil": self.foil or None}


def _cached_model(model_cache: dict, spec: str, progress) -> core.LoadedModel:
    """The model for ``spec`` from the cache, loading (and caching) it on a miss.

    Runs in a worker; the window runs one job at a time, so the dict needs no lock.
    """
    if spec not in model_cache:
        progress(0, 0, f"loading model {spec}…")
        model_cache[spec] = core.load_model(spec)
    return model_cache[spec]


def model_load_job(model_cache: dict, spec: str, *, progress, cancel) -> core.LoadedModel:
    """Worker job: load (or reuse) the model of a restored run, so that follow-ups can run on it."""
    return _cached_model(model_cache, spec, progress)


def answer_job(
    model_cache: dict, spec: str, image: Image.Image, question: str, *, progress, cancel
) -> core.Answer | None:
    """Worker job: load (or reuse) the model and answer one question."""
    loaded = _cached_model(model_cache, spec, progress)
    if cancel.is_set():
        return None
    progress(0, 1, "answering…")
    result = core.answer(loaded, image, question)
    progress(1, 1, "answered")
    return result


def answer_pairs_job(
    model_cache: dict, spec: str, images: Sequence, questions: Sequence[str], batch_size: int, *, progress, cancel
) -> list[core.Answer]:
    """Worker job: answer many (image, question) pairs; stops early on cancel."""
    loaded = _cached_model(model_cache, spec, progress)
    progress(0, len(questions), f"answering 0/{len(questions)}…")
    return core.answer_batch(
        loaded,
        images,
        questions,
        batch_size=batch_size,
        progress=lambda done, total: progress(done, total, f"answering {done}/{total}…"),
        cancel=cancel.is_set,
    )


def readout_job(
    model_cache: dict, spec: str, image: Image.Image, question: str, answer: str, foil: str, *, progress, cancel
) -> tuple[core.Answer, dict] | None:
    """Worker job: one capture and every text-side read-out
    (:func:`core.analyze.analyze`); the answer with its alternatives is read
    from that same forward (``target.top``), not from a second one."""
    from core.analyze import analyze

    loaded = _cached_model(model_cache, spec, progress)
    if cancel.is_set():
        return None
    analysis = analyze(
        loaded,
        image,
        question,
        answer=answer or None,
        foil=foil or None,
        tuned=_model_lens(loaded),
        progress=progress,
    )
    return answer_of(analysis), analysis


def answer_of(analysis: dict) -> core.Answer:
    """The Answer tab's answer of an analyze result: its forward's top token and
    alternatives (``target.top``), so a restored run shows what the read-out showed."""
    target = analysis["target"]
    top = [(str(t), float(p)) for t, p in target["top"]]
    return core.Answer(top[0][0], int(target["predicted_id"]), top[0][1], top)


_LENSES: dict[tuple, object] = {}  # (lens folder, weights fingerprint, file times) -> TunedLens or None


def _model_lens(loaded):
    """The tuned lens saved beside the model's weights (``tuned-lens/``), if it
    was trained for these weights; else None (the Lens tab shows the logit lens only).
    Read once and kept (a large model's lens is gigabytes), again only when its files change."""
    from core.methods.tuned_lens.store import LENS_CONFIG, LENS_TENSORS, load_lens

    folder = getattr(loaded, "path", None)
    if folder is None or not (folder / "tuned-lens").is_dir():
        return None
    lens_dir = folder / "tuned-lens"
    times = tuple(
        (lens_dir / f).stat().st_mtime_ns if (lens_dir / f).is_file() else None for f in (LENS_CONFIG, LENS_TENSORS)
    )
    key = (str(lens_dir), loaded.fingerprint, times)
    if key not in _LENSES:
        try:
            _LENSES[key] = load_lens(lens_dir, loaded)
        except core.ReadoutError:
            _LENSES[key] = None
    return _LENSES[key]


def head_sources_job(
    model_cache: dict, spec: str, analysis: dict, image, question: str, layer: int, head: int, *, progress, cancel
):
    """Worker job: one head's per-source contributions at the answer position,
    as values per visual token (frozen-scale DLA)."""
    from core.methods.contributions import source_contributions

    loaded = _cached_model(model_cache, spec, progress)
    progress(0, 0, f"source contributions of block {layer} head {head}…")
    target = analysis["target"]
    trace = core.capture(loaded, image, question)
    sc = source_contributions(loaded.adapter, trace, target["answer_id"], target["foil_id"])
    row = sc.dla_frozen[layer][head].tolist()
    return layer, head, visual_token_values(analysis, layer, row)


def counterfactual_job(model_cache: dict, ask: Ask, mask, fill: str, options: dict, *, progress, cancel):
    """Worker job: fill the painted region and re-run (with the routing read-outs)."""
    from core.methods.counterfactual import region_counterfactual

    loaded = _cached_model(model_cache, ask.spec, progress)
    progress(0, 0, f"counterfactual ({fill} fill)…")
    return region_counterfactual(loaded, ask.image, ask.question, mask, fill, **ask.tokens(), **options)


def sweep_job(model_cache: dict, ask: Ask, k: int, fill: str, options: dict, *, progress, cancel):
    """Worker job: the occlusion sweep, batched, cancellable between batches."""
    from core.methods.counterfactual import occlusion_sweep

    loaded = _cached_model(model_cache, ask.spec, progress)
    return occlusion_sweep(
        loaded,
        ask.image,
        ask.question,
        k=k,
        fill=fill,
        progress=progress,
        cancel=cancel.is_set,
        **ask.tokens(),
        **options,
    )


def ablation_job(model_cache: dict, ask: Ask, block: int, head: int, *, progress, cancel):
    """Worker job: zero the head's write at the answer position and re-run."""
    from core.methods.counterfactual import resolve_tokens
    from core.methods.interventions import run_interventions, zero_ablation

    loaded = _cached_model(model_cache, ask.spec, progress)
    inputs = loaded.adapter.prepare([ask.image], [ask.question])
    base = core.capture(loaded, None, "", pattern_layers=[], inputs=inputs)
    pos = int(base.answer_positions[0])
    answer_id, foil_id = resolve_tokens(loaded.adapter, ask.answer or None, ask.foil or None, base.logits[0, pos])
    label = f"{base.block_names[block]}.H{head} zeroed at the answer position"
    return run_interventions(
        loaded, inputs, {label: [zero_ablation(block, head, positions=[pos])]}, answer_id, foil_id, base=base
    )


def patch_job(model_cache: dict, ask: Ask, source, mask, source_path=None, *, progress, cancel):
    """Worker job: patch the painted region's visual tokens from another image
    (``source_path``: the file it was read from, None for pixels), at the earliest
    visual site the family has (forward and reverse)."""
    from core.geometry import region_tokens
    from core.methods.interventions import patch_visual_features

    loaded = _cached_model(model_cache, ask.spec, progress)
    sites = loaded.adapter.edit_sites
    site = next((s for s in ("projector_out", "kv_source", "resid") if s in sites), None)
    if site is None:
        raise core.ReadoutError(f"{loaded.adapter.family}: no visual-feature site to patch")
    tokens = loaded.adapter.visual_tokens(ask.image.size)
    region = region_tokens(tokens, mask, min_cover=1e-6)
    if not region:
        raise core.ReadoutError("the painted region covers no visual token")
    return patch_visual_features(
        loaded,
        ask.image,
        ask.question,
        source,
        site=site,
        layer=0 if site == "resid" else None,
        token_sets={"painted region": region},
        source_image_path=source_path,
        **ask.tokens(),
    )


def statistics_job(model_cache: dict, spec: str, items: list, *, progress, cancel):
    """Worker job: answer-row attention of every head over many samples (distributions)."""
    from core.methods.patterns import pattern_statistics

    loaded = _cached_model(model_cache, spec, progress)
    return pattern_statistics(loaded, items, progress=progress, cancel=cancel.is_set)
