"""``analyze``: one capture, every read-out of :data:`core.readouts.ANALYZE_READOUTS`,
the analyze JSON of docs/ARCHITECTURE.md (schema version 1) as an :class:`AnalyzeResult`.

The read-outs are the registry's (:mod:`core.readouts`), the ones the dataset
audit runs on batches: this module is the one-sample driver that builds
their :class:`~core.readouts.base.SampleContext` and places their sections.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from core.answer_text import AnswerText, run_parameters
from core.audit import AuditRecord
from core.errors import QuestionError
from core.images import image_sha256, load_image
from core.methods.patterns import FULL_PATTERN_LIMIT  # re-exported
from core.readout import Target, jsonable
from core.readouts import ANALYZE_READOUTS, READOUTS, TEXT_PATTERN_LIMIT, ReadoutOptions
from core.readouts.pipeline import capture_batch
from core.readouts.residual import reconstruction_line
from core.views import family_view_names

__all__ = ["FULL_PATTERN_LIMIT", "SCHEMA_VERSION", "TEXT_PATTERN_LIMIT", "TOP_K", "AnalyzeResult", "analyze"]

SCHEMA_VERSION = 1
# Alternatives listed in ``target.top`` (as many as core.answer lists by default).
TOP_K = 5
# Tokens per logit-lens row (``logit_lens[l].top``).
LENS_TOP_K = 5
# Progress steps reported before a read-out runs: (step of 4, message).
_STEPS = {"dla": (1, "decomposing the residual"), "attention": (2, "summarising attention"), "rollout": (3, "rollout")}


@dataclass(frozen=True, eq=False, repr=False)
class AnalyzeResult(dict):
    """One ``analyze`` run: a :class:`core.readout.Readout` (``kind``
    "analyze", :meth:`to_dict`, :meth:`from_dict`, :meth:`summary`,
    :meth:`parameters`, :meth:`audit_records`).

    It also reads as the analyze JSON document itself: the instance is a
    ``dict`` (so a ``collections.abc.Mapping``) holding :meth:`to_dict`'s
    strict JSON, computed once at construction, so the callers that read the
    result as that document (``result["target"]["prob"]``, ``json.dumps(result)``,
    the app's panels, a session's ``record``) keep working. Treat it as
    read-only: the fields are the result; the mapping is their JSON.

    ``target`` is the answer position's :class:`core.readout.Target`; ``top``
    the model's alternatives there (``[[token, prob], ...]``), kept in the
    JSON's ``target`` dict. ``rollout_alpha`` is the weight the run was given
    (the JSON holds it in ``rollout`` only when rollout ran).
    """

    model: dict
    input: dict
    target: Target
    top: list
    residual_decomposition: dict
    logit_lens: list
    tuned_lens: dict | None
    attention: list
    rollout: dict | None
    text_patterns: dict
    audit: list[AuditRecord]
    answer_patterns: dict | None = None
    rollout_alpha: float | None = None
    schema_version: int = SCHEMA_VERSION
    kind: ClassVar[str] = "analyze"

    def __post_init__(self) -> None:
        target = self.target.to_dict()
        doc = {
            "schema_version": self.schema_version,
            "model": self.model,
            "input": self.input,
            "target": {"position": target.pop("position"), **target, "top": self.top},
            "residual_decomposition": self.residual_decomposition,
            "logit_lens": self.logit_lens,
            "tuned_lens": self.tuned_lens,
            "attention": self.attention,
            "rollout": self.rollout,
            "text_patterns": self.text_patterns,
            "answer_patterns": self.answer_patterns,
            "audit": [a.to_dict() for a in self.audit],
        }
        dict.update(self, jsonable(doc))

    def __repr__(self) -> str:
        return f"AnalyzeResult({self.summary()})"

    def to_dict(self) -> dict:
        """The analyze JSON (strict: non-finite floats are ``None``)."""
        return dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> AnalyzeResult:
        """The result an analyze JSON (:meth:`to_dict`, or a session's stored result) describes."""
        target = dict(d["target"])
        top = target.pop("top", [])
        rollout = d.get("rollout")
        return cls(
            model=d["model"],
            input=d["input"],
            target=Target.from_dict(target),
            top=top,
            residual_decomposition=d["residual_decomposition"],
            logit_lens=d["logit_lens"],
            tuned_lens=d.get("tuned_lens"),
            attention=d["attention"],
            rollout=rollout,
            text_patterns=d.get("text_patterns"),
            answer_patterns=d.get("answer_patterns"),
            audit=[AuditRecord.from_dict(a) for a in d.get("audit", [])],
            rollout_alpha=rollout["alpha"] if rollout else None,
            schema_version=d.get("schema_version", SCHEMA_VERSION),
        )

    def summary(self) -> str:
        """One line: the answer (p, predicted, logit difference vs the foil), the
        most visual head, the largest frozen-scale DLA component, the reconstruction error."""
        parts = ["answer " + self.target.line()]
        if self.answer_text is not None:
            parts[0] += f" at answer {self.answer_text.label()}"
        heads = [h for h in self.attention if h.get("visual_mass") is not None]
        if heads:
            h = max(heads, key=lambda h: h["visual_mass"])
            parts.append(f"most visual head L{h['layer']}.H{h['head']} {h['visual_mass']:.2f}")
        comps = self.residual_decomposition["components"]
        if comps:
            c = max(comps, key=lambda c: abs(c["dla_frozen"]))
            parts.append(f"largest frozen-scale DLA {c['name']} {c['dla_frozen']:+.2f}")
        parts.append(reconstruction_line(self.residual_decomposition, self.model.get("dtype")))
        return "; ".join(parts)

    def parameters(self) -> dict:
        """What the run was called with: question, answer and foil tokens,
        rollout weight; ``raw_prompt``, ``attention`` (eager) and ``tuned_lens`` only when used."""
        out: dict[str, Any] = {
            "question": self.input["question"],
            "answer": self.target.answer,
            "foil": self.target.foil,
            "rollout_alpha": self.rollout_alpha,
        }
        if self.input.get("raw_prompt"):
            out["raw_prompt"] = True
        if self.input.get("attention", "sdpa") != "sdpa":
            out["attention"] = self.input["attention"]
        out.update(run_parameters(self.answer_text))
        if self.tuned_lens is not None:
            out["tuned_lens"] = True
        return out

    def audit_records(self) -> list[AuditRecord]:
        return list(self.audit)

    @property
    def answer_text(self) -> AnswerText | None:
        """The answer token read out (None: the first token after the bare prompt)."""
        return AnswerText.from_dict(self.input)


def analyze(
    loaded,
    image,
    question: str,
    *,
    answer: str | int | None = None,
    foil: str | int | None = None,
    rollout_alpha: float = 0.5,
    tuned=None,
    raw_prompt: bool = False,
    answer_text: AnswerText | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    attention: str = "sdpa",
) -> AnalyzeResult:
    """Run the model once and read it out. ``answer`` defaults to the model's
    own top token; ``foil`` is optional (then ``u`` is the answer's column); each
    a token string or a token id.
    ``answer_text``: read out at one token of an answer (teacher forcing: the
    prompt plus the answer's tokens before it, see :mod:`core.answer_text`);
    the answer then defaults to that token, and ``input`` records the answer's
    tokens and the index read.
    ``tuned``: a :class:`core.methods.tuned_lens.TunedLens` of this model; its
    reader and baselines are added as ``tuned_lens`` beside the logit lens.
    ``raw_prompt``: let the question hold the model's special tokens (see
    :meth:`core.models.adapter.Adapter.check_question`); recorded in ``input``.
    ``attention``: "sdpa" (the model's own attention, patterns recomputed for
    the rows the read-outs use) or "eager" (see :func:`core.capture.capture`);
    recorded in ``input`` when eager.

    The capture keeps the pattern rows the read-outs read
    (:func:`core.readouts.pattern_rows`: the answer rows and the text rows
    nearest them, never the visual rows) and folds every block's whole
    pattern into the rollout as it runs (:class:`core.methods.patterns.RolloutStream`,
    for prompts of at most :data:`FULL_PATTERN_LIMIT` tokens).

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
    prefix = answer_text.prefix_ids if answer_text is not None else ()
    options = ReadoutOptions(rollout_alpha=rollout_alpha, lens_top_k=LENS_TOP_K, answer_top_k=TOP_K, tuned=tuned)
    captured = capture_batch(  # refused in one line before the forward if it would not fit
        loaded, [img], [question], options, answer_prefix=prefix, raw_prompt=raw_prompt, attention=attention,
        check_memory=True,
    )  # fmt: skip
    trace = captured.trace
    predicted = int(captured.logits[0].argmax())
    if answer is not None and answer != "":
        answer_id = adapter.as_token_id(answer)
    else:
        answer_id = answer_text.token_id if answer_text is not None else predicted
    foil_id = adapter.as_token_id(foil) if foil is not None and foil != "" else None
    if foil_id == answer_id:
        raise QuestionError("the foil must differ from the answer")
    tokens = adapter.visual_tokens(img.size, trace.visual_positions[0].tolist())
    view_names = family_view_names(adapter, img.size)  # the views the geometry cannot name (core.views)
    ctx = captured.context(
        loaded, 0, answer_id=answer_id, options=options, image=img, foil_id=foil_id, tokens=tokens,
        question=question, answer_prefix=tuple(prefix),
    )  # fmt: skip
    sections: dict[str, Any] = {}
    audits: list[AuditRecord] = []
    for name in ANALYZE_READOUTS:
        if name in _STEPS and (name != "rollout" or captured.rollout is not None):
            done, message = _STEPS[name]
            step(done, 4, message)
        readout = READOUTS[name]
        sections[readout.analyze_key], audit = readout.run(ctx)
        if audit is not None:
            audits.append(audit)
    step(4, 4, "done")
    target = sections.pop("target")
    top = target.pop("top")
    return AnalyzeResult(
        model={"spec": loaded.spec, "fingerprint": loaded.fingerprint, **adapter.describe()},
        input={
            "question": question,
            "prompt": adapter.prompt(question),
            "raw_prompt": raw_prompt,
            **({"attention": attention} if attention != "sdpa" else {}),
            "input_ids": trace.input_ids[0].tolist(),
            "tokens": ctx.token_strings,
            "image_sha256": image_sha256(img),
            "image_size": list(img.size),
            "visual_tokens": [t.to_dict() for t in tokens],
            **({"view_names": view_names} if view_names else {}),
            **(answer_text.to_dict() if answer_text is not None else {}),
            **adapter.dtype_and_device(),
        },
        target=Target.from_dict(target),
        top=top,
        audit=audits,
        rollout_alpha=rollout_alpha,
        **sections,
    )
