"""The one end every command that writes a ``--json`` document and records a
``--session`` run shares: the document is written and fsynced beside its
target, the run recorded, and only then is the document put in place
(:func:`core.files.atomic.staged_writes`), so a failed record (a full disk, a
session that is a link to nothing) changes no earlier output."""

from __future__ import annotations

import json
from pathlib import Path


def write_and_record(json_path, doc: dict | None, session, run, *, model, **record) -> None:
    """``doc`` to ``json_path`` (each skipped when None) and ``run`` into
    ``session`` (:func:`core.session.record_into` with ``model`` and ``record``:
    its image, mask, parameters), together or not at all."""
    from core.files.atomic import staged_writes  # function-local: the session imports sqlite, off --help's path

    with staged_writes() as outputs:
        if json_path is not None and doc is not None:
            outputs.add(Path(json_path), (json.dumps(doc, allow_nan=False) + "\n").encode("utf-8"))
        if session:
            from core.session import record_into

            record_into(session, run, model=model, **record)


def request_inputs(request) -> dict:
    """What the session stores of a request's input beside its parameters
    (:meth:`core.requests.base.Request.recorded_inputs`, the app's record too)."""
    return request.recorded_inputs()


def finish(args, request, result, *, model, doc: dict | None = None, parameters: dict | None = None, lines=None) -> int:
    """The end of a command that ran ``request`` (:mod:`core.requests`): ``doc`` (default: the
    request's :meth:`~core.requests.base.Request.document` of ``result``, what the app records
    for the same request) to ``--json`` where given, and into ``--session`` as the run's result
    with ``result``'s kind, summary and audit rows, the request's parameters (``parameters``:
    these instead) and its image and mask (:func:`request_inputs`), together or not at all
    (:func:`write_and_record`); then ``lines`` are printed (default: the result's one-line
    summary). Returns the exit status 0."""
    from core.results.readout import RecordedResult

    session, json_path = getattr(args, "session", None), getattr(args, "json", None)
    if session and parameters is None:  # only for the record (a validate request hashes its dataset files)
        parameters = request.parameters()
    if doc is None and (session or json_path):
        doc = request.document(result, model)
    write_and_record(
        json_path,
        doc,
        session,
        RecordedResult.of(result, doc),
        model=model,
        parameters=parameters,
        **request_inputs(request),
    )
    for line in [result.summary()] if lines is None else lines:
        print(line)
    return 0
