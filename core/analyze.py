"""``analyze``: one capture, every text-side read-out, the analyze JSON of
docs/ARCHITECTURE.md (schema version 1)."""

from __future__ import annotations

from collections.abc import Callable

from core.answer import answer_from_logits
from core.capture import capture
from core.errors import QuestionError
from core.images import image_sha256, load_image
from core.methods.logit_lens import logit_lens
from core.methods.patterns import (
    FULL_PATTERN_LIMIT,  # re-exported: core.analyze.FULL_PATTERN_LIMIT
    primary_image,
    rollout_audit,
    rollout_visual_mass,
    summarize_heads,
    text_patterns,
    text_positions,
    tokens_of_ids,
)
from core.methods.residual import decompose

SCHEMA_VERSION = 1
# Text tokens in the text-text patterns (those nearest the answer): bounds the JSON,
# which holds blocks x heads x TEXT_PATTERN_LIMIT^2 weights at most.
TEXT_PATTERN_LIMIT = 48
# Alternatives listed in ``target.top`` (as many as core.answer lists by default).
TOP_K = 5


def analyze(
    loaded,
    image,
    question: str,
    *,
    answer: str | None = None,
    foil: str | None = None,
    rollout_alpha: float = 0.5,
    tuned=None,
    raw_prompt: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
) -> dict:
    """Run the model once and read it out. ``answer`` defaults to the model's
    own top token; ``foil`` is optional (then ``u`` is the answer's column).
    ``tuned``: a :class:`core.methods.tuned_lens.TunedLens` of this model; its
    reader and baselines are added as ``tuned_lens`` beside the logit lens.
    ``raw_prompt``: let the question hold the model's special tokens (see
    :meth:`core.models.adapter.Adapter.check_question`); recorded in ``input``.

    Besides the keys of the analyze JSON (docs/ARCHITECTURE.md, schema version 1), ``text_patterns`` holds
    :meth:`core.methods.patterns.TextPatterns.to_dict`: every self-attention
    block's pattern among the prompt's text tokens (at most
    :data:`TEXT_PATTERN_LIMIT`, those nearest the answer), ``patterns``
    ``(blocks, heads, queries, keys)``, with each row's mass on the keys not
    shown (``other_mass``, by role) and the cross-attention blocks skipped."""
    step = progress or (lambda done, total, msg: None)
    adapter = loaded.adapter
    img = load_image(image)
    step(0, 4, "capturing")
    inputs = adapter.prepare([img], [question], raw_prompt=raw_prompt)
    n_tokens = inputs.input_ids.shape[1]
    full = n_tokens <= FULL_PATTERN_LIMIT
    query_positions = range(n_tokens) if full else _non_visual_rows(adapter, inputs)
    trace = capture(loaded, img, question, query_positions=query_positions, inputs=inputs)
    pos = int(trace.answer_positions[0])
    logits = trace.logits[0, pos].float()
    probs = logits.softmax(-1)
    predicted = int(logits.argmax())
    answer_id = adapter.token_id(answer) if answer else predicted
    foil_id = adapter.token_id(foil) if foil else None
    if foil_id == answer_id:
        raise QuestionError("the foil must differ from the answer")
    step(1, 4, "decomposing the residual")
    residual = decompose(adapter, trace, answer_id, foil_id)
    lens = logit_lens(adapter, trace, answer_id, foil_id)
    step(2, 4, "summarising attention")
    tokens = adapter.visual_tokens(img.size, trace.visual_positions[0].tolist())
    heads = summarize_heads(adapter, trace, tokens, query_index=trace.query_positions.tolist().index(pos))
    primary = primary_image(tokens)
    ids = trace.input_ids[0].tolist()
    strings = tokens_of_ids(adapter, ids)
    kept = set(trace.query_positions.tolist())
    n_text_rows = sum(p in kept for p in text_positions(adapter, trace))
    text = text_patterns(adapter, trace, strings, max_tokens=min(TEXT_PATTERN_LIMIT, n_text_rows))
    audits = [residual.audit, lens.audit, heads.audit]
    tuned_json = None
    if tuned is not None:
        from core.methods.tuned_lens.readers import lens_audit, tuned_lens_readers

        tuned.check_model(loaded)
        tuned.to(adapter.device)  # a lens read from disk is on the CPU; the model may not be
        tuned_json = tuned_lens_readers(tuned, adapter, trace, answer_id, foil_id)
        audits.append(lens_audit(tuned, positions="answer"))
    rollout_json = None
    if full:
        step(3, 4, "rollout")
        grids = rollout_visual_mass(trace, tokens, rollout_alpha)
        rollout_json = {
            "alpha": rollout_alpha,
            "visual_patch_mass": dict(grids)[primary].tolist(),
            "primary_image": primary,
        }
        if len(grids) > 1:
            rollout_json["visual_patch_mass_by_image"] = [{"image": im, "grid": g.tolist()} for im, g in grids]
        audits.append(rollout_audit(rollout_alpha, "mean"))
    audits.append(text.audit)
    step(4, 4, "done")
    return {
        "schema_version": SCHEMA_VERSION,
        "model": {"spec": loaded.spec, "fingerprint": loaded.fingerprint, **adapter.describe()},
        "input": {
            "question": question,
            "prompt": adapter.prompt(question),
            "raw_prompt": raw_prompt,
            "input_ids": ids,
            "tokens": strings,
            "image_sha256": image_sha256(img),
            "image_size": list(img.size),
            "visual_tokens": [t.to_dict() for t in tokens],
        },
        "target": {
            "position": pos,
            "answer": adapter.token_str(answer_id),
            "answer_id": answer_id,
            "foil": adapter.token_str(foil_id) if foil_id is not None else None,
            "foil_id": foil_id,
            "logit": float(logits[answer_id]),
            "logit_diff": float(logits[answer_id] - logits[foil_id]) if foil_id is not None else None,
            "prob": float(probs[answer_id]),
            "predicted": adapter.token_str(predicted),
            "predicted_id": predicted,
            # the model's answer and alternatives at this position: what core.answer gives, from this forward
            "top": [[t, p] for t, p in answer_from_logits(adapter, logits, TOP_K).top],
        },
        "residual_decomposition": {
            "reconstruction_max_abs_err": residual.reconstruction_max_abs_err,
            "target_logit": residual.target_logit,
            "frozen_sum_expected": residual.frozen_sum_expected,
            "components": [c.to_dict() for c in residual.components],
        },
        "logit_lens": [r.to_dict() for r in lens.rows],
        "tuned_lens": tuned_json,
        "attention": [h.to_dict() for h in heads.heads],
        "rollout": rollout_json,
        "text_patterns": text.to_dict(),
        "audit": [a.to_dict() for a in audits],
    }


