"""The answer read-out: the answer position's numbers in the one forward
(analyze's ``target``; the audit's ``answer`` section and its ``model output`` row)."""

from __future__ import annotations

from dataclasses import dataclass

from core.readouts.base import ReadoutMethod, distribution
from core.results.readout import Target
from core.shell.precision import accumulating


def target_of(adapter, logits, answer_id: int, foil_id: int | None, position: int | None) -> Target:
    """The :class:`core.results.readout.Target` of ``logits`` ``(vocab,)`` in their own
    (float32) arithmetic, the numbers analyze has always written (unlike
    :meth:`Target.from_logits`, which works in float64); half-precision logits
    are upcast first, so the softmax and the difference add no half-precision rounding."""
    logits = accumulating(logits)
    probs = logits.softmax(-1)
    predicted = int(logits.argmax())
    return Target(
        answer=adapter.token_str(answer_id),
        answer_id=answer_id,
        foil=adapter.token_str(foil_id) if foil_id is not None else None,
        foil_id=foil_id,
        logit=float(logits[answer_id]),
        logit_diff=float(logits[answer_id] - logits[foil_id]) if foil_id is not None else None,
        prob=float(probs[answer_id]),
        predicted=adapter.token_str(predicted),
        predicted_id=predicted,
        position=position,
    )


@dataclass(frozen=True)
class AnswerSection:
    """analyze's ``target``: the answer position's :class:`core.results.readout.Target` and the
    model's alternatives there, ``top`` ``[(token, probability), ...]`` (the first is
    the predicted token)."""

    target: Target
    top: list[tuple[str, float]]

    def to_dict(self) -> dict:
        """The position first, the Target's numbers, then ``top`` as ``[[token, p], ...]``."""
        d = self.target.to_dict()
        return {"position": d.pop("position"), **d, "top": [[t, p] for t, p in self.top]}

    @classmethod
    def from_dict(cls, d: dict) -> AnswerSection:
        return cls(Target.from_dict(d), [(t, p) for t, p in d.get("top", [])])


class AnswerReadout(ReadoutMethod):
    name = "answer"
    audit_method = "model output"
    analyze_key = "target"
    needs_capture = False

    def run(self, ctx):
        # function-local: see core.readouts
        from core.answer import answer_from_logits

        target = target_of(ctx.adapter, ctx.logits, ctx.answer_id, ctx.foil_id, ctx.position)
        # the model's answer and alternatives at this position: what core.answer gives, from this forward
        top = list(answer_from_logits(ctx.adapter, ctx.logits, ctx.options.answer_top_k).top)
        return AnswerSection(target, top), None

    def audit_section(self, section: AnswerSection, ctx):
        target = section.target
        return {
            "predicted_prob": section.top[0][1],  # the top token's probability is the predicted token's
            "answer_id": target.answer_id,
            "foil_id": target.foil_id,
            "answer_logit": target.logit,
            "answer_prob": target.prob,
            "logit_diff": target.logit_diff,
            "top": [[t, p] for t, p in section.top],
        }

    def csv_columns(self):
        return ["predicted_prob", "answer_prob", "answer_logit", "logit_diff"]

    def csv_values(self, s):
        return {k: s[k] for k in self.csv_columns()}

    def summarize(self, sections):
        return {
            "answer_prob": distribution([s["answer_prob"] for s in sections], (0.0, 1.0)),
            "predicted_prob": distribution([s["predicted_prob"] for s in sections], (0.0, 1.0)),
            "answer_logit": distribution([s["answer_logit"] for s in sections]),
            "logit_diff": distribution([s["logit_diff"] for s in sections]),
        }

    def controls(self):
        return ["dataset answer and foil as the target", "correct = top token equals the dataset answer"]

    def parameters(self, options):
        return {"top_k": options.answer_top_k}

    def notes(self):
        return ["accuracy and margins describe behaviour on this sample set; they name no internal route"]
