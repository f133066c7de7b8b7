"""``vlm-readout train-lens`` and ``vlm-readout eval-lens`` (docs/METHODS.md §4.9).

    vlm-readout train-lens --model SPEC --out DIR [--pairs FILE.jsonl|DIR] \\
        [--form affine|lowrank|identity|mlp] [--rank R] [--hidden H] \\
        [--positions all|text|visual|answer] [--steps N] [--batch-size B] \\
        [--optimizer sgd|adam] [--lr LR] [--weight-decay WD] [--seed S] \\
        [--checkpoint FILE [--resume]] [--eval-pairs FILE.jsonl] [--eval-n N]
    vlm-readout eval-lens --model SPEC --lens DIR (--pairs FILE.jsonl | --split heldout --n N) \\
        --json OUT [--positions P]

Without ``--pairs`` the training corpus is the synthetic scene generator's
``train`` split (the default models' data), and the lens is evaluated on the
generator's held-out split, a shifted domain (5-6 objects) and the independent
renderer. ``eval-lens`` writes the schema-1 ``eval-lens`` JSON of docs/ARCHITECTURE.md: per layer and
reader (identity, mean, random, trained), KL in bits, cross-entropy, top-1
agreement and mean answer rank. Every expected failure is one line on stderr
and exit status 2.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.cli.args import add_model_args
from core.cli.loading import load_from_args
from core.errors import ReadoutError
from core.shell.arguments import (
    LazyChoices,
    Number,
    batch_size,
    input_count,
    positive_int,
    seed_int,
    share_below_one,
    thread_count,
)
from core.shell.terminal import progress_bar

# The training options' domains, checked when the command line is parsed. A rank or hidden width
# past 2^16 exceeds any model's residual width; what a width costs with the model's own sizes
# is checked against the memory available once it loads (core.methods.tuned_lens.training).
translator_width = Number(int, 1, 2**16)
# At least one step (0 trained nothing and went on to evaluate for as long as the evaluations take).
training_steps = Number(int, 1, 1_000_000)
# The recipe's rates are 0.1-1 (SGD) and 3e-3 (Adam); past 10 a step overshoots any lens, and
# a rate near float's range overflows in the optimizer itself.
learning_rate = Number(float, 0, 10, lo_open=True)
weight_decay = Number(float, 0, 10)

# Options that are LensConfig fields default to None here and take LensConfig's
# default in run_train: building the parser must not import the lens module (torch).
_CONFIG_OPTIONS = (
    "form",
    "rank",
    "hidden",
    "positions",
    "steps",
    "batch_size",
    "optimizer",
    "momentum",
    "weight_decay",
    "warmup",
    "seed",
    "checkpoint_every",
)


def add_command(subparsers, load=load_from_args) -> None:
    forms = LazyChoices("core.methods.tuned_lens", "FORMS")
    position_sets = LazyChoices("core.methods.tuned_lens", "POSITION_SETS")
    t = subparsers.add_parser(
        "train-lens",
        help="train a tuned lens (one translator per layer) and save it with its capacity report",
        description="Train one translator per layer to minimise KL(final || lens) through the frozen final norm "
        "and unembedding, evaluate it beside the identity (logit lens), mean and random readers, and save "
        "lens.safetensors + lens.json (+ REPORT.md) into --out.",
        epilog="Training options left out take the defaults of core.methods.tuned_lens.LensConfig; lens.json "
        "records every value used.",
    )
    add_model_args(t)
    t.add_argument("--out", required=True, help="folder to write the lens into")
    t.add_argument(
        "--pairs",
        help="training corpus: JSONL of {image, question} (or a folder of *.jsonl); "
        "default: the synthetic scene generator's train split",
    )
    t.add_argument("--split", default="train", help="synthetic corpus split (default train)")
    t.add_argument("--form", choices=forms, default=None, metavar="FORM", help="%(choices)s")
    t.add_argument("--rank", type=translator_width, default=None, help="--form lowrank: the rank")
    t.add_argument("--hidden", type=translator_width, default=None, help="--form mlp: the hidden width (default 64)")
    t.add_argument(
        "--positions",
        choices=position_sets,
        default=None,
        metavar="POSITIONS",
        help="token positions trained on: %(choices)s",
    )
    t.add_argument("--steps", type=training_steps, default=None, help="optimizer steps")
    t.add_argument("--batch-size", type=batch_size, default=None, help="image-question pairs per step")
    t.add_argument("--optimizer", choices=("sgd", "adam"), default=None)
    t.add_argument("--lr", type=learning_rate, default=None, help="default: LensConfig's for sgd, 3e-3 for adam")
    t.add_argument("--momentum", type=share_below_one, default=None, help="sgd momentum")
    t.add_argument("--weight-decay", type=weight_decay, default=None, help="L2 towards the identity")
    t.add_argument("--warmup", type=share_below_one, default=None, help="share of steps with a linear warm-up")
    t.add_argument("--seed", type=seed_int, default=None)
    t.add_argument("--checkpoint", help="checkpoint file (written every --checkpoint-every steps and at the end)")
    t.add_argument("--checkpoint-every", type=positive_int, default=None)
    t.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    t.add_argument("--eval-pairs", help="held-out JSONL of pairs to evaluate on (with --pairs)")
    t.add_argument("--eval-n", type=input_count, default=1000, help="synthetic held-out pairs to evaluate on")
    t.add_argument("--shifted-n", type=input_count, default=500, help="synthetic shifted-domain pairs to evaluate on")
    t.add_argument("--no-eval", action="store_true", help="skip the evaluations")
    t.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=lambda args: run_train(args, load))

    e = subparsers.add_parser(
        "eval-lens",
        help="evaluate a saved tuned lens and its identity / mean / random baselines on held-out pairs",
        description="Evaluate a saved lens (refused unless the model's fingerprint matches) and its baselines on "
        "the same tokens; write per layer and reader KL (bits), cross-entropy, top-1 agreement and answer rank.",
    )
    add_model_args(e)
    e.add_argument("--lens", required=True, help="lens folder (lens.json + lens.safetensors)")
    e.add_argument("--pairs", help='JSONL, one {"image": path, "question": text[, "answer": token]} per line')
    e.add_argument("--split", help="instead of --pairs: a synthetic split (heldout, shifted, val, alt)")
    e.add_argument("--n", type=input_count, default=200, help="--split: pairs to evaluate")
    e.add_argument(
        "--positions",
        choices=position_sets,
        default=None,
        metavar="POSITIONS",
        help="primary token group: %(choices)s (default: the lens's)",
    )
    e.add_argument("--batch-size", type=batch_size, default=16)
    e.add_argument("--json", required=True, help="output file")
    e.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads")
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=lambda args: run_eval(args, load))


def _check_split(split: str) -> None:
    """A synthetic corpus split: one of the scene generator's, or "alt" (the second renderer)."""
    from core.zoo.scenes import SPLIT_SEEDS

    if split not in SPLIT_SEEDS and split != "alt":
        raise ReadoutError(f"unknown split {split!r}; expected one of {', '.join([*SPLIT_SEEDS, 'alt'])}")


