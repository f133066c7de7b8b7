"""The rollout read-out: the answer row's rollout mass on the visual tokens
(analyze's ``rollout``; the audit's ``rollout`` section). One implementation,
:func:`core.methods.patterns.rollout_visual_mass`, for both."""

from __future__ import annotations

from core.readouts.base import ReadoutMethod, distribution, patch_mass


class RolloutReadout(ReadoutMethod):
    name = "rollout"
    audit_method = "rollout / flow"
    analyze_key = "rollout"
    patterns = "rollout"

    def run(self, ctx):
        """``({alpha, visual_patch_mass, primary_image[, visual_patch_mass_by_image]}, audit)``,
        or ``(None, None)`` when the capture fed no rollout stream (a long prompt)."""
        # function-local: see core.readouts
        from core.methods.patterns import primary_image, rollout_audit, rollout_visual_mass

        if ctx.rollout is None:
            return None, None
        alpha = ctx.options.rollout_alpha
        grids = rollout_visual_mass(ctx.trace, ctx.tokens, alpha, batch=ctx.batch, stream=ctx.rollout)
        primary = primary_image(ctx.tokens)
        patch_map = dict(grids)[primary].tolist() if primary is not None else None  # latents cover no patch: no map
        section = {"alpha": alpha, "visual_patch_mass": patch_map, "primary_image": primary}
        if len(grids) > 1:
            section["visual_patch_mass_by_image"] = [{"image": im, "grid": g.tolist()} for im, g in grids]
        return section, rollout_audit(alpha, "mean")

    def audit_section(self, section, ctx):
        """The mass on the patch tokens (the grid's cells, float64), on the target
        region (each token weighted by its share inside the mask) and the argmax patch."""
        # function-local: see core.readouts
        from core.methods.patterns import FULL_PATTERN_LIMIT

        alpha = ctx.options.rollout_alpha
        if section is None:
            return {"alpha": alpha, "skipped": f"prompt longer than {FULL_PATTERN_LIMIT} tokens"}
        if section["visual_patch_mass"] is None:
            return {"alpha": alpha, "skipped": "the visual tokens cover no patch (a resampler's latents): no patch map"}
        m = patch_mass(ctx.tokens, section["visual_patch_mass"], section.get("visual_patch_mass_by_image"), ctx.cover)
        return {
            "alpha": alpha,
            "skipped": None,
            "visual_mass": m.total,
            "region_mass": m.region,
            "argmax_patch": [ctx.tokens[m.argmax].row, ctx.tokens[m.argmax].col] if m.argmax is not None else None,
        }

    def csv_columns(self):
        return ["rollout_visual_mass", "rollout_region_mass"]

    def csv_values(self, s):
        return {"rollout_visual_mass": s.get("visual_mass"), "rollout_region_mass": s.get("region_mass")}

    def summarize(self, sections):
        return {
            "n_skipped": sum(1 for s in sections if s.get("skipped")),
            "visual_mass": distribution([s.get("visual_mass") for s in sections], (0.0, 1.0)),
            "region_mass": distribution([s.get("region_mass") for s in sections], (0.0, 1.0)),
        }

    def controls(self):
        return ["head-mean patterns", "answer-position row"]

    def parameters(self, options):
        # function-local: see core.readouts
        from core.methods.patterns import FULL_PATTERN_LIMIT

        return {"alpha": options.rollout_alpha, "heads": "mean", "full_pattern_limit": FULL_PATTERN_LIMIT}
