"""What the audit says over its samples: counts and distributions split into
correct / incorrect samples, routing against the causal effect (Spearman,
:func:`core.methods.stats.spearman`), the audit table and ``summary.md``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from core.methods.stats import spearman
from core.readouts import ReadoutMethod
from core.readouts.base import distribution
from core.results.audit import AuditRecord

DATASET_CONTROLS = [
    "distributions over samples (quantiles, histogram), not only means",
    "correct and incorrect samples summarised apart",
    "error samples counted and left out of every distribution",
]


def summarize(records: list[dict], methods: list[ReadoutMethod], n_requested: int, cancelled: bool) -> dict:
    """Counts and distributions, split into correct / incorrect samples."""
    ok = [r for r in records if r["status"] == "ok"]
    groups = {
        "all": ok,
        "correct": [r for r in ok if r["correct"] is True],
        "incorrect": [r for r in ok if r["correct"] is False],
    }
    unlabelled = [r for r in ok if r["correct"] is None]
    if unlabelled:
        groups["unlabelled"] = unlabelled
    labelled = len(groups["correct"]) + len(groups["incorrect"])
    by_kind: dict[str, dict] = {}
    for kind in sorted({r["kind"] for r in ok if r["kind"] is not None and r["correct"] is not None}):
        rs = [r for r in ok if r["kind"] == kind and r["correct"] is not None]
        by_kind[kind] = {"n": len(rs), "accuracy": sum(r["correct"] for r in rs) / len(rs)}
    shares = [r["region"]["token_share"] for r in ok if r.get("region") and r["region"]["token_share"] is not None]
    doc = {
        "n_requested": n_requested,
        "n_samples": len(records),
        "cancelled": cancelled,
        "n_ok": len(ok),
        "n_errors": len(records) - len(ok),
        "errors": [{"index": r["index"], "image": r["image"], "error": r["error"]} for r in records if r["error"]],
        "n_correct": len(groups["correct"]),
        "n_incorrect": len(groups["incorrect"]),
        "n_unlabelled": len(unlabelled),
        "accuracy": len(groups["correct"]) / labelled if labelled else None,
        "by_kind": by_kind,
        "region_token_share": distribution(shares, (0.0, 1.0)),
        "groups": {
            g: {"n": len(rs), **{m.name: m.summarize([r["readouts"][m.name] for r in rs]) for m in methods}}
            for g, rs in groups.items()
        },
    }
    names = {m.name for m in methods}
    if "counterfactual" in names and names & {"attention", "rollout"}:
        doc["routing_vs_effect"] = routing_vs_effect(ok)
    return doc


def routing_vs_effect(records: list[dict]) -> dict:
    """Across samples with a counterfactual: Spearman correlation of each
    routing read-out of the target region with the causal drop (answer
    minus foil logit difference, original minus edited). A low value is where
    attention and the cause disagree."""
    out: dict[str, Any] = {
        "effect": "drop of the answer-minus-foil logit difference when the target region is filled",
        "note": "routing mass ranks regions by co-occurrence only; the counterfactual is the causal read-out",
    }
    pairs: dict[str, tuple[list, list]] = {"rollout_region_mass": ([], []), "mean_head_region_mass": ([], [])}
    for r in records:
        cfs = r["readouts"].get("counterfactual") or {}
        if cfs.get("skipped") is not None or "effect" not in cfs:
            continue
        drop = cfs["effect"]["drop"]
        ro = r["readouts"].get("rollout") or {}
        if ro.get("region_mass") is not None:
            pairs["rollout_region_mass"][0].append(ro["region_mass"])
            pairs["rollout_region_mass"][1].append(drop)
        heads = [h["region_mass"] for h in (r["readouts"].get("attention") or {}).get("heads", [])]
        heads = [v for v in heads if v is not None]
        if heads:
            pairs["mean_head_region_mass"][0].append(sum(heads) / len(heads))
            pairs["mean_head_region_mass"][1].append(drop)
    for name, (x, y) in pairs.items():
        out[name] = {"n": len(x), "spearman": spearman(x, y)}
    return out


def audit_table(
    methods: list[ReadoutMethod], first_audits: dict | None, run_params: dict, options
) -> list[AuditRecord]:
    """One row per method: the chapter's columns, the controls this run applied
    (the method's own, as its first successful sample recorded them, plus the
    dataset-level ones) and the run's parameters."""
    rows = []
    for m in methods:
        first = (first_audits or {}).get(m.name)
        controls = list(first["controls"]) if first else []
        notes = list(first["notes"]) if first else []
        for c in [*m.controls(), *DATASET_CONTROLS]:
            if c not in controls:
                controls.append(c)
        for n in m.notes():
            if n not in notes:
                notes.append(n)
        params = {"readout": m.name, **m.parameters(options), **run_params}
        rows.append(AuditRecord.for_method(m.audit_method, controls=controls, parameters=params, notes=notes))
    return rows


