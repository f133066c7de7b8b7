"""The residual decomposition / direct logit attribution read-out (analyze's
``residual_decomposition``; the audit's ``dla`` section, ``components.csv``)."""

from __future__ import annotations

from core.readouts.base import ReadoutMethod, distribution


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
            "target_logit": section["target_logit"],
            "frozen_sum_expected": section["frozen_sum_expected"],
            "top": [comps[i] for i in order[: ctx.options.dla_top_k]],
            "dla_frozen": {c["name"]: c["dla_frozen"] for c in comps},
        }

    def csv_columns(self):
        cols = []
        for k in range(1, self.CSV_TOP + 1):
            cols += [f"dla_top{k}_name", f"dla_top{k}_frozen"]
        return [*cols, "dla_reconstruction_err"]

    def csv_values(self, s):
        out = {}
        for k in range(1, self.CSV_TOP + 1):
            c = s["top"][k - 1] if len(s["top"]) >= k else None
            out[f"dla_top{k}_name"] = c["name"] if c else None
            out[f"dla_top{k}_frozen"] = c["dla_frozen"] if c else None
        out["dla_reconstruction_err"] = s["reconstruction_max_abs_err"]
        return out

    def long_rows(self, index, s):
        return [{"index": index, "rank": r, **c} for r, c in enumerate(s["top"])]

    def summarize(self, sections):
        if not sections:
            return {"components": []}
        names = list(sections[0]["dla_frozen"])
        return {
            "reconstruction_max_abs_err": max(s["reconstruction_max_abs_err"] for s in sections),
            "components": [
                {"name": n, "dla_frozen": distribution([s["dla_frozen"].get(n) for s in sections])} for n in names
            ],
        }

    def parameters(self, options):
        return {"position": "answer position", "top_k_written": options.dla_top_k}
