"""The residual decomposition / direct logit attribution read-out (analyze's
``residual_decomposition``; the audit's ``dla`` section, ``components.csv``)."""

from __future__ import annotations

from core.readouts.base import ReadoutMethod, distribution

# The reconstruction verdict (core.methods.residual.ResidualDecomposition): the error relative
# to |x_L|, the bound the model dtype's rounding allows, whether the error is within it.
RECONSTRUCTION_KEYS = ("reconstruction_rel_err", "reconstruction_bound", "reconstruction_ok")


def reconstruction_verdict(res) -> dict:
    """``{key: value}`` of :data:`RECONSTRUCTION_KEYS` of a decomposition."""
    return {k: getattr(res, k) for k in RECONSTRUCTION_KEYS}


def reconstruction_line(section: dict, dtype: str | None) -> str:
    """``reconstruction error 1.2e-03 of |x_L| (bound 3.1e-02 for bfloat16): ok``
    from an analyze ``residual_decomposition`` section (the summary line, the DLA
    tab); a JSON written before the verdict existed gives its max abs error alone."""
    if "reconstruction_rel_err" not in section:
        return f"reconstruction error {section['reconstruction_max_abs_err']:.2e}"
    verdict = "ok" if section["reconstruction_ok"] else "NOT EXACT"
    return (
        f"reconstruction error {section['reconstruction_rel_err']:.2e} of |x_L| "
        f"(bound {section['reconstruction_bound']:.2e} for {dtype or 'the model dtype'}): {verdict}"
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
        section = {
            "reconstruction_max_abs_err": res.reconstruction_max_abs_err,
            **reconstruction_verdict(res),
            "target_logit": res.target_logit,
            "frozen_sum_expected": res.frozen_sum_expected,
            "components": [c.to_dict() for c in res.components],
        }
        return section, res.audit

    def audit_section(self, section, ctx):
        comps = section["components"]
        order = sorted(range(len(comps)), key=lambda i: (-abs(comps[i]["dla_frozen"]), i))
        return {
            "position": ctx.position,
            "reconstruction_max_abs_err": section["reconstruction_max_abs_err"],
            **{k: section[k] for k in RECONSTRUCTION_KEYS},
            "target_logit": section["target_logit"],
            "frozen_sum_expected": section["frozen_sum_expected"],
            "top": [comps[i] for i in order[: ctx.options.dla_top_k]],
            "dla_frozen": {c["name"]: c["dla_frozen"] for c in comps},
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
