"""``vlm-readout patch``: copy visual-token features from another image into the
run and back (:class:`core.requests.patching.PatchingRequest`, the app's Patch).

    vlm-readout patch --model M --image I --question Q --source-image IMG \\
        [--site vision_out|projector_out|resid|kv_source] [--layer L] [--mask MASK.png] \\
        [--answer A --foil F] [--answer-text T --token-index K] [--json OUT] [--session FILE]

Without ``--mask`` every visual token is patched; with it, the visual tokens the
mask touches. The JSON is the result the app records for the same request. Every
expected failure is one line on stderr and exit status 2.
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
from core.shell.arguments import LazyChoices, non_negative_int
from core.shell.terminal import progress_bar

# the sites whose --layer names a block (core.requests.patching.PatchingRequest.layer)
LAYERED_SITES = ("resid", "kv_source")


def add_command(subparsers, load=load_from_args) -> None:
    p = subparsers.add_parser(
        "patch",
        help="patch visual-token features from another image, forward and reverse",
        description="Copy the features of the visual tokens at one site from a source image asked the same "
        "question into the run (forward) and the run's into the source's (reverse); write the answer's numbers "
        "of each with the audit row. A flip says the patched features suffice to carry the difference.",
    )
    add_model_args(p)
    add_input_args(p, question_help="the question about both images")
    p.add_argument("--source-image", required=True, metavar="IMG", help="the image whose features are patched in")
    p.add_argument(
        "--site",
        choices=LazyChoices("core.requests.patching", "PATCH_SITES"),
        metavar="SITE",
        help="%(choices)s (default: the earliest the family's language side reads: projector_out, else "
        "kv_source, else resid)",
    )
    p.add_argument(
        "--layer",
        type=non_negative_int,
        help="--site resid: the block whose entering residual is patched (default 0); --site kv_source: one "
        "cross block (default: every one)",
    )
    p.add_argument("--mask", help="PNG, white = region, the image's size: patch the visual tokens it touches "
                   "(default: every visual token)")  # fmt: skip
    add_token_args(
        p,
        answer_help="answer token (default: the model's top token on the image)",
        foil_help="competing token (default: the source image's top token, when it differs)",
    )
    add_answer_text_args(p)
    add_output_args(p, json_help="output file (the result the session records)", json_required=False)
    p.set_defaults(func=lambda args: run(args, load))


def run(args, load=load_from_args) -> int:
    # function-local: the method and the images import torch / numpy, not needed for --help

    from core.files.images import load_image
    from core.methods.counterfactual import mask_from_png
    from core.requests.patching import PatchingRequest

    # Fail fast on the inputs and the output, before the model loads.
    check_outputs(args)
    check_token_options(args)
    if args.layer is not None and args.site not in LAYERED_SITES:
        raise InterventionError("--layer goes with --site resid or --site kv_source")
    image = load_image(args.image)
    request = PatchingRequest(
        **asked_of(args, image),
        source_image=load_image(args.source_image),
        source_image_path=args.source_image,
        mask=mask_from_png(args.mask, image.size) if args.mask else None,
        site=args.site,
        layer=args.layer,
    )
    # a site the family lacks fails before anything runs
    loaded, request = loaded_for(args, load, request, check=lambda loaded: request.resolved_site(loaded.adapter))
    with progress_bar("patching", quiet=args.quiet, messages=True) as progress:
        result = request.run(loaded, progress)
    return finish(args, request, result, model=loaded)
