"""``vlm-readout patch-grid``: copy one activation from the run of a source image
into the run of the asked image at every layer x position group, and write the
normalised patching metric of each cell
(:class:`core.requests.patch_grid.PatchGridRequest`).

    vlm-readout patch-grid --model M --image I --question Q (--source-image IMG | --source-fill FILL --mask M) \\
        [--site resid|attn|mlp|head --head H] [--columns image,region,question,answer | each] \\
        [--mask MASK.png] [--answer A --foil F] [--answer-text T --token-index K] [--json OUT] [--session FILE]

metric = (LD_patched - LD_clean) / (LD_source - LD_clean), LD the answer's logit
minus the foil's: 0 is the clean run, 1 the source run. Every expected failure
is one line on stderr and exit status 2.
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
from core.requests.patch_grid import PATCH_GRID_SITES, POSITION_GROUPS, SOURCE_FILLS
from core.shell.arguments import batch_size, non_negative_int
from core.shell.terminal import progress_bar


def add_command(subparsers, load=load_from_args) -> None:
    p = subparsers.add_parser(
        "patch-grid",
        help="patch an activation from another image at every layer x position group (normalised metric)",
        description="Copy the residual stream, the attention output, the MLP output or one head's output from the "
        "run of a source image (the same question, the same size) into the clean run at every layer x position "
        "group, everything downstream recomputed; write each cell's normalised metric (0 = clean, 1 = source).",
    )
    add_model_args(p)
    add_input_args(p, question_help="the question about both images")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--source-image", metavar="IMG", help="the image whose activations are patched in")
    source.add_argument(
        "--source-fill",
        choices=SOURCE_FILLS,
        help="the source is the image with the --mask region filled so (%(choices)s)",
    )
    p.add_argument("--site", choices=PATCH_GRID_SITES, default="resid", help="%(choices)s (default %(default)s)")
    p.add_argument("--head", type=non_negative_int, help="--site head: the head's index")
    p.add_argument(
        "--columns",
        default=",".join(POSITION_GROUPS),
        help="position groups (image, region, question, answer, text, last, word:W), or each: every position "
        "(default: image, region where a --mask is given, question, answer)",
    )
    p.add_argument("--mask", help="the region group: PNG, white = region, the image's size")
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
    from core.methods.counterfactual import mask_from_png
    from core.requests.patch_grid import PatchGridRequest

    check_outputs(args)
    check_token_options(args)
    image = load_image(args.image)
    columns = tuple(args.columns.split(","))
    request = PatchGridRequest(
        **asked_of(args, image),
        source_image=load_image(args.source_image) if args.source_image else None,
        source_image_path=args.source_image,
        source_fill=args.source_fill,
        site=args.site,
        head=args.head,
        columns=POSITION_GROUPS if args.columns == ",".join(POSITION_GROUPS) else columns,
        mask=mask_from_png(args.mask, image.size) if args.mask else None,
        batch_size=args.batch_size,
    )

    def check(loaded) -> None:  # a head the model lacks fails before anything runs
        n = loaded.adapter.n_heads
        if request.head is not None and request.head >= n:
            raise InterventionError(f"--head {request.head}: the model has heads 0-{n - 1}")

    loaded, request = loaded_for(args, load, request, check=check)
    with progress_bar("patch grid", quiet=args.quiet, messages=True) as progress:
        result = request.run(loaded, progress)
    return finish(args, request, result, model=loaded)