@dataclass
class AuditSummary:
    """The one session run of a dataset audit (kind ``audit``): what it was run with
    (``run_parameters``), :func:`summarize`'s counts and distributions, and the folder
    its per-sample files went to (``out``). Per-sample numbers stay in those files."""

    schema_version: int
    run_parameters: dict
    n_requested: int
    n_samples: int
    cancelled: bool
    n_ok: int
    n_errors: int
    errors: list[dict]
    n_correct: int
    n_incorrect: int
    n_unlabelled: int
    accuracy: float | None
    by_kind: dict
    region_token_share: dict | None
    groups: dict
    out: str | None  # None: an in-process run that wrote no folder
    routing_vs_effect: dict | None = None
    audits: list[AuditRecord] = field(default_factory=list, repr=False)

    kind: ClassVar[str] = "audit"

    def summary(self) -> str:
        """``20 samples: 19 ok, 1 errors; accuracy 0.85`` (and ``(cancelled)``)."""
        line = f"{self.n_samples} samples: {self.n_ok} ok, {self.n_errors} errors; accuracy "
        return line + (format_number(self.accuracy) or "n/a") + (" (cancelled)" if self.cancelled else "")

    def parameters(self) -> dict:
        return dict(self.run_parameters)

    def audit_records(self) -> list[AuditRecord]:
        return list(self.audits)

    def to_dict(self) -> dict:
        doc = {
            "schema_version": self.schema_version,
            "parameters": self.run_parameters,
            "n_requested": self.n_requested,
            "n_samples": self.n_samples,
            "cancelled": self.cancelled,
            "n_ok": self.n_ok,
            "n_errors": self.n_errors,
            "errors": self.errors,
            "n_correct": self.n_correct,
            "n_incorrect": self.n_incorrect,
            "n_unlabelled": self.n_unlabelled,
            "accuracy": self.accuracy,
            "by_kind": self.by_kind,
            "region_token_share": self.region_token_share,
            "groups": self.groups,
        }
        if self.routing_vs_effect is not None:
            doc["routing_vs_effect"] = self.routing_vs_effect
        return {**doc, "out": self.out}

    @classmethod
    def from_dict(cls, d: dict) -> AuditSummary:
        """The run an ``audit`` JSON (:meth:`to_dict`, a stored run's) describes (its audit
        rows are the session's, not in the JSON)."""
        return cls(
            int(d["schema_version"]),
            dict(d["parameters"]),
            int(d["n_requested"]),
            int(d["n_samples"]),
            bool(d["cancelled"]),
            int(d["n_ok"]),
            int(d["n_errors"]),
            list(d["errors"]),
            int(d["n_correct"]),
            int(d["n_incorrect"]),
            int(d["n_unlabelled"]),
            d["accuracy"],
            dict(d["by_kind"]),
            d["region_token_share"],
            dict(d["groups"]),
            d["out"],
            d.get("routing_vs_effect"),
        )


def format_number(x) -> str:
    """A number as summary.md writes it (4 significant digits; None blank)."""
    return "" if x is None else f"{x:.4g}"


def _median(d: dict | None) -> str:
    return format_number(d["quantiles"]["0.5"]) if d else ""