def _non_visual_rows(adapter, inputs) -> list[int]:
    """The pattern rows a long prompt keeps: the last :data:`TEXT_PATTERN_LIMIT`
    non-visual positions up to the answer (the answer row among them), a superset
    of the text rows the text-text patterns read (token roles need a trace)."""
    answer = int(inputs.answer_positions[0])
    visual = set(adapter.visual_positions(inputs)[0].tolist())
    rows = [p for p in range(answer + 1) if p not in visual]
    return rows[-TEXT_PATTERN_LIMIT:]


def summary(result: dict) -> str:
    """A few human lines about an analyze result."""
    t = result["target"]
    top_heads = sorted(result["attention"], key=lambda h: -h["visual_mass"])[:3]
    dla = sorted(result["residual_decomposition"]["components"], key=lambda c: -abs(c["dla_frozen"]))[:3]
    lines = [
        f"answer {t['answer']!r} p={t['prob']:.3f} (predicted {t['predicted']!r})",
        "most visual attention: " + ", ".join(f"{h['block']}.H{h['head']} {h['visual_mass']:.2f}" for h in top_heads),
        "largest frozen-scale DLA: " + ", ".join(f"{c['name']} {c['dla_frozen']:+.2f}" for c in dla),
        f"reconstruction error {result['residual_decomposition']['reconstruction_max_abs_err']:.2e}",
    ]
    return "\n".join(lines)
