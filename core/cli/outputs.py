"""The one end every command that writes a ``--json`` document and records a
``--session`` run shares: the document is written and fsynced beside its
target, the run recorded, and only then is the document put in place
(:func:`core.atomic.staged_writes`), so a failed record (a full disk, a
session that is a link to nothing) changes no earlier output."""

from __future__ import annotations

import json
from pathlib import Path


def write_and_record(json_path, doc: dict | None, session, run, *, model, **record) -> None:
    """``doc`` to ``json_path`` (each skipped when None) and ``run`` into
    ``session`` (:func:`core.session.record_into` with ``model`` and ``record``:
    its image, mask, parameters), together or not at all."""
    from core.atomic import staged_writes  # function-local: the session imports sqlite, off --help's path

    with staged_writes() as outputs:
        if json_path is not None and doc is not None:
            outputs.add(Path(json_path), (json.dumps(doc, allow_nan=False) + "\n").encode("utf-8"))
        if session:
            from core.session import record_into

            record_into(session, run, model=model, **record)
