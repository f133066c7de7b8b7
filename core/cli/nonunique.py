"""``vlm-readout nonunique``: is one head's attention pattern the only one that
gives its output? (docs/METHODS.md §4.10, :mod:`core.methods.nonunique`)

    vlm-readout nonunique --model M --image I --question Q --head L1.H1 \\
        [--region MASK.png] [--answer-text T --token-index K] --json OUT

At the answer position, for the head named, the three constraint levels side by
side: (a) any pattern on the simplex and the model's mask, (b) the real scores
moved by at most B logits, (c) a query the model could form (keys as computed;
c-residual: from a residual through the real norm, W_Q, b_Q and rotation). Each
level reports the mass it moves off the region within the output tolerance and,
where one is proven, the least mass any pattern within tolerance keeps on it;
the JSON also holds the method's caveat (``does_not_say``).
"""

from __future__ import annotations

from core.cli.args import (
    add_answer_text_args,
    add_input_args,
    add_model_args,
    add_output_args,
    add_raw_prompt_arg,
    answer_text_of,
    check_outputs,
    check_token_options,
)
from core.cli.loading import load_from_args
from core.cli.outputs import finish
from core.requests.nonunique import DEFAULT_SCORE_BOUNDS, LEVELS, NonuniqueRequest
from core.shell.arguments import Number, positive_share, probability, seed_int
from core.shell.terminal import progress_bar

DEFAULT_SHARE = 0.5
# core.methods.nonunique.TOP_TOKENS_RULE, for --help (not imported: it loads torch)
TOP_TOKENS_RULE = (
    "the fewest visual tokens, most attended first, that hold at least {share:g} of the head's attention "
    "on the image at the answer position (tokens without a patch of their own, e.g. newline or CLS, excluded)"
)
output_tolerance = Number(float, 0, 1, lo_open=True)
score_bound = Number(float, 0, 1000)
# optimiser steps of one penalty stage: past this a local search has long stalled, and each step is a forward
optimiser_steps = Number(int, 1, 100_000)


def add_command(subparsers, load=load_from_args) -> None:
    p = subparsers.add_parser(
        "nonunique",
        help="could one head give the same output with its attention off a region? (three constraint levels)",
        description="For one attention head at the answer position: search other patterns that reproduce the "
        "head's output within a relative tolerance while moving the most attention mass off a region, at three "
        "levels: (a) any pattern on the simplex and the model's mask (convex: the least mass kept is proven), "
        "(b) softmax of the real scores moved by at most B logits (local search), (c) a query the model could "
        "form against the keys as computed (c-query: a free query with a reachability check; c-residual: from "
        "a residual through the real norm, W_Q, b_Q and rotation; local searches). A is still the pattern the "
        "model computed: an alternative says the output does not pin the routing, not that it is unused.",
    )
    add_model_args(p)
    add_input_args(p)
    p.add_argument(
        "--head",
        required=True,
        metavar="BLOCK.HN",
        help="the head, as BLOCK.H<index> with the trace's block names (L1.H3; CoCa's cross blocks L1.xattn.H0)",
    )
    p.add_argument(
        "--region",
        metavar="MASK",
        help="PNG mask, white = region, the image's size: the visual tokens it covers are the set mass is moved "
        "off (default: " + TOP_TOKENS_RULE.format(share=DEFAULT_SHARE) + "; --share sets the share)",
    )
    p.add_argument(
        "--cover",
        type=positive_share,
        default=0.25,
        help="--region: the share of a visual token's patch the mask must cover for the token to count "
        "(default %(default)s)",
    )
    p.add_argument(
        "--share",
        type=positive_share,
        default=DEFAULT_SHARE,
        help="without --region: the share of the head's image attention the default set holds (default %(default)s)",
    )
    p.add_argument(
        "--tol",
        type=output_tolerance,
        default=0.05,
        help="relative output error an alternative may have, ||o' - o|| / ||o|| (default %(default)s)",
    )
    p.add_argument(
        "--score-bound",
        type=score_bound,
        action="append",
        metavar="B",
        help="level b's bound on the score change in logits (repeatable: one row per bound; default 1 and 2)",
    )
    p.add_argument(
        "--levels",
        nargs="+",
        choices=LEVELS,
        default=list(LEVELS),
        metavar="LEVEL",
        help="which levels to run, of %(choices)s (default: all)",
    )
    p.add_argument(
        "--objective",
        choices=("mass", "tv"),
        default="mass",
        help="mass: least mass on the region; tv: the largest total variation from the real pattern, over the "
        "top-k sets of A and the region (default %(default)s)",
    )
    p.add_argument(
        "--min-moved",
        type=probability,
        default=0.05,
        help="the mass an alternative must move off the region to count as one (half the region's mass when it "
        "holds less than twice this; default %(default)s)",
    )
    p.add_argument(
        "--space",
        choices=("write", "z"),
        default="write",
        help="where the output error is measured: write (the head's write W_O z into the residual) or z "
        "(the o_proj input) (default %(default)s)",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the extra random start of levels b and c")
    p.add_argument(
        "--steps", type=optimiser_steps, default=150, help="optimiser steps per penalty stage (default %(default)s)"
    )
    add_answer_text_args(p)
    add_raw_prompt_arg(p)
    add_output_args(p)
    p.set_defaults(func=lambda args: run(args, load))


def run(args, load=load_from_args) -> int:
    # function-local: the method imports torch, not needed for --help
    from dataclasses import replace

    from core.files.images import load_image
    from core.methods.counterfactual import mask_from_png

    check_outputs(args)  # fail fast, before the model loads
    check_token_options(args)
    image = load_image(args.image)
    mask = mask_from_png(args.region, image.size) if args.region else None
    request = NonuniqueRequest(
        image=image,
        image_path=args.image,
        question=args.question,
        head=args.head,
        mask=mask,
        mask_name=args.region,
        raw_prompt=args.raw_prompt,
        cover=args.cover,
        share=args.share,
        tol=args.tol,
        score_bounds=tuple(args.score_bound or DEFAULT_SCORE_BOUNDS),
        levels=tuple(args.levels),
        objective=args.objective,
        min_moved=args.min_moved,
        space=args.space,
        seed=args.seed,
        steps=args.steps,
    )
    loaded = load(args)
    request = replace(request, answer_text=answer_text_of(args, loaded))
    with progress_bar("nonunique", quiet=args.quiet, messages=True) as progress:
        result = request.run(loaded, progress)
    doc = result.to_dict()  # the method's JSON with the head, the region rule, the model and the input
    parameters = {**request.parameters(), "region_rule": doc["region"]["rule"]}
    return finish(
        args, request, result, model=loaded, doc=doc, parameters=parameters,
        lines=[result.summary(), *(lv.statement for lv in result.levels)],
    )  # fmt: skip
