"""The answer row's head patterns (analyze's ``attention``; the audit's
``attention`` section with each head's mass on the target region, ``heads.csv``). Its
section is one :class:`core.methods.patterns.HeadSummary` per (block, head)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.readouts.base import ReadoutMethod, distribution, patch_mass

if TYPE_CHECKING:
    from core.methods.patterns import HeadSummary


def has_visual_keys(trace, block: int) -> bool:
    """Whether ``block`` attends to visual tokens (a text-only block of a cross-attention model does not)."""
    return trace.block_kinds[block] == "cross" or bool(trace.visual_positions.shape[1])


class AttentionReadout(ReadoutMethod):
    name = "attention"
    audit_method = "pattern analysis"
    analyze_key = "attention"
    patterns = "answer"
    long_table = (
        "heads.csv",
        [
            "index",
            "block",
            "head",
            "name",
            "visual_mass",
            "sink_mass",
            "entropy",
            "argmax_source",
            "region_mass",
            "region_hit",
        ],
    )

    def run(self, ctx):
        # function-local: see core.readouts
        from core.methods.patterns import summarize_heads

        summary = summarize_heads(ctx.adapter, ctx.trace, ctx.tokens, query_index=ctx.query_index, batch=ctx.batch)
        return list(summary.heads), summary.audit

    def audit_section(self, section: list[HeadSummary], ctx):
        heads = []
        for h in section:
            visual = has_visual_keys(ctx.trace, h.layer)
            region_mass = region_hit = None
            if visual and ctx.cover is not None:  # mass weighted by each token's share inside the target mask
                m = patch_mass(ctx.tokens, h.visual_patch_mass, h.visual_patch_mass_by_image, ctx.cover)
                region_mass = m.region
                region_hit = m.argmax in set(ctx.region or ()) if m.argmax is not None else None
            heads.append(
                {
                    "block": h.layer,
                    "head": h.head,
                    "name": h.name,
                    "visual_mass": h.visual_mass,
                    "sink_mass": h.bos_mass,
                    "other_mass": h.other_mass,
                    "entropy": h.entropy,
                    "argmax_source": h.argmax_source,
                    "has_visual_keys": visual,
                    "region_mass": region_mass,
                    "region_hit": region_hit,
                }
            )
        return {"query_position": ctx.position, "heads": heads}

    def csv_columns(self):
        return [
            "attn_max_visual_mass",
            "attn_max_visual_head",
            "attn_mean_visual_mass",
            "attn_mean_sink_mass",
            "attn_max_region_mass",
            "attn_max_region_head",
        ]

    def csv_values(self, s):
        vis = [h for h in s["heads"] if h["has_visual_keys"]]
        reg = [h for h in vis if h["region_mass"] is not None]
        top = max(vis, key=lambda h: h["visual_mass"]) if vis else None
        top_r = max(reg, key=lambda h: h["region_mass"]) if reg else None
        return {
            "attn_max_visual_mass": top["visual_mass"] if top else None,
            "attn_max_visual_head": top["name"] if top else None,
            "attn_mean_visual_mass": sum(h["visual_mass"] for h in vis) / len(vis) if vis else None,
            "attn_mean_sink_mass": sum(h["sink_mass"] for h in s["heads"]) / len(s["heads"]),
            "attn_max_region_mass": top_r["region_mass"] if top_r else None,
            "attn_max_region_head": top_r["name"] if top_r else None,
        }

    def long_rows(self, index, s):
        cols = self.long_table[1][1:]
        return [{"index": index, **{k: h[k] for k in cols}} for h in s["heads"]]

    def summarize(self, sections):
        if not sections:
            return {"heads": []}
        per_head = list(zip(*[s["heads"] for s in sections]))
        out = []
        for rows in per_head:
            hits = [r["region_hit"] for r in rows if r["region_hit"] is not None]
            out.append(
                {
                    "block": rows[0]["block"],
                    "head": rows[0]["head"],
                    "name": rows[0]["name"],
                    "has_visual_keys": rows[0]["has_visual_keys"],
                    "visual_mass": distribution([r["visual_mass"] for r in rows], (0.0, 1.0)),
                    "sink_mass": distribution([r["sink_mass"] for r in rows], (0.0, 1.0)),
                    "entropy": distribution([r["entropy"] for r in rows]),
                    "region_mass": distribution([r["region_mass"] for r in rows], (0.0, 1.0)),
                    "region_hit_rate": sum(hits) / len(hits) if hits else None,
                    "n_region_samples": len(hits),
                }
            )
        return {"heads": out}

    def controls(self):
        return ["region mass weighted by each token's overlap with the target mask"]

    def parameters(self, options):
        return {"query": "answer position", "region_min_cover": options.region_min_cover}

    def notes(self):
        return [
            "per-head patch grids are left out at dataset scale; run analyze on a sample for them",
            "the region hit rate's chance level is the region's share of patch tokens (summary: region_token_share)",
        ]
