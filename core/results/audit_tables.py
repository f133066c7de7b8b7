"""The one pair of table writers: the session export's audit table
(:mod:`core.export`), the dataset audit's ``audit.csv`` / ``audit.md`` and
its per-sample tables (:mod:`core.dataset_audit.outputs`), with one cell
escaping (:func:`cell`, :func:`markdown_cell`).

Beside :mod:`core.results.audit` rather than in it: cells are cleaned by
:func:`core.results.readout.jsonable`, and :mod:`core.results.readout` names
:class:`core.results.audit.AuditRecord`, so :mod:`core.results.audit` cannot import it back.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence

from core.results.audit import AuditRecord
from core.results.readout import jsonable

# An AuditRecord's fields, in table order.
RECORD_COLUMNS = ["method", "question", "operation", "controls", "supports", "cannot_support", "parameters", "notes"]


def cell(v) -> str:
    """One table cell as text: None and non-finite floats empty, booleans
    ``true`` / ``false``, floats ``repr`` (they read back exactly), lists of
    text joined with ``"; "``, other lists and dicts as JSON with sorted keys."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ""
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return "; ".join(v)
    if isinstance(v, (dict, list)):
        return json.dumps(jsonable(v), sort_keys=True)
    return str(v)


def markdown_cell(v) -> str:
    """:func:`cell` for a Markdown table: backslashes and pipes escaped, line breaks as spaces."""
    return cell(v).replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _as_row(r) -> dict:
    return r.to_dict() if isinstance(r, AuditRecord) else r


def audit_csv(rows: Sequence[dict | AuditRecord], columns: Sequence[str] = RECORD_COLUMNS) -> str:
    """A table as CSV (the csv module's quoting): a header row, then one row per
    dict or :class:`AuditRecord`; a column a row lacks is empty."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in map(_as_row, rows):
        w.writerow([cell(r.get(c)) for c in columns])
    return buf.getvalue()


def audit_markdown(
    rows: Sequence[dict | AuditRecord], columns: Sequence[str] = RECORD_COLUMNS, *, title: str | None = None
) -> str:
    """A table as a GitHub-flavoured Markdown table (:func:`markdown_cell`), under ``# title`` when given."""
    lines = [f"# {title}", ""] if title else []
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(markdown_cell(r.get(c)) for c in columns) + " |" for r in map(_as_row, rows)]
    return "\n".join(lines) + "\n"
