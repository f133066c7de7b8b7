"""The residual decomposition / direct logit attribution read-out (analyze's
``residual_decomposition``; the audit's ``dla`` section, ``components.csv``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.readouts.base import ReadoutMethod, distribution
from core.results.readout import from_dict_fields

if TYPE_CHECKING:
    from core.methods.residual import Component

# The reconstruction verdict (core.methods.residual.ResidualDecomposition): the error relative
# to |x_L|, the bound the model dtype's rounding allows, whether the error is within it.
RECONSTRUCTION_KEYS = ("reconstruction_rel_err", "reconstruction_bound", "reconstruction_ok")


@dataclass(frozen=True)
class ResidualSection:
    """analyze's ``residual_decomposition``: the components of x_L at the answer
    position (:class:`core.methods.residual.Component`, every convention) and how
    well they sum to it. The verdict (``reconstruction_rel_err``, ``_bound``,
    ``_ok``) is None only in a JSON written before it existed, whose document has
    no such keys."""

    reconstruction_max_abs_err: float
    target_logit: float
    frozen_sum_expected: float
    components: list[Component]
    reconstruction_rel_err: float | None = None
    reconstruction_bound: float | None = None
    reconstruction_ok: bool | None = None

    @classmethod
    def of(cls, res) -> ResidualSection:
        """The section of a :class:`core.methods.residual.ResidualDecomposition`."""
        return cls(
            res.reconstruction_max_abs_err,
            res.target_logit,
            res.frozen_sum_expected,
            list(res.components),
            **{k: getattr(res, k) for k in RECONSTRUCTION_KEYS},
        )

    def to_dict(self) -> dict:
        verdict = {k: getattr(self, k) for k in RECONSTRUCTION_KEYS} if self.reconstruction_ok is not None else {}
        return {
            "reconstruction_max_abs_err": self.reconstruction_max_abs_err,
            **verdict,
            "target_logit": self.target_logit,
            "frozen_sum_expected": self.frozen_sum_expected,
            "components": [c.to_dict() for c in self.components],
        }

    @classmethod
    def from_dict(cls, d: dict) -> ResidualSection:
        # function-local: see core.readouts
        from core.methods.residual import Component

        return cls(
            d["reconstruction_max_abs_err"],
            d["target_logit"],
            d["frozen_sum_expected"],
            [from_dict_fields(Component, c) for c in d["components"]],
            **{k: d.get(k) for k in RECONSTRUCTION_KEYS},
        )

    def component_values(self, field: str) -> dict[str, float]:
        """``{component name: its value under convention field}`` (``dla_frozen``, ``norm``...)."""
        return {c.name: getattr(c, field) for c in self.components}

    def reconstruction_line(self, dtype: str | None) -> str:
        """``reconstruction error 1.2e-03 of |x_L| (bound 3.1e-02 for bfloat16): ok`` (the
        summary line, the DLA tab); a JSON written before the verdict existed gives its max
        abs error alone."""
        if self.reconstruction_ok is None:
            return f"reconstruction error {self.reconstruction_max_abs_err:.2e}"
        verdict = "ok" if self.reconstruction_ok else "NOT EXACT"
        return (
            f"reconstruction error {self.reconstruction_rel_err:.2e} of |x_L| "
            f"(bound {self.reconstruction_bound:.2e} for {dtype or 'the model dtype'}): {verdict}"
        )


class DlaReadout(ReadoutMethod):
    name = "dla"
    audit_method = "residual DLA"
    analyze_key = "residual_decomposition"
    long_table = ("components.csv", ["index", "rank", "name", "norm", "projection", "dla_frozen", "dla_jacobian"])
    CSV_TOP = 3

    def run(self, ctx):
        # function-local: see core.readouts
        from core.methods.residual import decompose

        res = decompose(ctx.adapter, ctx.trace, ctx.answer_id, ctx.foil_id, batch=ctx.batch)
        return ResidualSection.of(res), res.audit

    def audit_section(self, section: ResidualSection, ctx):
        comps = section.components
        order = sorted(range(len(comps)), key=lambda i: (-abs(comps[i].dla_frozen), i))
        return {
            "position": ctx.position,
            "reconstruction_max_abs_err": section.reconstruction_max_abs_err,
            **{k: getattr(section, k) for k in RECONSTRUCTION_KEYS},
            "target_logit": section.target_logit,
            "frozen_sum_expected": section.frozen_sum_expected,
            "top": [comps[i].to_dict() for i in order[: ctx.options.dla_top_k]],
            "dla_frozen": section.component_values("dla_frozen"),
        }

    def csv_columns(self):
        cols = []
        for k in range(1, self.CSV_TOP + 1):
            cols += [f"dla_top{k}_name", f"dla_top{k}_frozen"]
        return [*cols, "dla_reconstruction_err", "dla_reconstruction_rel_err", "dla_reconstruction_ok"]

    def csv_values(self, s):
        out = {}
        for k in range(1, self.CSV_TOP + 1):
            c = s["top"][k - 1] if len(s["top"]) >= k else None
            out[f"dla_top{k}_name"] = c["name"] if c else None
            out[f"dla_top{k}_frozen"] = c["dla_frozen"] if c else None
        out["dla_reconstruction_err"] = s["reconstruction_max_abs_err"]
        out["dla_reconstruction_rel_err"] = s["reconstruction_rel_err"]
        out["dla_reconstruction_ok"] = s["reconstruction_ok"]
        return out

    def long_rows(self, index, s):
        return [{"index": index, "rank": r, **c} for r, c in enumerate(s["top"])]

    def summarize(self, sections):
        if not sections:
            return {"components": []}
        names = list(sections[0]["dla_frozen"])
        return {
            "reconstruction_max_abs_err": max(s["reconstruction_max_abs_err"] for s in sections),
            "reconstruction_rel_err": max(s["reconstruction_rel_err"] for s in sections),
            # samples whose split is not exact to their dtype's rounding (core.methods.residual.reconstruction_bound)
            "reconstruction_failures": sum(not s["reconstruction_ok"] for s in sections),
            "components": [
                {"name": n, "dla_frozen": distribution([s["dla_frozen"].get(n) for s in sections])} for n in names
            ],
        }

    def parameters(self, options):
        return {"position": "answer position", "top_k_written": options.dla_top_k}
