"""``vlm-readout knockout``: cut every attention edge of each edge kind in a window of
layers centred on each layer in turn, and in all layers at once
(:class:`core.requests.knockout.KnockoutRequest`).

    vlm-readout knockout --model M --image I --question Q --edges SOURCE->TARGET[,...] \\
        [--window K] [--heads 0,2] [--mask MASK.png] [--no-rollout] [--answer A --foil F] \\
        [--answer-text T --token-index K] [--json OUT] [--session FILE]

Sources: image, region (the --mask's visual tokens), question, text (every
position that is not a visual token), word:W, last, answer; targets: answer,
question, text, last, word:W. The JSON lists, for each edge
kind and window, the blocks whose edges were cut and the answer's numbers after
the cut. Every expected failure is one line on stderr and exit status 2.
"""

from __future__ import annotations

from core.cli.args import (
    add_answer_text_args,
    add_input_args,
    add_model_args,
    add_output_args,
    add_token_args,
    asked_of,
    check_outputs,
    check_token_options,
    loaded_for,
)
from core.cli.loading import load_from_args
from core.cli.outputs import finish
from core.errors import InterventionError
from core.shell.arguments import batch_size, positive_int
from core.shell.terminal import progress_bar


def add_command(subparsers, load=load_from_args) -> None:
    p = subparsers.add_parser(
        "knockout",
        help="cut attention edges (source -> target positions) in windows of layers and measure the answer",
        description="Cut every attention edge from a source set of positions to a target set, before the "
        "softmax on the model's own attention path (the remaining weights renormalise), in a window of K layers "
        "centred on each layer in turn and in all layers; write the answer's numbers per window with the audit row.",
    )
    add_model_args(p)
    add_input_args(p)
    p.add_argument(
        "--edges",
        required=True,
        metavar="SOURCE->TARGET[,...]",
        help="edge kinds: sources image, region, question, text, word:W, last, answer; targets answer, question, "
        "text (every non-visual position), last, word:W (image->answer,question->last)",
    )
    p.add_argument("--window", type=positive_int, default=1, metavar="K", help="layers per window (default 1)")
    p.add_argument("--heads", metavar="H[,H...]", help="cut these heads of every block only (default: all heads)")
    p.add_argument("--mask", help="the region set: PNG, white = region, the image's size")
    p.add_argument("--batch-size", type=batch_size, default=8, help="edited copies per forward (default 8)")
    p.add_argument("--no-rollout", action="store_true", help="skip rollout's per-layer reach beside each profile")
    add_token_args(p)
    add_answer_text_args(p)
    add_output_args(p)
    p.set_defaults(func=lambda args: run(args, load))


def _heads(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        heads = tuple(int(h) for h in text.split(",") if h.strip())
    except ValueError:
        raise InterventionError(f"--heads {text!r}: comma-separated head indices (0,2)") from None
    if not heads or min(heads) < 0:
        raise InterventionError(f"--heads {text!r}: comma-separated head indices (0,2)")
    return heads


def run(args, load=load_from_args) -> int:
    # function-local: the method and the images import torch / numpy, not needed for --help
    from core.files.images import load_image
    from core.methods.counterfactual import mask_from_png
    from core.requests.knockout import KnockoutRequest

    # Fail fast on the inputs and the output, before the model loads.
    check_outputs(args)
    check_token_options(args)
    image = load_image(args.image)
    request = KnockoutRequest(
        **asked_of(args, image),
        edges=tuple(args.edges.split(",")),
        window=args.window,
        heads=_heads(args.heads),
        mask=mask_from_png(args.mask, image.size) if args.mask else None,
        batch_size=args.batch_size,
        rollout=not args.no_rollout,
    )

    def check(loaded) -> None:  # heads the model lacks fail before anything runs
        n = loaded.adapter.n_heads
        if request.heads is not None and max(request.heads) >= n:
            raise InterventionError(f"--heads {args.heads}: the model has heads 0-{n - 1}")

    loaded, request = loaded_for(args, load, request, check=check)
    with progress_bar("knockout", quiet=args.quiet, messages=True) as progress:
        result = request.run(loaded, progress)
    return finish(args, request, result, model=loaded)
