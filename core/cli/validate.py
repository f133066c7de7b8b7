"""``vlm-readout validate``: check a functional label with the seven-step chain
(docs/METHODS.md §4.5, §4.11; the library call is :func:`core.validate.validate`).

    vlm-readout validate --model M --head L1.H1 [--route L1.H0+L1.H1] \\
        --claim TEXT --dataset scenes|DIR_OR_JSONL [--heldout SOURCE] --json OUT [--session S]

Each step's status (passed / failed / not tested), its key number, n and the
baselines with their 95% intervals are printed per head or route, then the
verdict: "supported on D" only when all seven pass, D being the held-out
distribution the numbers were measured on.
"""

from __future__ import annotations

from core.cli.args import add_model_args, add_output_args, check_outputs
from core.cli.loading import load_from_args
from core.cli.outputs import finish
from core.requests.validate import ValidateRequest
from core.shell.arguments import Number, batch_size, non_negative_int, seed_int

# Inputs of each set (--n, --n-side): every one is held in memory with its masks (~100 kB a scene)
# through the seven steps.
MAX_CHAIN_INPUTS = 10_000
SOURCE_HELP = (
    "'scenes' or 'scenes:SPLIT' (the synthetic shape scenes, their ground truth the target and distractors), or a "
    "pairs JSONL / a folder holding one whose lines give answer, foil and the target's mask (object_masks with "
    "target, or target_mask and distractor_masks)"
)


def add_command(subparsers, load=load_from_args) -> None:
    p = subparsers.add_parser(
        "validate",
        help="check a functional label: the seven-step validation chain on held-out inputs",
        description="Run the validation chain of docs/METHODS.md 4.11 on a head or a route and state where the "
        "claim holds. The claim is checked as the relation its specification states (--spec; default "
        "'attribute-moving': moves the asked attribute (colour or shape) from the target object's visual tokens to "
        "the answer position) on attribute questions; candidates are found or "
        "named on the search set and every step is measured on the held-out set: 1 the answer row lands on the "
        "target (against chance), 2 the head's write from the target's tokens favours the answer over the foil, "
        "3 its DLA predicts the re-run effect of zeroing it, 4 swapping the attribute onto another object moves "
        "the attention with it, 5 mean ablation lowers the answer's margin, 6 matched random heads, the other "
        "heads of its block, entropy-matched heads and position baselines are weaker, 7 side effects on other "
        "question kinds and the strongest alternative route are reported. The verdict is 'supported on D' only "
        "when all seven pass.",
    )
    add_model_args(p)
    p.add_argument(
        "--head",
        action="append",
        default=[],
        metavar="BLOCK.HN",
        help="a head to validate, as BLOCK.H<index> (L1.H1; CoCa's cross blocks L1.xattn.H2); repeatable",
    )
    p.add_argument(
        "--route",
        action="append",
        default=[],
        metavar="HEADS",
        help="several heads of one block validated together, joined by '+' (L1.H0+L1.H1 or L1.H0+H1); repeatable",
    )
    p.add_argument(
        "--candidates",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="also find candidates on the search set: the top K heads by target-source DLA, the top head by "
        "target hit rate, and the routes of blocks holding two or more of them (default 0: only those named)",
    )
    p.add_argument(
        "--claim",
        required=True,
        metavar="TEXT",
        help="what the head or route is claimed to do, in your words (recorded with the relation and the "
        "distribution it is checked on)",
    )
    p.add_argument(
        "--spec",
        metavar="NAME_OR_FILE",
        help="the claim's specification: a shipped one's name (attribute-moving) or a JSON file of its fields "
        "(name, relation, query, sources, hit_ratio, hit_p, prediction_r, follow_rate, effect_size): the relation "
        "tested and each step's pre-registered threshold (default: attribute-moving)",
    )
    p.add_argument("--dataset", required=True, metavar="SOURCE", help="the search set: " + SOURCE_HELP)
    p.add_argument(
        "--heldout",
        metavar="SOURCE",
        help="the held-out set every step is measured on, as --dataset (default: scenes:heldout for scenes, the "
        "seeded other half of the lines for a file)",
    )
    p.add_argument(
        "--n",
        type=Number(int, 1, MAX_CHAIN_INPUTS),
        default=150,
        help="attribute inputs of each set: the first N that pass the filters (default %(default)s)",
    )
    p.add_argument(
        "--n-side",
        type=Number(int, 0, MAX_CHAIN_INPUTS),
        default=50,
        help="inputs of each other question kind for step 7's side effects (default %(default)s; 0: not tested)",
    )
    p.add_argument(
        "--region",
        metavar="MASK",
        help="PNG mask, white = the target (a painted region): the target of every line without a mask of its own",
    )
    p.add_argument(
        "--min-distractors",
        type=non_negative_int,
        default=1,
        help="distractor regions an input must have (step 2 contrasts the target with the strongest; default "
        "%(default)s)",
    )
    p.add_argument(
        "--seed", type=seed_int, default=0, help="seed of the matched random heads, the swaps' noise, the halving"
    )
    p.add_argument("--batch-size", type=batch_size, default=32, help="inputs per forward (default %(default)s)")
    add_output_args(
        p,
        json_help="output file: the claim, both conditions, every step's evidence",
        session_help="also record the run (its audit rows per step) into this session file",
    )
    p.set_defaults(func=lambda args: run(args, load))