def _threads(args) -> None:
    if args.threads:
        import torch  # function-local: only a run that asks for threads needs it

        torch.set_num_threads(args.threads)


def run_train(args, load=load_from_args) -> int:
    # function-local (here and in run_eval): the lens and the zoo import torch, not needed for --help
    from core.files.atomic import check_output_file, check_output_folder
    from core.files.pairs import check_pair_images
    from core.methods.tuned_lens import LensConfig, PairsCorpus, build_lens, read_pairs
    from core.zoo.lens_corpus import SyntheticCorpus, default_eval_sets

    given = {k: getattr(args, k) for k in _CONFIG_OPTIONS if getattr(args, k) is not None}
    cfg = LensConfig(**given)
    cfg.lr = args.lr if args.lr is not None else (LensConfig().lr if cfg.optimizer == "sgd" else 3e-3)
    cfg.check()
    if args.resume and not args.checkpoint:
        raise ReadoutError("--resume needs --checkpoint FILE")
    if args.eval_pairs and not args.pairs:
        raise ReadoutError("--eval-pairs goes with --pairs (the synthetic corpus has its own held-out splits)")
    check_output_folder(args.out)  # fail fast, before training
    if args.checkpoint:
        check_output_file(args.checkpoint)
    eval_sets = {}
    if args.pairs:
        corpus = PairsCorpus(read_pairs(Path(args.pairs)), seed=cfg.seed, source=str(args.pairs))
        if args.eval_pairs and not args.no_eval:
            eval_sets["heldout"] = (PairsCorpus(read_pairs(Path(args.eval_pairs)), source=str(args.eval_pairs)), None)
        with progress_bar("pairs", quiet=args.quiet, messages=True) as progress:
            for pairs in [corpus, *(c for c, _ in eval_sets.values())]:  # headers, before the model loads
                check_pair_images(pairs.pairs, progress)
    else:
        _check_split(args.split)
        corpus = SyntheticCorpus(args.split)
        if not args.no_eval:
            eval_sets = default_eval_sets(args.eval_n, args.shifted_n)
    _threads(args)
    loaded = load(args)
    with progress_bar("training lens", quiet=args.quiet, total=1, messages=True) as progress:
        lens, evaluations, result = build_lens(
            loaded,
            corpus,
            cfg,
            out=Path(args.out),
            eval_sets=eval_sets,
            checkpoint=Path(args.checkpoint) if args.checkpoint else None,
            resume=args.resume,
            progress=progress,
        )
    print(
        f"{lens.form} lens, {lens.n_parameters} parameters, {result.steps_done} steps in {result.seconds:.1f} s "
        f"-> {args.out}"
    )
    if evaluations:
        name, ev = next(iter(evaluations.items()))
        print(f"KL(final || lens) in bits on {name} ({ev.data.get('n_samples')} pairs, positions {ev.primary}):")
        print(ev.markdown())
    elif not args.no_eval:
        print("no held-out pairs given (--eval-pairs): the report has no held-out table")
    return 0


