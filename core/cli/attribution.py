"""``vlm-readout attribution-patching``: the first-order estimate of every head x
position, MLP x position and residual x position patch from a source image, one
forward and one backward, with its top components patched for real beside it
(:class:`core.requests.attribution.AttributionPatchingRequest`).

    vlm-readout attribution-patching --model M --image I --question Q --source-image IMG \\
        [--top-k 20] [--answer A --foil F] [--answer-text T --token-index K] [--json OUT] [--session FILE]

The estimates are normalised as the patching grid's metric (0 = clean, 1 =
source); the summary line is the agreement with actual patching (rank
correlation, sign agreement). Every expected failure is one line on stderr
and exit status 2.
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
from core.shell.arguments import batch_size, positive_int
from core.shell.terminal import progress_bar


def add_command(subparsers, load=load_from_args) -> None:
    p = subparsers.add_parser(
        "attribution-patching",
        help="the linear estimate of every activation patch from another image, beside actual patches of its top-k",
        description="Estimate the effect of patching every head's output, MLP output and residual at every position "
        "from a source image (the same question, the same size) as (a_source - a_clean) . dLD/da at the clean run, "
        "in one forward and one backward; patch the top-k estimates for real and report the agreement.",
    )
    add_model_args(p)
    add_input_args(p, question_help="the question about both images")
    p.add_argument("--source-image", required=True, metavar="IMG", help="the image whose activations are patched in")
    p.add_argument("--top-k", type=positive_int, default=20, help="estimates checked by actual patching (default 20)")
    p.add_argument("--batch-size", type=batch_size, default=8, help="patched copies per forward (default 8)")
    add_token_args(
        p,
        answer_help="answer token (default: the model's top token on the image)",
        foil_help="competing token (default: the source image's top token)",
    )
    add_answer_text_args(p)
    add_output_args(p)
    p.set_defaults(func=lambda args: run(args, load))


def run(args, load=load_from_args) -> int:
    # function-local: the method and the images import torch / numpy, not needed for --help
    from core.files.images import load_image
    from core.requests.attribution import AttributionPatchingRequest

    check_outputs(args)
    check_token_options(args)
    image = load_image(args.image)
    request = AttributionPatchingRequest(
        **asked_of(args, image),
        source_image=load_image(args.source_image),
        source_image_path=args.source_image,
        top_k=args.top_k,
        batch_size=args.batch_size,
    )
    loaded, request = loaded_for(args, load, request)
    with progress_bar("attribution patching", quiet=args.quiet, messages=True) as progress:
        result = request.run(loaded, progress)
    return finish(args, request, result, model=loaded)
