"""The rollout read-out: the answer row's rollout mass on the visual tokens
(analyze's ``rollout``; the audit's ``rollout`` section). One implementation,
:func:`core.methods.patterns.rollout_visual_mass`, for both."""

from __future__ import annotations

from dataclasses import dataclass

from core.readouts.base import ReadoutMethod, distribution, patch_mass


@dataclass(frozen=True)
class RolloutSection:
    """analyze's ``rollout``: the answer row's rollout mass on the visual tokens at
    weight ``alpha``, laid out on the patch grid of image ``primary_image``
    (``visual_patch_mass``; None: the visual tokens cover no patch), and every
    image's grid (``visual_patch_mass_by_image``, ``[{"image", "grid"}]``) when the
    model sees several (else None, and no such key in the JSON)."""

    alpha: float
    visual_patch_mass: list[list[float]] | None
    primary_image: int | None
    visual_patch_mass_by_image: list[dict] | None = None

    def to_dict(self) -> dict:
        d = {"alpha": self.alpha, "visual_patch_mass": self.visual_patch_mass, "primary_image": self.primary_image}
        if self.visual_patch_mass_by_image is not None:
            d["visual_patch_mass_by_image"] = self.visual_patch_mass_by_image
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RolloutSection:
        return cls(d["alpha"], d["visual_patch_mass"], d.get("primary_image"), d.get("visual_patch_mass_by_image"))


class RolloutReadout(ReadoutMethod):
    name = "rollout"
    audit_method = "rollout / flow"
    analyze_key = "rollout"
    patterns = "rollout"

    def run(self, ctx):
        """``(RolloutSection, audit)``, or ``(None, None)`` when the capture fed no rollout stream (a long prompt)."""
        # function-local: see core.readouts
        from core.forward.capture import no_pattern_note
        from core.methods.patterns import primary_image, rollout_audit, rollout_visual_mass
        from core.results.audit import AuditRecord

        if ctx.rollout is None:
            note = no_pattern_note(ctx.adapter, ctx.trace)  # a hybrid decoder: some layers have no pattern
            if note is not None:
                return None, AuditRecord.not_defined(
                    "rollout / flow", f"rollout multiplies every layer's pattern; {note}"
                )
            return None, None
        alpha = ctx.options.rollout_alpha
        grids = rollout_visual_mass(ctx.trace, ctx.tokens, alpha, batch=ctx.batch, stream=ctx.rollout)
        primary = primary_image(ctx.tokens)
        patch_map = dict(grids)[primary].tolist() if primary is not None else None  # latents cover no patch: no map
        by_image = [{"image": im, "grid": g.tolist()} for im, g in grids] if len(grids) > 1 else None
        return RolloutSection(alpha, patch_map, primary, by_image), rollout_audit(alpha, "mean")

    def audit_section(self, section: RolloutSection | None, ctx):
        """The mass on the patch tokens (the grid's cells, float64), on the target
        region (each token weighted by its share inside the mask) and the argmax patch."""
        # function-local: see core.readouts
        from core.forward.capture import no_pattern_note
        from core.methods.patterns import FULL_PATTERN_LIMIT

        alpha = ctx.options.rollout_alpha
        if section is None:
            note = no_pattern_note(ctx.adapter, ctx.trace)
            if note is not None:
                return {"alpha": alpha, "skipped": f"not defined: {note}"}
            return {"alpha": alpha, "skipped": f"prompt longer than {FULL_PATTERN_LIMIT} tokens"}
        if section.visual_patch_mass is None:
            return {"alpha": alpha, "skipped": "the visual tokens cover no patch (a resampler's latents): no patch map"}
        m = patch_mass(ctx.tokens, section.visual_patch_mass, section.visual_patch_mass_by_image, ctx.cover)
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
