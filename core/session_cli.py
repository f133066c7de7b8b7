"""``vlm-readout export``: write a session's audit table (CSV, Markdown,
self-contained HTML, JSON) or its patch-grid figures (PNG) to a file.

    vlm-readout export --session FILE --format csv|md|html|json|png --out PATH [--kind KIND ...]

``--format png`` writes one picture per figure into the folder ``PATH``.
Every file is written atomically. Errors (no such session, corrupt file, newer
schema, bad output path) are one line on stderr and exit status 2.
"""

from __future__ import annotations

from pathlib import Path


def add_command(subparsers, add_model_args, load) -> None:
    """The ``export`` subcommand (it needs no model: ``add_model_args`` and ``load`` are unused)."""
    from core.export import FORMATS

    p = subparsers.add_parser(
        "export",
        help="write a session's audit table (csv, md, html, json) or its figures (png)",
        description="Export the audit table of a session file: one row per audit record of each run (the "
        "chapter's 4.13 columns, the run's parameters and result summary). html embeds the patch-grid "
        "pictures; png writes them into the folder --out.",
    )
    p.add_argument("--session", required=True, help="session file (SQLite)")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", required=True, help="output file (a folder for --format png)")
    p.add_argument("--kind", action="append", help="only runs of this kind (repeatable)")
    p.set_defaults(func=run)


def run(args) -> int:
    from core.export import export_session
    from core.session import Session

    with Session.open(args.session) as s:
        n_rows = len(s.audit_table(args.kind))
        written = export_session(s, args.format, Path(args.out), kinds=args.kind)
    if args.format == "png":
        print(f"wrote {len(written)} figures to {args.out}")
    else:
        print(f"wrote {args.out} ({n_rows} audit rows)")
    return 0
