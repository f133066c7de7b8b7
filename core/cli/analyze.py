"""``vlm-readout analyze``: one capture, every text-side read-out, written as
the analyze JSON (docs/ARCHITECTURE.md, "One vlm-readout analyze")."""

from __future__ import annotations

from core.cli.args import (
    add_answer_text_args,
    add_input_args,
    add_model_args,
    add_output_args,
    add_raw_prompt_arg,
    add_token_args,
    asked_of,
    check_outputs,
    check_token_options,
    loaded_for,
)
from core.cli.loading import load_from_args
from core.cli.outputs import finish
from core.requests.analyze import AnalyzeRequest
from core.shell.terminal import progress_bar


def add_command(subparsers, load=load_from_args) -> None:
    an = subparsers.add_parser("analyze", help="capture once and write every text-side read-out as JSON")
    add_model_args(an)
    add_input_args(an)
    add_token_args(an, foil_help="competing token; u = W_U[answer] - W_U[foil]")
    add_output_args(an, session_help="also record the run into this session file (created if missing)")
    add_raw_prompt_arg(an)
    add_answer_text_args(an)
    an.add_argument("--lens", help="tuned-lens folder: its reader and baselines beside the logit lens")
    an.add_argument(
        "--attention",
        choices=["sdpa", "eager"],
        default="sdpa",
        help="sdpa (default): the model's own attention, the pattern rows the read-outs use recomputed "
        "from each call's queries, keys and mask; eager: run eager attention and read its weights",
    )
    an.set_defaults(func=lambda args: run(args, load))


def run(args, load=load_from_args) -> int:
    # function-local: the lens store and the session import torch / numpy, not needed for --help

    from core.files.images import load_image

    check_outputs(args)  # fail fast, before the model loads
    check_token_options(args)
    image = load_image(args.image)
    tuned = None
    if args.lens:
        from core.methods.tuned_lens.store import load_lens

        tuned = load_lens(args.lens)
    request = AnalyzeRequest(
        **asked_of(args, image),
        lens=args.lens,
        tuned=tuned,
        attention=args.attention,
        raw_prompt=args.raw_prompt,
    )
    loaded, request = loaded_for(args, load, request)
    with progress_bar("analyze", quiet=args.quiet, total=4, messages=True) as progress:
        result = request.run(loaded, progress)
    return finish(args, request, result, model=loaded)
