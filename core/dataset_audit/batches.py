"""One batch of the audit: the samples' files and tokens checked, one forward
(or capture) for the batch, every read-out on every sample; a sample that
fails becomes an error row and the run goes on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from core.answer_text import AnswerText
from core.dataset_audit.dataset import token_cover
from core.errors import QuestionError, ReadoutError
from core.files.pairs import Pair, load_pair_image, load_pair_mask
from core.forward.geometry import region_tokens
from core.readouts import ReadoutMethod, ReadoutOptions, SampleContext
from core.readouts.pipeline import capture_batch


def base_record(item: Pair) -> dict:
    """A sample's record before its read-outs ran (``readouts``: name -> section)."""
    return {
        "index": item.index,
        "id": item.id,
        "image": item.image,
        "question": item.question,
        "answer": item.answer,
        "foil": item.foil,
        "answer_text": item.answer_text,
        "answer_token_index": item.answer_token_index,
        "kind": item.kind,
        "template": item.template,
        "status": "ok",
        "error": None,
        "predicted": None,
        "correct": None,
        "region": None,
        "readouts": {},
    }


def error_record(item: Pair, err: Exception) -> dict:
    rec = base_record(item)
    rec["status"] = "error"
    rec["error"] = str(err)
    return rec


@dataclass
class _Prepared:
    item: Pair
    image: Any
    mask: np.ndarray | None
    answer_id: int | None
    foil_id: int | None
    answer_prefix: tuple[int, ...] = ()


def _prepare_item(loaded, item: Pair) -> _Prepared:
    adapter = loaded.adapter
    image = load_pair_image(item)
    mask = load_pair_mask(item, image.size)
    adapter.check_question(item.question)
    answer_text = None
    if item.answer_text is not None:
        answer_text = AnswerText.of_text(adapter, item.answer_text, item.answer_token_index or 0)
    a = adapter.token_id(item.answer) if item.answer is not None else None
    if a is None and answer_text is not None:
        a = answer_text.token_id
    f = adapter.token_id(item.foil) if item.foil is not None else None
    if f is not None and f == a:
        raise QuestionError(f"the foil {item.foil!r} is the same token as the answer")
    return _Prepared(item, image, mask, a, f, answer_text.prefix_ids if answer_text is not None else ())


def run_batch(loaded, batch: list[_Prepared], methods: list[ReadoutMethod], options: ReadoutOptions):
    """One forward (or capture) for the batch, then every method.
    Returns ``[(record, {method: audit dict})]`` in batch order. A
    :class:`ReadoutError` of one sample's method makes that sample an error
    row; one from a batched method (or the forward) propagates."""
    adapter = loaded.adapter
    prefixes = {p.answer_prefix for p in batch}
    if len(batch) > 1 and prefixes != {()}:
        raise ValueError("run_batch: samples read out at an answer token run one at a time")
    captured = capture_batch(
        loaded,
        [p.image for p in batch],
        [p.item.question for p in batch],
        options,
        patterns={m.patterns for m in methods},
        needs_capture=any(m.needs_capture for m in methods),
        answer_prefix=batch[0].answer_prefix,
    )
    trace = captured.trace
    records: list[dict] = []
    audits: list[dict] = []
    contexts: list[SampleContext | None] = []
    token_cache: dict[tuple, list] = {}
    for b, p in enumerate(batch):
        rec = base_record(p.item)
        ctx = None
        try:
            predicted = int(captured.logits[b].argmax())
            rec["predicted"] = adapter.token_str(predicted)
            rec["correct"] = (predicted == p.answer_id) if p.answer_id is not None else None
            tokens: list = []
            if trace is not None:
                vpos = tuple(trace.visual_positions[b].tolist())
                key = (tuple(p.image.size), vpos)
                if key not in token_cache:
                    token_cache[key] = adapter.visual_tokens(p.image.size, list(vpos))
                tokens = token_cache[key]
            cover = region = None
            if p.mask is not None:
                rec["region"] = {"area_px": int(p.mask.sum()), "n_tokens": None, "token_share": None}
                if tokens:
                    cover = token_cover(tokens, p.mask)
                    region = region_tokens(tokens, p.mask, options.region_min_cover)
                    n_patch = sum(1 for t in tokens if t.col >= 0)
                    rec["region"]["n_tokens"] = len(region)
                    rec["region"]["token_share"] = len(region) / n_patch if n_patch else None
            ctx = captured.context(
                loaded,
                b,
                answer_id=p.answer_id,
                options=options,
                item=p.item,
                image=p.image,
                mask=p.mask,
                foil_id=p.foil_id,
                tokens=tokens,
                cover=cover,
                region=region,
                question=p.item.question,
                answer_prefix=p.answer_prefix,
            )
        except ReadoutError as e:
            rec = error_record(p.item, e)
        records.append(rec)
        audits.append({})
        contexts.append(ctx)
    for m in methods:
        live = [b for b in range(len(batch)) if records[b]["status"] == "ok"]
        if not live:
            break
        if m.batched:
            results = m.run_batch([contexts[b] for b in live])
        else:
            results = []
            for b in live:
                try:
                    results.append(m.run(contexts[b]))
                except ReadoutError as e:
                    records[b] = error_record(batch[b].item, e)
                    audits[b] = {}
                    results.append(None)
        for b, res in zip(live, results):
            if res is None:
                continue
            section, audit = res
            records[b]["readouts"][m.name] = m.audit_section(section, contexts[b])
            if audit is not None:
                audits[b][m.name] = audit.to_dict()
    return list(zip(records, audits))


def run_chunk(loaded, chunk: list[Pair], methods, options) -> list[tuple[dict, dict]]:
    """Records for one batch of dataset items; unreadable samples become error rows."""
    results: dict[int, tuple[dict, dict]] = {}
    ready: list[_Prepared] = []
    for item in chunk:
        try:
            ready.append(_prepare_item(loaded, item))
        except ReadoutError as e:
            results[item.index] = (error_record(item, e), {})
    # teacher-forced samples grow by their own answer tokens after the padding's
    # place, so they run alone; the rest share one forward
    alone = [p for p in ready if p.answer_prefix]
    ready = [p for p in ready if not p.answer_prefix]
    for p in alone:
        try:
            results[p.item.index] = run_batch(loaded, [p], methods, options)[0]
        except ReadoutError as e:
            results[p.item.index] = (error_record(p.item, e), {})
    if ready:
        try:
            for rec, audits in run_batch(loaded, ready, methods, options):
                results[rec["index"]] = (rec, audits)
        except ReadoutError as e:
            if len(ready) == 1:
                results[ready[0].item.index] = (error_record(ready[0].item, e), {})
            else:  # one sample broke the batch (too long, out of memory): run each alone
                for p in ready:
                    try:
                        results[p.item.index] = run_batch(loaded, [p], methods, options)[0]
                    except ReadoutError as e1:
                        results[p.item.index] = (error_record(p.item, e1), {})
    return [results[item.index] for item in chunk]