def _median_table(
    title: str, column: str, top: list[dict], names: list[str], by_group: dict[str, dict[str, dict]], key: str
) -> list[str]:
    """Markdown lines: one row per entry of ``top``, one column per group, each
    cell the median of that entry's ``key`` distribution in the group (blank
    when the group lacks the entry)."""
    lines = [title, "", f"| {column} | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for item in top:
        cells = [_median(by_group[n][item["name"]][key]) if item["name"] in by_group[n] else "" for n in names]
        lines.append(f"| {item['name']} | " + " | ".join(cells) + " |")
    return lines + [""]


def summary_markdown(summary: dict, run_params: dict) -> str:
    s = summary
    lines = [
        f"# Audit of {run_params['model']} on {run_params['dataset']}",
        "",
        f"samples {s['n_samples']} (requested {s['n_requested']}{', cancelled' if s['cancelled'] else ''}); "
        f"ok {s['n_ok']}, errors {s['n_errors']}; correct {s['n_correct']}, incorrect {s['n_incorrect']}, "
        f"unlabelled {s['n_unlabelled']}; accuracy {format_number(s['accuracy'])}",
        "",
    ]
    if s["by_kind"]:
        lines += ["| kind | n | accuracy |", "|---|---|---|"]
        lines += [f"| {k} | {v['n']} | {format_number(v['accuracy'])} |" for k, v in s["by_kind"].items()]
        lines.append("")
    g = s["groups"]
    names = [n for n in ("all", "correct", "incorrect", "unlabelled") if n in g]
    scalar = []
    if "answer" in g["all"]:
        scalar += [("answer prob", "answer", "answer_prob"), ("logit diff", "answer", "logit_diff")]
    if "rollout" in g["all"]:
        scalar += [("rollout visual mass", "rollout", "visual_mass"), ("rollout region mass", "rollout", "region_mass")]
    if "counterfactual" in g["all"]:
        scalar += [("drop when the target is filled", "counterfactual", "drop")]
    if scalar:
        lines += ["Medians (n per group: " + ", ".join(f"{n} {g[n]['n']}" for n in names) + ")", ""]
        lines += ["| quantity | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for label, m, k in scalar:
            lines.append(f"| {label} | " + " | ".join(_median(g[n][m][k]) for n in names) + " |")
        lines.append("")
    if "attention" in g["all"] and g["all"]["attention"]["heads"]:
        heads = {h["name"]: h for h in g["all"]["attention"]["heads"]}
        top = sorted(heads.values(), key=lambda h: -(h["visual_mass"] or {"mean": 0})["mean"])[:5]
        by_group = {n: {x["name"]: x for x in g[n]["attention"]["heads"]} for n in names}
        title = "Heads with the most answer-row visual mass (median by group)"
        lines += _median_table(title, "head", top, names, by_group, "visual_mass")
    if "dla" in g["all"] and g["all"]["dla"]["components"]:
        comps = [c for c in g["all"]["dla"]["components"] if c["dla_frozen"]]
        top = sorted(comps, key=lambda c: -abs(c["dla_frozen"]["quantiles"]["0.5"]))[:5]
        by_group = {n: {x["name"]: x for x in g[n]["dla"]["components"]} for n in names}
        title = "Components with the largest median frozen-scale DLA"
        lines += _median_table(title, "component", top, names, by_group, "dla_frozen")
    rve = s.get("routing_vs_effect")
    if rve:
        lines += ["Does routing onto the target region rank the causal drop? (Spearman across samples)", ""]
        for k in ("rollout_region_mass", "mean_head_region_mass"):
            lines.append(f"- {k}: {format_number(rve[k]['spearman'])} (n {rve[k]['n']})")
        lines.append("")
    if s["errors"]:
        lines += ["Errors", ""] + [f"- sample {e['index']} ({e['image']}): {e['error']}" for e in s["errors"][:20]]
        if len(s["errors"]) > 20:
            lines.append(f"- ... {len(s['errors']) - 20} more in summary.json")
        lines.append("")
    lines.append("Read-outs show routing and readability, not causes; see audit.md for what each can support.")
    return "\n".join(lines) + "\n"
