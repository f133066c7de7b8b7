"""``vlm-readout evaluate-zoo``: accuracy of a default model on held-out
synthetic scenes, per question kind (the numbers of each model card;
:func:`core.zoo.evaluate.evaluate`)."""

from __future__ import annotations

import json
from pathlib import Path

from core.cli.args import add_model_args
from core.cli.loading import load_from_args
from core.errors import ReadoutError
from core.shell.arguments import batch_size, input_count
from core.shell.terminal import progress_bar


def add_command(subparsers, load=load_from_args) -> None:
    e = subparsers.add_parser("evaluate-zoo", help="accuracy of a default model on held-out synthetic scenes")
    add_model_args(e)
    e.add_argument("--n", type=input_count, default=2000, help="scenes to answer")
    e.add_argument("--split", default="heldout")
    e.add_argument("--renderer", choices=["main", "alt"], default="main", help="alt: the independent second renderer")
    e.add_argument("--json", help="write the accuracy table here")
    e.add_argument("--batch-size", type=batch_size, default=50)
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.set_defaults(func=lambda args: run(args, load))


def run(args, load=load_from_args) -> int:
    # function-local: the zoo imports numpy and PIL, not needed for --help
    from core.files.atomic import check_output_file, write_text_atomic
    from core.zoo import scenes
    from core.zoo.evaluate import evaluate, markdown_table

    if args.renderer == "main" and args.split not in scenes.SPLIT_SEEDS:
        raise ReadoutError(f"unknown split {args.split!r}; expected one of {', '.join(scenes.SPLIT_SEEDS)}")
    if args.json:
        check_output_file(args.json)  # fail fast, before the model loads
    loaded = load(args)
    with progress_bar("evaluating", quiet=args.quiet, total=args.n) as progress:
        result = evaluate(loaded, args.n, args.split, args.batch_size, progress, renderer=args.renderer)
    print(markdown_table(result))
    if args.json:
        write_text_atomic(Path(args.json), json.dumps(result, indent=2) + "\n")
    return 0
