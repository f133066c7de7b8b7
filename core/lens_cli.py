"""``vlm-readout train-lens`` and ``vlm-readout eval-lens`` (METHODS.md 4.9).

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
renderer. ``eval-lens`` writes the schema-1 JSON of DESIGN.md: per layer and
reader (identity, mean, random, trained), KL in bits, cross-entropy, top-1
agreement and mean answer rank. Every expected failure is one line on stderr
and exit status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from core.errors import ReadoutError


def add_command(subparsers, add_model_args, load) -> None:
    from core.methods.tuned_lens import FORMS, POSITION_SETS, LensConfig

    d = LensConfig()
    t = subparsers.add_parser(
        "train-lens",
        help="train a tuned lens (one translator per layer) and save it with its capacity report",
        description="Train one translator per layer to minimise KL(final || lens) through the frozen final norm "
        "and unembedding, evaluate it beside the identity (logit lens), mean and random readers, and save "
        "lens.safetensors + lens.json (+ REPORT.md) into --out.",
    )
    add_model_args(t)
    t.add_argument("--out", required=True, help="folder to write the lens into")
    t.add_argument(
        "--pairs",
        help="training corpus: JSONL of {image, question} (or a folder of *.jsonl); "
        "default: the synthetic scene generator's train split",
    )
    t.add_argument("--split", default="train", help="synthetic corpus split (default train)")
    t.add_argument("--form", choices=FORMS, default=d.form)
    t.add_argument("--rank", type=int, default=None, help="--form lowrank: the rank")
    t.add_argument("--hidden", type=int, default=None, help="--form mlp: the hidden width (default 64)")
    t.add_argument("--positions", choices=POSITION_SETS, default=d.positions, help="token positions trained on")
    t.add_argument("--steps", type=int, default=d.steps)
    t.add_argument("--batch-size", type=int, default=d.batch_size, help="image-question pairs per step")
    t.add_argument("--optimizer", choices=("sgd", "adam"), default=d.optimizer)
    t.add_argument("--lr", type=float, default=None, help=f"default {d.lr} for sgd, 3e-3 for adam")
    t.add_argument("--momentum", type=float, default=d.momentum)
    t.add_argument("--weight-decay", type=float, default=d.weight_decay, help="L2 towards the identity")
    t.add_argument("--warmup", type=float, default=d.warmup, help="share of steps with a linear warm-up")
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument("--checkpoint", help="checkpoint file (written every --checkpoint-every steps and at the end)")
    t.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    t.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    t.add_argument("--eval-pairs", help="held-out JSONL of pairs to evaluate on (with --pairs)")
    t.add_argument("--eval-n", type=int, default=1000, help="synthetic held-out pairs to evaluate on")
    t.add_argument("--shifted-n", type=int, default=500, help="synthetic shifted-domain pairs to evaluate on")
    t.add_argument("--no-eval", action="store_true", help="skip the evaluations")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads")
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
    e.add_argument("--n", type=int, default=200, help="--split: pairs to evaluate")
    e.add_argument("--positions", choices=POSITION_SETS, default=None, help="primary token group (default: the lens's)")
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--json", required=True, help="output file")
    e.add_argument("--threads", type=int, default=None)
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=lambda args: run_eval(args, load))


def _bar(args, desc: str):
    from tqdm import tqdm

    bar = tqdm(total=1, desc=desc, file=sys.stderr, disable=args.quiet)

    def progress(done: int, total: int, message: str) -> None:
        if bar.total != total:
            bar.reset(total=total)
        bar.set_description(message)
        bar.update(done - bar.n)

    return bar, progress


def _threads(args) -> None:
    if args.threads:
        if args.threads < 1:
            raise ReadoutError(f"--threads must be at least 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)


def run_train(args, load) -> int:
    from core.methods.tuned_lens import (
        LensConfig,
        PairsCorpus,
        SyntheticCorpus,
        build_lens,
        default_eval_sets,
        read_pairs,
    )

    lr = args.lr if args.lr is not None else (LensConfig().lr if args.optimizer == "sgd" else 3e-3)
    cfg = LensConfig(
        form=args.form,
        rank=args.rank,
        hidden=args.hidden,
        positions=args.positions,
        steps=args.steps,
        batch_size=args.batch_size,
        optimizer=args.optimizer,
        lr=lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        warmup=args.warmup,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
    )
    cfg.check()
    if args.resume and not args.checkpoint:
        raise ReadoutError("--resume needs --checkpoint FILE")
    if args.eval_pairs and not args.pairs:
        raise ReadoutError("--eval-pairs goes with --pairs (the synthetic corpus has its own held-out splits)")
    eval_sets = {}
    if args.pairs:
        corpus = PairsCorpus(read_pairs(Path(args.pairs)), seed=args.seed, source=str(args.pairs))
        if args.eval_pairs and not args.no_eval:
            eval_sets["heldout"] = (PairsCorpus(read_pairs(Path(args.eval_pairs)), source=str(args.eval_pairs)), None)
    else:
        corpus = SyntheticCorpus(args.split)
        if not args.no_eval:
            eval_sets = default_eval_sets(args.eval_n, args.shifted_n)
    _threads(args)
    loaded = load(args)
    bar, progress = _bar(args, "training lens")
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
    bar.close()
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


def run_eval(args, load) -> int:
    from core.atomic import write_text_atomic
    from core.methods.tuned_lens import PairsCorpus, SyntheticCorpus, evaluate_lens, load_lens, read_pairs

    if bool(args.pairs) == bool(args.split):
        raise ReadoutError("give --pairs FILE.jsonl or --split NAME (one of them)")
    if args.batch_size < 1:
        raise ReadoutError(f"--batch-size must be at least 1, got {args.batch_size}")
    lens = load_lens(Path(args.lens))  # fail fast, before the model loads
    if args.pairs:
        corpus, n = PairsCorpus(read_pairs(Path(args.pairs)), source=str(args.pairs)), None
        corpus.take(None)  # every image readable before the model loads (kept: evaluated as loaded)
    else:
        from core.zoo.scenes import SPLIT_SEEDS

        if args.split not in SPLIT_SEEDS and args.split != "alt":
            raise ReadoutError(f"unknown split {args.split!r}; expected one of {', '.join([*SPLIT_SEEDS, 'alt'])}")
        corpus, n = SyntheticCorpus(args.split), args.n
    _threads(args)
    loaded = load(args)
    lens.check_model(loaded)
    lens.to(loaded.adapter.device)
    bar, progress = _bar(args, "evaluating lens")
    ev = evaluate_lens(loaded, lens, corpus, n, primary=args.positions, batch_size=args.batch_size, progress=progress)
    bar.close()
    write_text_atomic(Path(args.json), json.dumps(ev.to_dict()) + "\n")
    print(f"KL(final || lens) in bits ({ev.data.get('n_samples')} pairs, positions {ev.primary}):")
    print(ev.markdown())
    return 0
