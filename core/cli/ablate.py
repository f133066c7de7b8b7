"""``vlm-readout ablate``: remove or replace one component's write and re-run
(:class:`core.requests.ablation.AblationRequest`, the app's Ablate).

    vlm-readout ablate --model M --image I --question Q --component L1.H2|L1.mlp|L1 \\
        [--ablation zero|mean|resample] [--positions target|all|region] [--mask MASK.png] \\
        [--reference IMG ...] [--source-image IMG] [--answer A --foil F] \\
        [--answer-text T --token-index K] [--json OUT] [--session FILE]

``mean`` replaces the write by its mean over the ``--reference`` images asked the
same question; ``resample`` by its value on ``--source-image``. The JSON is the
result the app records for the same request. Every expected failure is one line
on stderr and exit status 2.
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
from core.shell.terminal import progress_bar

# core.methods.component_ablation's KINDS and POSITIONS (not imported: it loads torch; tests/core/test_requests_parity.py)
ABLATIONS = ("zero", "mean", "resample")
POSITIONS = ("target", "all", "region")


def add_command(subparsers, load=load_from_args) -> None:
    p = subparsers.add_parser(
        "ablate",
        help="ablate one component (head, MLP, block) and measure the answer effect",
        description="Remove (zero) or replace (mean over reference images, resample from another image) the write "
        "of one component, named as the read-outs name it, at the answer position, every position or a painted "
        "region's visual tokens; re-run and write the answer's numbers before and after with the audit row.",
    )
    add_model_args(p)
    add_input_args(p)
    p.add_argument(
        "--component",
        required=True,
        metavar="NAME",
        help="a head (L1.H2), a block's MLP (L1.mlp), its heads (L1.attn) or all its writes (L1), "
        "with the trace's block names",
    )
    p.add_argument(
        "--ablation",
        choices=ABLATIONS,
        default="zero",
        help="%(choices)s (default %(default)s)",
    )
    p.add_argument(
        "--positions",
        choices=POSITIONS,
        default="target",
        help="%(choices)s: the answer position, every position, or the visual tokens --mask touches "
        "(default %(default)s)",
    )
    p.add_argument("--mask", help="--positions region: PNG, white = region, the image's size")
    p.add_argument(
        "--reference",
        action="append",
        metavar="IMG",
        help="--ablation mean: a reference image asked the same question (repeatable)",
    )
    p.add_argument("--source-image", metavar="IMG", help="--ablation resample: the other image")
    add_token_args(p)
    add_answer_text_args(p)
    add_output_args(p, json_help="output file (the result the session records)", json_required=False)
    p.set_defaults(func=lambda args: run(args, load))


def run(args, load=load_from_args) -> int:
    # function-local: the method and the images import torch / numpy, not needed for --help

    from core.files.images import check_image_file, load_image
    from core.methods.component_ablation import mixer_modules, parse_component
    from core.methods.counterfactual import mask_from_png
    from core.requests.ablation import AblationRequest

    # Fail fast on the inputs and the output, before the model loads.
    check_outputs(args)
    check_token_options(args)
    if (args.mask is not None) != (args.positions == "region"):
        raise InterventionError("--mask goes with --positions region (the region's visual tokens), and it needs one")
    if (args.reference is not None) != (args.ablation == "mean"):
        raise InterventionError("--reference goes with --ablation mean, and it needs at least one")
    if (args.source_image is not None) != (args.ablation == "resample"):
        raise InterventionError("--source-image goes with --ablation resample, and it needs one")
    image = load_image(args.image)
    for reference in args.reference or ():
        check_image_file(reference)  # each decoded when its run comes
    request = AblationRequest(
        **asked_of(args, image),
        component=args.component,
        ablation=args.ablation,
        positions=args.positions,
        mask=mask_from_png(args.mask, image.size) if args.mask else None,
        references=tuple(args.reference or ()),
        source_image=load_image(args.source_image) if args.source_image else None,
        source_image_path=args.source_image,
    )
    loaded, request = loaded_for(  # a component the model lacks fails before anything runs
        args,
        load,
        request,
        check=lambda loaded: parse_component(
            args.component, [n for n, _ in loaded.adapter.blocks], mixer_modules(loaded.adapter)
        ),
    )
    with progress_bar("ablation", quiet=args.quiet, messages=True) as progress:
        result = request.run(loaded, progress)
    return finish(args, request, result, model=loaded)
