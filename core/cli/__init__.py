"""``vlm-readout`` command line (the console entry point is ``core.cli:main``).

One module per command, each with ``add_command(subparsers, load)`` (its
parser) and ``run(args, load) -> int``:

    answer.py          answer            analyze.py      analyze
    generate.py        generate
    evaluate_zoo.py    evaluate-zoo      audit.py        audit
    counterfactual.py  counterfactual    export.py       export
    ablate.py          ablate            patch.py        patch
    lens.py            train-lens, eval-lens
    nonunique.py       nonunique         qk_ov.py        qk-ov
    validate.py        validate

and the pieces they share: :mod:`core.cli.args` (the model options),
:mod:`core.cli.loading` (the model they name); the progress bar is
:func:`core.shell.terminal.progress_bar`, the number validators and :class:`Parser`
are in :mod:`core.shell.arguments`.

Every expected failure (bad image, bad model folder, refused checkpoint,
question that does not fit, an option out of range, a bad line in a pairs
file, an output that cannot be written, a stdout that cannot be written)
prints one line ``error: ...`` to stderr and exits with status 2; nothing
prints a traceback for them, and stderr holds nothing but such lines and
``warning: ...`` lines (core/shell/terminal.py). :func:`main` makes the process
offline before anything is parsed or imported, unless ``--allow-download``
(core/shell/offline.py). Numeric options are checked when the command line is
parsed, so ``--top-k 0`` is refused before anything loads. Building the parser imports neither torch nor
transformers nor numpy (tests/core/test_cli_layout.py): a command imports them
in its ``run``.
"""

from __future__ import annotations

import argparse
import sys

from core.cli import (
    ablate,
    analyze,
    answer,
    attribution,
    audit,
    counterfactual,
    evaluate_zoo,
    export,
    generate,
    knockout,
    lens,
    nonunique,
    patch,
    patch_grid,
    qk_ov,
    validate,
)
from core.cli.args import add_model_args, add_raw_prompt_arg  # noqa: F401
from core.cli.loading import load_from_args
from core.errors import ReadoutError
from core.files.pairs import check_pair_image, load_pair_image, read_jsonl, read_pairs, text_field  # noqa: F401
from core.shell import offline, terminal
from core.shell.arguments import (  # noqa: F401  (re-exported: callers import them from core.cli)
    INT_MAX,
    LazyChoices,
    Number,
    Parser,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    positive_share,
    probability,
    seed_int,
    share_below_one,
)

# The old names of the model options and the loader, kept for the callers that use them.
# Tests replace core.cli._load (monkeypatch): build_parser hands the current one to every command.
_add_model_args = add_model_args
_load = load_from_args

# In the order of `vlm-readout --help`.
COMMANDS = (
    answer,
    generate,
    analyze,
    evaluate_zoo,
    audit,
    counterfactual,
    ablate,
    patch,
    patch_grid,
    attribution,
    knockout,
    export,
    lens,
    nonunique,
    qk_ov,
    validate,
)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="vlm-readout", description="Read out what a vision-language model computed.")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_command(sub, _load)
    return p


def main(argv: list[str] | None = None) -> int:
    # Before anything is parsed or imported: no network unless --allow-download, and
    # a terminal that holds only `error:` / `warning:` lines (core/shell/offline.py, core/shell/terminal.py).
    offline.go_offline()
    terminal.setup()
    with terminal.watched_stdout() as stdout:
        try:
            with terminal.question_length_warnings_held():
                return _run(argv)
        except ReadoutError as e:
            terminal.say(f"error: {e}")
            return e.exit_code
        except KeyboardInterrupt:
            terminal.say("error: interrupted")
            return 130
        except OSError:
            if stdout.failure is None:  # not stdout's: a bug, shown as one
                raise
            return terminal.refuse_stdout(stdout.failure)


def _run(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # -h, or a refused command line (its one line is printed)
        return terminal.parse_exit_status(e)
    if getattr(args, "allow_download", False):
        offline.allow_network()
    code = args.func(args)
    sys.stdout.flush()
    return code
