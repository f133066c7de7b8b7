"""``analyze``: one capture, every read-out of :data:`core.readouts.ANALYZE_READOUTS`,
the analyze JSON of docs/ARCHITECTURE.md (schema version 1) as an :class:`AnalyzeResult`.

The read-outs are the registry's (:mod:`core.readouts`), the ones the dataset
audit runs on batches: this module is the one-sample driver that builds
their :class:`~core.readouts.base.SampleContext` and places their sections.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from core.answer_text import AnswerText, run_parameters
from core.errors import QuestionError, UndefinedReadoutError
from core.files.images import image_sha256, load_image
from core.forward.geometry import VisualToken
from core.methods.answer_patterns import AnswerPatterns
from core.methods.logit_lens import LensRow
from core.methods.patterns import FULL_PATTERN_LIMIT, HeadSummary, TextPatterns  # FULL_PATTERN_LIMIT re-exported
from core.readouts import ANALYZE_READOUTS, READOUTS, TEXT_PATTERN_LIMIT, ReadoutOptions
from core.readouts.answer import AnswerSection
from core.readouts.pipeline import capture_batch
from core.readouts.residual import ResidualSection
from core.readouts.rollout import RolloutSection
from core.readouts.tuned_lens import TunedLensSection
from core.results.audit import AuditRecord
from core.results.readout import Target, jsonable
from core.views import family_view_names

__all__ = [
    "FULL_PATTERN_LIMIT",
    "SCHEMA_VERSION",
    "TEXT_PATTERN_LIMIT",
    "TOP_K",
    "AnalyzeInput",
    "AnalyzeResult",
    "AnalyzedModel",
    "analyze",
]

SCHEMA_VERSION = 1
# Alternatives listed in ``target.top`` (as many as core.answer lists by default).
TOP_K = 5
# Tokens per logit-lens row (``logit_lens[l].top``).
LENS_TOP_K = 5
# Progress steps reported before a read-out runs: (step of 4, message).
# The sections that are lists (empty, not None, where the architecture defines none).
_LIST_SECTIONS = ("logit_lens", "attention")
_STEPS = {"dla": (1, "decomposing the residual"), "attention": (2, "summarising attention"), "rollout": (3, "rollout")}


@dataclass(frozen=True)
class AnalyzedModel:
    """analyze's ``model``: the spec and fingerprint the model was loaded from and
    :meth:`core.models.adapter.Adapter.describe` (its sizes, norm, attention and
    position scheme, dtype and device). ``extra``: what a family adds to its
    description (``norm_placement``, ``final_transform``), in its order, after
    the rest. A key an older JSON lacks reads as None."""

    spec: str | None
    fingerprint: str | None
    family: str | None
    n_layers: int | None
    n_heads: int | None
    d_model: int | None
    final_norm: str | None
    attention_kind: str | None
    position_scheme: str | None
    dtype: str | None
    device: str | None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, loaded) -> AnalyzedModel:
        return cls.from_dict({"spec": loaded.spec, "fingerprint": loaded.fingerprint, **loaded.adapter.describe()})

    def to_dict(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}, **self.extra}

    @classmethod
    def from_dict(cls, d: dict) -> AnalyzedModel:
        named = [f.name for f in fields(cls) if f.name != "extra"]
        return cls(**{k: d.get(k) for k in named}, extra={k: v for k, v in d.items() if k not in named})


@dataclass(frozen=True)
class AnalyzeInput:
    """analyze's ``input``: what the model was run on.

    Attributes:
        question: the question as given; ``prompt`` the model's prompt around it;
            ``raw_prompt``: whether the question could hold special tokens.
        input_ids, tokens: the sequence run, one display string per position.
        image_sha256, image_size: the image's pixels hash and ``(width, height)``.
        visual_tokens: the :class:`core.forward.geometry.VisualToken` s (boxes in the image's pixels).
        dtype, device: what the numbers were computed in and where.
        attention: "sdpa" (the model's own; no JSON key) or "eager".
        view_names: ``{image: name}`` of the views the geometry cannot name
            (:func:`core.views.family_view_names`; no JSON key when empty).
        answer_text: the answer token read out (teacher forcing); None: the
            first token after the bare prompt (no JSON keys).
    """

    question: str
    prompt: str
    raw_prompt: bool
    input_ids: list[int]
    tokens: list[str]
    image_sha256: str
    image_size: tuple[int, int]
    visual_tokens: list[VisualToken]
    dtype: str | None = None
    device: str | None = None
    attention: str = "sdpa"
    view_names: dict[int, str] = field(default_factory=dict)
    answer_text: AnswerText | None = None

    def to_dict(self) -> dict:
        return {
            "question": self.question,
            "prompt": self.prompt,
            "raw_prompt": self.raw_prompt,
            **({"attention": self.attention} if self.attention != "sdpa" else {}),
            "input_ids": list(self.input_ids),
            "tokens": list(self.tokens),
            "image_sha256": self.image_sha256,
            "image_size": list(self.image_size),
            "visual_tokens": [t.to_dict() for t in self.visual_tokens],
            **({"view_names": {str(k): v for k, v in self.view_names.items()}} if self.view_names else {}),
            **(self.answer_text.to_dict() if self.answer_text is not None else {}),
            "dtype": self.dtype,
            "device": self.device,
        }

    @classmethod
    def from_dict(cls, d: dict) -> AnalyzeInput:
        return cls(
            question=d["question"],
            prompt=d["prompt"],
            raw_prompt=d.get("raw_prompt", False),
            input_ids=list(d["input_ids"]),
            tokens=list(d["tokens"]),
            image_sha256=d["image_sha256"],
            image_size=tuple(d["image_size"]),
            visual_tokens=[VisualToken.from_dict(t) for t in d["visual_tokens"]],
            dtype=d.get("dtype"),
            device=d.get("device"),
            attention=d.get("attention", "sdpa"),
            view_names={int(k): v for k, v in (d.get("view_names") or {}).items()},
            answer_text=AnswerText.from_dict(d),
        )


@dataclass(frozen=True, eq=False)
class AnalyzeResult:
    """One ``analyze`` run: a :class:`core.results.readout.Readout` (``kind``
    "analyze", :meth:`to_dict`, :meth:`from_dict`, :meth:`summary`,
    :meth:`parameters`, :meth:`audit_records`).

    Each field is one part of the analyze JSON (docs/ARCHITECTURE.md, "The
    analyze JSON"), typed; :meth:`to_dict` is the JSON (strict: non-finite
    floats are None) and :meth:`from_dict` reads it back, the one place a stored
    document becomes a result. ``target`` is the answer position's
    :class:`core.results.readout.Target` and ``top`` the model's alternatives there
    (``[(token, prob), ...]``), the JSON's ``target`` together. The sections are
    the read-outs' (:mod:`core.readouts`): ``residual_decomposition`` a
    :class:`~core.readouts.residual.ResidualSection` (None where the architecture gives it no meaning:
    its audit row says why), ``logit_lens`` the
    :class:`~core.methods.logit_lens.LensRow` s, ``tuned_lens`` a
    :class:`~core.readouts.tuned_lens.TunedLensSection` (None without a lens),
    ``attention`` the :class:`~core.methods.patterns.HeadSummary` s, ``rollout`` a
    :class:`~core.readouts.rollout.RolloutSection` (None past
    :data:`FULL_PATTERN_LIMIT`), ``text_patterns`` the
    :class:`~core.methods.patterns.TextPatterns` and ``answer_patterns`` the
    :class:`~core.methods.answer_patterns.AnswerPatterns` (None in a JSON
    written before they existed). ``rollout_alpha`` is the weight the run was
    given (the JSON holds it in ``rollout`` only when rollout ran).
    """

    model: AnalyzedModel
    input: AnalyzeInput
    target: Target
    top: list[tuple[str, float]]
    residual_decomposition: ResidualSection | None
    logit_lens: list[LensRow]
    tuned_lens: TunedLensSection | None
    attention: list[HeadSummary]
    rollout: RolloutSection | None
    text_patterns: TextPatterns | None
    audit: list[AuditRecord]
    answer_patterns: AnswerPatterns | None = None
    rollout_alpha: float | None = None
    schema_version: int = SCHEMA_VERSION
    kind: ClassVar[str] = "analyze"

    def __repr__(self) -> str:
        return f"AnalyzeResult({self.summary()})"

    def to_dict(self) -> dict:
        """The analyze JSON (strict: non-finite floats are ``None``)."""
        doc = {
            "schema_version": self.schema_version,
            "model": self.model.to_dict(),
            "input": self.input.to_dict(),
            "target": AnswerSection(self.target, self.top).to_dict(),
            "residual_decomposition": _dict_or_none(self.residual_decomposition),
            "logit_lens": [r.to_dict() for r in self.logit_lens],
            "tuned_lens": _dict_or_none(self.tuned_lens),
            "attention": [h.to_dict() for h in self.attention],
            "rollout": _dict_or_none(self.rollout),
            "text_patterns": _dict_or_none(self.text_patterns),
            "answer_patterns": _dict_or_none(self.answer_patterns),
            "audit": [a.to_dict() for a in self.audit],
        }
        return jsonable(doc)

    @classmethod
    def from_dict(cls, d: dict) -> AnalyzeResult:
        """The result an analyze JSON (:meth:`to_dict`, or a session's stored result) describes."""
        model, input = AnalyzedModel.from_dict(d["model"]), AnalyzeInput.from_dict(d["input"])  # the JSON's order
        answer = AnswerSection.from_dict(d["target"])
        rollout = RolloutSection.from_dict(d["rollout"]) if d.get("rollout") else None
        return cls(
            model=model,
            input=input,
            target=answer.target,
            top=answer.top,
            residual_decomposition=(  # null where the architecture gives it no meaning; never missing
                None if d["residual_decomposition"] is None else ResidualSection.from_dict(d["residual_decomposition"])
            ),
            logit_lens=[LensRow.from_dict(r) for r in d["logit_lens"]],
            tuned_lens=TunedLensSection.from_dict(d["tuned_lens"]) if d.get("tuned_lens") is not None else None,
            attention=[HeadSummary.from_dict(h) for h in d["attention"]],
            rollout=rollout,
            text_patterns=TextPatterns.from_dict(d["text_patterns"]) if d.get("text_patterns") else None,
            answer_patterns=AnswerPatterns.from_dict(d["answer_patterns"]) if d.get("answer_patterns") else None,
            audit=[AuditRecord.from_dict(a) for a in d.get("audit", [])],
            rollout_alpha=rollout.alpha if rollout else None,
            schema_version=d.get("schema_version", SCHEMA_VERSION),
        )

    def summary(self) -> str:
        """One line: the answer (p, predicted, logit difference vs the foil), the
        most visual head, the largest frozen-scale DLA component, the reconstruction error."""
        parts = ["answer " + self.target.line()]
        if self.answer_text is not None:
            parts[0] += f" at answer {self.answer_text.label()}"
        heads = [h for h in self.attention if h.visual_mass is not None]
        if heads:
            h = max(heads, key=lambda h: h.visual_mass)
            parts.append(f"most visual head L{h.layer}.H{h.head} {h.visual_mass:.2f}")
        if self.residual_decomposition is None:  # refused: its audit row says why
            parts.append("residual decomposition " + (self.undefined("residual DLA") or "not defined"))
            return "; ".join(parts)
        comps = self.residual_decomposition.components
        if comps:
            c = max(comps, key=lambda c: abs(c.dla_frozen))
            parts.append(f"largest frozen-scale DLA {c.name} {c.dla_frozen:+.2f}")
        parts.append(self.residual_decomposition.reconstruction_line(self.model.dtype))
        return "; ".join(parts)

    def parameters(self) -> dict:
        """What the run was called with: question, answer and foil tokens,
        rollout weight; ``raw_prompt``, ``attention`` (eager) and ``tuned_lens`` only when used."""
        out: dict[str, Any] = {
            "question": self.input.question,
            "answer": self.target.answer,
            "foil": self.target.foil,
            "rollout_alpha": self.rollout_alpha,
        }
        if self.input.raw_prompt:
            out["raw_prompt"] = True
        if self.input.attention != "sdpa":
            out["attention"] = self.input.attention
        out.update(run_parameters(self.answer_text))
        if self.tuned_lens is not None:
            out["tuned_lens"] = True
        return out

    def audit_records(self) -> list[AuditRecord]:
        return list(self.audit)

    def undefined(self, method: str) -> str | None:
        """What the audit row of ``method`` ("pattern analysis", "rollout / flow") says this
        architecture does not define (a hybrid decoder's layers without pattern), or None:
        what a panel marks beside its view, live and restored alike."""
        notes = [n for a in self.audit if a.method == method for n in a.notes]
        return next((n for n in notes if n.startswith(("not defined", "no attention pattern"))), None)

    @property
    def answer_text(self) -> AnswerText | None:
        """The answer token read out (None: the first token after the bare prompt)."""
        return self.input.answer_text

    @property
    def block_names(self) -> dict[int, str]:
        """``{block index: block name}`` of the blocks the attention rows cover, in block order."""
        return {h.layer: h.block for h in sorted(self.attention, key=lambda h: h.layer)}

    def head(self, layer: int, head: int) -> HeadSummary | None:
        """The attention row of head ``head`` in block ``layer``, or None."""
        return next((h for h in self.attention if h.layer == int(layer) and h.head == int(head)), None)


def _dict_or_none(section) -> dict | None:
    return section.to_dict() if section is not None else None


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
    the rows the read-outs use) or "eager" (see :func:`core.forward.capture.capture`);
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
        try:
            sections[readout.analyze_key], audit = readout.run(ctx)
        except UndefinedReadoutError as e:  # no meaning for this architecture (Gemma 3n's AltUp streams)
            empty = [] if readout.analyze_key in _LIST_SECTIONS else None
            sections[readout.analyze_key], audit = empty, AuditRecord.not_defined(readout.audit_method, str(e))
        if audit is not None:
            audits.append(audit)
    step(4, 4, "done")
    answer_section = sections.pop("target")
    return AnalyzeResult(
        model=AnalyzedModel.of(loaded),
        input=AnalyzeInput(
            question=question,
            prompt=adapter.prompt(question),
            raw_prompt=raw_prompt,
            input_ids=trace.input_ids[0].tolist(),
            tokens=ctx.token_strings,
            image_sha256=image_sha256(img),
            image_size=tuple(img.size),
            # as the JSON holds them (a resampler latent's box None): a live result reads as a restored one
            visual_tokens=[VisualToken.from_dict(t.to_dict()) for t in tokens],
            attention=attention,
            view_names=dict(view_names or {}),
            answer_text=answer_text,
            **adapter.dtype_and_device(),
        ),
        target=answer_section.target,
        top=answer_section.top,
        audit=audits,
        rollout_alpha=rollout_alpha,
        **sections,
    )
