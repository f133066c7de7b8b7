"""The audit's files: ``samples.csv`` / ``.jsonl`` (/ ``.parquet``), the
read-outs' long tables, ``summary.json`` / ``.md``, ``audit.csv`` / ``.md`` /
``.json``; tables through the one set of writers (:func:`core.results.audit_tables.audit_csv`,
:func:`core.results.audit_tables.audit_markdown`), JSON through :func:`core.results.readout.jsonable`."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from core.dataset_audit.sharding import ShardResult
from core.dataset_audit.summaries import audit_table, summarize, summary_markdown
from core.files.atomic import Staging
from core.readouts import ReadoutMethod, ReadoutOptions
from core.results.audit_tables import audit_csv, audit_markdown, cell
from core.results.readout import jsonable

SCHEMA_VERSION = 1

BASE_COLUMNS = [
    "index",
    "id",
    "image",
    "question",
    "answer",
    "foil",
    "kind",
    "template",
    "status",
    "error",
    "predicted",
    "correct",
    "region_area_px",
    "region_n_tokens",
]


def sample_rows(records: list[dict], methods: list[ReadoutMethod]) -> tuple[list[str], list[dict]]:
    """The flat per-sample table: columns and one dict per record."""
    columns = list(BASE_COLUMNS)
    for m in methods:
        columns += m.csv_columns()
    rows = []
    for r in records:
        row = {k: r.get(k) for k in BASE_COLUMNS}
        region = r.get("region") or {}
        row["region_area_px"] = region.get("area_px")
        row["region_n_tokens"] = region.get("n_tokens")
        if r["status"] == "ok":
            for m in methods:
                if m.name in r["readouts"]:
                    row.update(m.csv_values(r["readouts"][m.name]))
        rows.append(row)
    return columns, rows


def _parquet(columns: list[str], rows: list[dict]) -> bytes:
    """``samples.parquet`` (pyarrow, an optional extra)."""
    import pyarrow as pa  # function-local: optional, and found only when installed
    import pyarrow.parquet as pq

    try:  # typed columns (numbers stay numbers) ...
        table = pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in rows])
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # ... unless a column mixes types: then as CSV text
        table = pa.Table.from_pylist([{c: cell(r.get(c)) for c in columns} for r in rows])
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def write_outputs(
    staging: Staging,
    out: str | Path,
    merged: ShardResult,
    methods: list[ReadoutMethod],
    run_params: dict,
    options: ReadoutOptions,
    n_requested: int,
) -> list[str]:
    """Stage every output file but run.json into the folder ``out``
    (:func:`core.files.atomic.staged_writes`: they land together when the caller's
    block ends, after its ``--session`` run is recorded); returns their names."""
    out = Path(out)
    records = [jsonable(r) for r in merged.records]
    written = []

    def put(name: str, text: str) -> None:
        staging.add(out / name, text.encode())
        written.append(name)

    columns, rows = sample_rows(records, methods)
    put("samples.csv", audit_csv(rows, columns))
    put("samples.jsonl", "".join(json.dumps(r, allow_nan=False) + "\n" for r in records))
    for m in methods:
        if m.long_table is not None:
            name, cols = m.long_table
            long_rows = [
                x for r in records if r["status"] == "ok" for x in m.long_rows(r["index"], r["readouts"][m.name])
            ]
            put(name, audit_csv(long_rows, cols))
    if importlib.util.find_spec("pyarrow") is not None:  # optional extra output
        try:
            staging.add(out / "samples.parquet", _parquet(columns, rows))
            written.append("samples.parquet")
        except Exception as e:  # noqa: BLE001 - an optional extra must not sink the run
            print(f"warning: samples.parquet not written ({type(e).__name__})", file=sys.stderr)
    summary = summarize(records, methods, n_requested, merged.cancelled)
    audit = audit_table(methods, merged.first_audits, run_params, options)
    summary_doc = {
        "schema_version": SCHEMA_VERSION,
        "parameters": run_params,
        **summary,
        "audit": [a.to_dict() for a in audit],
    }
    put("summary.json", json.dumps(jsonable(summary_doc), indent=1, allow_nan=False) + "\n")
    put("summary.md", summary_markdown(summary, run_params))
    put(
        "audit.json",
        json.dumps({"schema_version": SCHEMA_VERSION, "rows": [a.to_dict() for a in audit]}, indent=1) + "\n",
    )
    put("audit.csv", audit_csv(audit))
    put("audit.md", audit_markdown(audit))
    return written