def run_eval(args, load=load_from_args) -> int:
    from core.files.atomic import check_output_file, write_text_atomic
    from core.files.pairs import check_pair_images
    from core.methods.tuned_lens import PairsCorpus, evaluate_lens, load_lens, read_pairs
    from core.zoo.lens_corpus import SyntheticCorpus

    if bool(args.pairs) == bool(args.split):
        raise ReadoutError("give --pairs FILE.jsonl or --split NAME (one of them)")
    check_output_file(args.json)  # fail fast, before the model loads
    lens = load_lens(Path(args.lens))  # fail fast, before the model loads
    if args.pairs:
        corpus, n = PairsCorpus(read_pairs(Path(args.pairs)), source=str(args.pairs)), None
        with progress_bar("pairs", quiet=args.quiet, messages=True) as progress:
            check_pair_images(corpus.pairs, progress)  # every image's header, before the model loads
    else:
        _check_split(args.split)
        corpus, n = SyntheticCorpus(args.split), args.n
    _threads(args)
    loaded = load(args)
    lens.check_model(loaded)
    lens.to(loaded.adapter.device)
    with progress_bar("evaluating lens", quiet=args.quiet, total=1, messages=True) as progress:
        ev = evaluate_lens(
            loaded, lens, corpus, n, primary=args.positions, batch_size=args.batch_size, progress=progress
        )
    # the model it read, with the dtype and device the readers were computed in
    model = {"spec": loaded.spec, "fingerprint": loaded.fingerprint, **loaded.adapter.describe()}
    write_text_atomic(Path(args.json), json.dumps({**ev.to_dict(), "model": model}) + "\n")
    print(f"KL(final || lens) in bits ({ev.data.get('n_samples')} pairs, positions {ev.primary}):")
    print(ev.markdown())
    return 0
