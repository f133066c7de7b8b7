"""The answer-patterns read-out (analyze's ``answer_patterns``): each answer
query row's attention mass on the question, the earlier answer tokens and the
image (:mod:`core.methods.answer_patterns`). Analyze only."""

from __future__ import annotations

from core.readouts.base import ReadoutMethod


class AnswerPatternsReadout(ReadoutMethod):
    name = "answer_patterns"
    audit_method = "pattern analysis"
    analyze_key = "answer_patterns"
    dataset_scale = False
    patterns = "text"

    def run(self, ctx):
        # function-local: see core.readouts
        from core.methods.answer_patterns import answer_patterns

        result = answer_patterns(ctx.adapter, ctx.trace, len(ctx.answer_prefix), ctx.token_strings, batch=ctx.batch)
        return result, result.audit
