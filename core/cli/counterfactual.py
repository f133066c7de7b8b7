"""``vlm-readout counterfactual``: fill a painted region (or sweep every patch)
and write the answer effect with the routing read-outs beside it.

    vlm-readout counterfactual --model SPEC --image PATH --question TEXT \\
        --mask MASK.png --fill mean|constant|blur|noise|inpaint|paste [--paste-from IMG] \\
        [--answer A --foil F] --json OUT
    vlm-readout counterfactual ... --sweep K [--interpolated] --json OUT

The mask is white where the region is and has the image's size. Every
expected failure is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse

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
from core.errors import ReadoutError
from core.requests.counterfactual import CounterfactualRequest, SweepRequest
from core.results.readout import change_line
from core.shell.arguments import LazyChoices, Number, batch_size, positive_int, seed_int
from core.shell.terminal import progress_bar

# a Gaussian sigma in pixels; past this the blur is flat over any image and its kernel only costs memory
blur_radius = Number(float, 0, 1000, lo_open=True)


def _color(text: str) -> tuple[int, int, int]:
    try:
        parts = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected R,G,B integers 0-255, got {text!r}") from None
    if len(parts) != 3 or any(not 0 <= v <= 255 for v in parts):
        raise argparse.ArgumentTypeError(f"expected R,G,B integers 0-255, got {text!r}")
    return parts


def add_command(subparsers, load=load_from_args) -> None:
    p = subparsers.add_parser(
        "counterfactual",
        help="fill an image region (or sweep every patch) and measure the answer effect",
        description="Fill a region of the image, re-run the model through its own processor, and write the "
        "original and edited answer numbers with the region's routing read-outs (attention mass, rollout, "
        "frozen-scale DLA) and the audit rows. --sweep K writes a patch-grid occlusion map instead.",
    )
    add_model_args(p)
    add_input_args(p)
    p.add_argument("--mask", help="PNG, white = region, same size as the image")
    p.add_argument("--sweep", type=positive_int, metavar="K", help="fill every K x K block of patches in turn instead")
    p.add_argument(
        "--fill",
        choices=LazyChoices("core.methods.counterfactual", "FILLS"),
        default="mean",
        metavar="FILL",
        help="%(choices)s (default %(default)s)",
    )
    p.add_argument("--paste-from", help="--fill paste: the image whose same region is pasted (resized to match)")
    p.add_argument("--color", type=_color, default=None, help="--fill constant: R,G,B (default 128,128,128)")
    p.add_argument("--radius", type=blur_radius, default=None, help="--fill blur: Gaussian sigma in pixels (default 4)")
    p.add_argument("--seed", type=seed_int, default=None, help="--fill noise: generator seed (default 0)")
    add_token_args(p, answer_help="answer token (default: the model's top token on the original image)")
    add_answer_text_args(p)
    p.add_argument("--batch-size", type=batch_size, default=16, help="--sweep: edited images per forward")
    p.add_argument(
        "--interpolated",
        action="store_true",
        help="--sweep: also write a bilinear upsampled map (flagged: visual smoothing, not a causal pixel mask)",
    )
    p.add_argument("--no-routing", action="store_true", help="skip the routing read-outs (no capture)")
    add_output_args(p)
    p.set_defaults(func=lambda args: run(args, load))


def run(args, load=load_from_args) -> int:
    # function-local: the counterfactual methods import torch, not needed for --help

    from core.files.images import load_image
    from core.methods.counterfactual import mask_from_png

    if (args.mask is None) == (args.sweep is None):
        raise ReadoutError("give --mask MASK.png or --sweep K (one of them)")
    if args.interpolated and args.sweep is None:
        raise ReadoutError("--interpolated goes with --sweep K")
    if args.paste_from and args.fill != "paste":
        raise ReadoutError("--paste-from goes with --fill paste")
    # Fail fast on the inputs and the output, before the model loads.
    check_outputs(args)
    check_token_options(args)
    image = load_image(args.image)
    mask = mask_from_png(args.mask, image.size) if args.mask else None
    if args.fill == "paste" and not args.paste_from:
        raise ReadoutError("--fill paste needs --paste-from IMG")
    asked = dict(
        **asked_of(args, image),
        fill=args.fill,
        color=args.color,
        radius=args.radius,
        seed=args.seed,
        paste_from=load_image(args.paste_from) if args.paste_from else None,
        paste_from_path=args.paste_from,
    )
    if args.sweep is not None:
        request = SweepRequest(**asked, k=args.sweep, batch_size=args.batch_size, interpolated=args.interpolated)
    else:
        request = CounterfactualRequest(**asked, mask=mask, mask_name=args.mask, routing=not args.no_routing)
    request.fill_spec()  # its checks, before the model loads
    loaded, request = loaded_for(args, load, request)
    if args.sweep is not None:
        with progress_bar("occlusion sweep", quiet=args.quiet) as progress:
            result = request.run(loaded, progress)
        eff = result.effect
        worst = divmod(int(eff.argmin()), eff.shape[1])
        line = (
            f"{eff.shape[0]}x{eff.shape[1]} cells of {args.sweep}x{args.sweep} patches; "
            f"largest drop {-float(eff.min()):.3f} at cell {list(worst)}; "
            f"{int(result.flipped.sum())} cells flip the answer"
        )
    else:
        result = request.run(loaded)
        line = change_line(result.original.to_dict(), result.edited.to_dict(), result.effect.flipped)
    return finish(args, request, result, model=loaded, lines=[line])  # the JSON has the header (request.document)
