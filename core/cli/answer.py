"""``vlm-readout answer``: the model's answer to one question about one image,
or one JSON line per pair of a pairs file (``--pairs``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from core.cli.args import add_model_args, add_raw_prompt_arg
from core.cli.loading import load_from_args
from core.errors import ReadoutError
from core.files.pairs import check_pair_images, read_pairs
from core.shell.arguments import batch_size, positive_int
from core.shell.terminal import progress_bar


def add_command(subparsers, load=load_from_args) -> None:
    a = subparsers.add_parser("answer", help="answer a question about an image (or a JSONL of pairs)")
    add_model_args(a)
    a.add_argument("--image")
    a.add_argument("--question")
    a.add_argument("--pairs", help='JSONL, one {"image": path, "question": text} per line')
    a.add_argument("--out", help="write JSONL here (default: stdout)")
    a.add_argument("--top-k", type=positive_int, default=5)
    a.add_argument("--batch-size", type=batch_size, default=16)
    a.add_argument("--quiet", action="store_true", help="no progress bar")
    add_raw_prompt_arg(a)
    a.set_defaults(func=lambda args: run(args, load))


def run(args, load=load_from_args) -> int:
    if bool(args.pairs) == bool(args.image or args.question):
        raise ReadoutError("give either --image and --question, or --pairs FILE.jsonl")
    # function-local (here and in every command's run): torch loads when the command runs, not for --help
    from core.answer import answer, answer_batch
    from core.files.atomic import check_output_file, write_text_atomic
    from core.files.images import load_image

    if not args.pairs:
        if not (args.image and args.question):
            raise ReadoutError("--image and --question are both needed")
        if args.out:
            raise ReadoutError("--out goes with --pairs (one answer prints to stdout)")
        image = load_image(args.image)
        loaded = load(args)
        a = answer(loaded, image, args.question, top_k=args.top_k, raw_prompt=args.raw_prompt)
        print(f"{a.answer}\t{a.prob:.4f}")
        return 0
    # every line and every image file checked before the model loads, with progress (a million lines take
    # seconds); each image decoded only in its batch (memory stays one batch's)
    with progress_bar("pairs", quiet=args.quiet, messages=True) as progress:
        pairs = read_pairs(Path(args.pairs), progress=progress)
        if args.out:
            check_output_file(args.out)  # fail fast, before the images and the model load
        images = check_pair_images(pairs, progress)
    loaded = load(args)
    with progress_bar("answering", quiet=args.quiet, total=len(pairs)) as progress:
        answers = answer_batch(
            loaded,
            images,
            [p.question for p in pairs],
            top_k=args.top_k,
            batch_size=args.batch_size,
            raw_prompt=args.raw_prompt,
            progress=progress,
        )
    lines = [
        json.dumps(
            {
                "image": p.image,
                "question": p.question,
                "answer": a.answer,
                "prob": a.prob,
                "top": [[t, q] for t, q in a.top],
            }
        )
        for p, a in zip(pairs, answers)
    ]
    text = "\n".join(lines) + "\n"
    if args.out:
        write_text_atomic(Path(args.out), text)
    else:
        sys.stdout.write(text)
    return 0
