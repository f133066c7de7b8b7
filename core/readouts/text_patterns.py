"""The text-side patterns read-out (analyze's ``text_patterns``): every
self-attention block's pattern among the prompt's text tokens. Analyze only:
``blocks x heads x TEXT_PATTERN_LIMIT^2`` weights per sample are no dataset table."""

from __future__ import annotations

from core.readouts.base import TEXT_PATTERN_LIMIT, ReadoutMethod


class TextPatternsReadout(ReadoutMethod):
    name = "text_patterns"
    audit_method = "pattern analysis"
    analyze_key = "text_patterns"
    dataset_scale = False
    patterns = "text"

    def run(self, ctx):
        """The :class:`core.methods.patterns.TextPatterns` of at most
        :data:`TEXT_PATTERN_LIMIT` text positions (those nearest the answer)
        among the rows the capture kept."""
        # function-local: see core.readouts
        from core.methods.patterns import text_patterns, text_positions

        kept = set(ctx.trace.query_positions.tolist())
        n_text_rows = sum(p in kept for p in text_positions(ctx.adapter, ctx.trace, batch=ctx.batch))
        text = text_patterns(
            ctx.adapter,
            ctx.trace,
            ctx.token_strings,
            batch=ctx.batch,
            max_tokens=min(TEXT_PATTERN_LIMIT, n_text_rows),
        )
        return text, text.audit
