"""``vlm-readout export``: write a session's audit table (CSV, Markdown,
self-contained HTML, JSON) or its patch-grid figures (PNG) to a file.

    vlm-readout export --session FILE --format csv|md|html|json|png --out PATH [--kind KIND ...]

Every row starts with what reproduces its run (:data:`core.session.RUN_COLUMNS`).
``--format png`` writes one picture per figure into the folder ``PATH``.
Every file is written atomically; the session is opened read-only (nothing
is written to it or beside it, so a session in a read-only folder or on a full
disk exports). Errors (no such session, empty, damaged or corrupt file, newer
schema, bad output path, every run damaged) are one line on stderr and exit
status 2; a damaged run (``warning: run N: ...``, left out) or a picture that
cannot be drawn as recorded (an unreadable stored image) is a ``warning:``
line and the rest is exported.
"""

from __future__ import annotations

import sys
from pathlib import Path

from core.shell.arguments import LazyChoices


def add_command(subparsers, load=None) -> None:
    """The ``export`` subcommand (it needs no model: ``load`` is unused)."""
    p = subparsers.add_parser(
        "export",
        help="write a session's audit table (csv, md, html, json) or its figures (png)",
        description="Export the audit table of a session file: one row per audit record of each run, each "
        "enough to reproduce it (the image's path and SHA-256, the model spec and fingerprint, the question, "
        "the target, the method's specification, the numeric summary), then the chapter's 4.13 columns and "
        "the run's parameters. html embeds the patch-grid pictures; png writes them into the folder --out.",
    )
    p.add_argument("--session", required=True, help="session file (SQLite)")
    # read from core.export (and core.session) only when checked: the other commands' parsers never import them
    formats = LazyChoices("core.export", "FORMATS")
    p.add_argument("--format", required=True, choices=formats, metavar="FORMAT", help="%(choices)s")
    p.add_argument("--out", required=True, help="output file (a folder for --format png)")
    p.add_argument("--kind", action="append", help="only runs of this kind (repeatable)")
    p.set_defaults(func=run)


def run(args) -> int:
    from core.export import export_session
    from core.session import Session

    notes: list[str] = []
    damaged: dict[int, str] = {}
    with Session.open(args.session, read_only=True) as s:  # an export never writes to the session
        written = export_session(s, args.format, Path(args.out), kinds=args.kind, notes=notes, damaged=damaged)
        n_rows = sum(row["run_id"] not in damaged for row in s.audit_table(args.kind))
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    if args.format == "png":
        print(f"wrote {len(written)} figures to {args.out}")
    else:
        print(f"wrote {args.out} ({n_rows} audit rows)")
    return 0