def _interval(stats: dict | None) -> str:
    ci = (stats or {}).get("ci95") or [None, None]
    return "" if None in ci else f" [{ci[0]:.3g}, {ci[1]:.3g}]"


def _number(v) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def checklist(chain) -> list[str]:
    """The lines printed for one chain: a step a line, under it its baselines
    (value and 95% interval; step 6: each paired comparison), then the status."""
    lines = [f"{chain.subject} ({chain.subject_kind}): {chain.status().status}"]
    for k, s in chain.steps.items():
        value = "" if s.value is None else f" {s.metric} {s.value:.3g}"
        lines.append(f"  {k} {s.status:<10}{value}{f' (n={s.n})' if s.n else ''}  {s.title}")
        for b in s.baselines:
            if k == 6:
                d = b.detail
                lines.append(
                    f"      step {d['step']} vs {b.kind}: {_number(b.value)} against {_number(d['candidate'])}, "
                    f"difference{_interval(d['paired_difference'])}"
                )
            else:
                lines.append(f"      vs {b.kind}: {_number(b.value)}{_interval(b.detail.get('stats'))}")
    return lines


def run(args, load=load_from_args) -> int:
    # function-local: the chain imports torch and numpy, not needed for --help
    from core.files.images import load_mask
    from core.methods.validation.spec import resolve as resolve_spec
    from core.shell.terminal import progress_bar

    check_outputs(args)  # fail fast, before the model loads
    region = load_mask(args.region) if args.region else None
    spec = resolve_spec(args.spec).to_dict() if args.spec else None  # a bad file: one line, nothing loaded
    request = ValidateRequest(
        subjects=(*args.head, *args.route),
        claim=args.claim,
        dataset=args.dataset,
        heldout=args.heldout,
        candidates=args.candidates,
        n=args.n,
        n_side=args.n_side,
        region=region,
        min_distractors=args.min_distractors,
        seed=args.seed,
        batch_size=args.batch_size,
        spec=spec,
    )
    loaded = load(args)
    with progress_bar("validate", quiet=args.quiet, messages=True) as progress:
        result = request.run(loaded, progress)
    lines = []
    for chain, verdict in zip(result.chains, result.verdicts()):
        lines += [*checklist(chain), f"  verdict: {verdict['verdict']}"]
    return finish(args, request, result, model=loaded, lines=[*lines, result.summary()])
