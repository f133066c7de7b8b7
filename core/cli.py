"""``vlm-readout`` command line.

Every expected failure (bad image, bad model folder, refused checkpoint,
question that does not fit) prints one line ``error: ...`` to stderr and
exits with status 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from core.errors import ReadoutError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="shapes-llava",
        help="built-in name, model folder, cached repo id, or open_clip name:checkpoint",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N, or auto (spread over devices)")
    p.add_argument("--allow-pickle", action="store_true", help="accept pickle checkpoints (they can run code)")
    p.add_argument("--trust-remote-code", action="store_true", help="accept models that ship their own code")
    p.add_argument("--allow-download", action="store_true", help="allow fetching a repo id that is not cached")


def _load(args):
    from core.models.loading import load_model

    return load_model(
        args.model,
        device=args.device,
        allow_pickle=args.allow_pickle,
        trust_remote_code=args.trust_remote_code,
        allow_download=args.allow_download,
    )


def read_pairs(path: Path) -> list[dict]:
    """JSONL of {"image": path, "question": text[, "answer": token]}; image paths are relative to the file."""
    if not path.is_file():
        raise ReadoutError(f"{path}: no such pairs file")
    pairs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            image, question = item["image"], item["question"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ReadoutError(f'{path}:{n}: expected {{"image": PATH, "question": TEXT}}') from None
        image_path = Path(image)
        if not image_path.is_absolute():
            image_path = path.parent / image_path
        pairs.append(
            {"image": str(image), "image_path": image_path, "question": question, "answer": item.get("answer")}
        )
    if not pairs:
        raise ReadoutError(f"{path}: no pairs")
    return pairs


def cmd_answer(args) -> int:
    from core.answer import answer, answer_batch
    from core.images import load_image

    if bool(args.pairs) == bool(args.image or args.question):
        raise ReadoutError("give either --image and --question, or --pairs FILE.jsonl")
    if not args.pairs:
        if not (args.image and args.question):
            raise ReadoutError("--image and --question are both needed")
        image = load_image(args.image)
        loaded = _load(args)
        a = answer(loaded, image, args.question, top_k=args.top_k)
        print(f"{a.answer}\t{a.prob:.4f}")
        return 0
    pairs = read_pairs(Path(args.pairs))
    images = [load_image(p["image_path"]) for p in pairs]  # fail fast, before the model loads
    loaded = _load(args)
    from tqdm import tqdm

    bar = tqdm(total=len(pairs), desc="answering", file=sys.stderr, disable=args.quiet)

    def progress(done: int, total: int) -> None:
        bar.update(done - bar.n)

    answers = answer_batch(
        loaded, images, [p["question"] for p in pairs], top_k=args.top_k, batch_size=args.batch_size, progress=progress
    )
    bar.close()
    lines = []
    for p, a in zip(pairs, answers):
        lines.append(
            json.dumps(
                {
                    "image": p["image"],
                    "question": p["question"],
                    "answer": a.answer,
                    "prob": a.prob,
                    "top": [[t, q] for t, q in a.top],
                }
            )
        )
    text = "\n".join(lines) + "\n"
    if args.out:
        from core.atomic import write_text_atomic

        write_text_atomic(Path(args.out), text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_analyze(args) -> int:
    from core.analyze import analyze, summary
    from core.atomic import write_text_atomic
    from core.images import load_image

    image = load_image(args.image)
    if args.session:
        from core.session import check_session_file, record_into

        check_session_file(args.session)  # fail fast, before the model loads
    tuned = None
    if args.lens:
        from core.methods.tuned_lens import load_lens

        tuned = load_lens(args.lens)
    loaded = _load(args)
    from tqdm import tqdm

    bar = tqdm(total=4, desc="analyze", file=sys.stderr, disable=args.quiet)

    def progress(done: int, total: int, message: str) -> None:
        bar.set_description(message)
        bar.update(done - bar.n)

    result = analyze(loaded, image, args.question, answer=args.answer, foil=args.foil, tuned=tuned, progress=progress)
    bar.close()
    write_text_atomic(Path(args.json), json.dumps(result) + "\n")
    if args.session:
        record_into(args.session, "analyze", result, image=image, image_path=args.image)
    print(summary(result))
    return 0


def cmd_evaluate(args) -> int:
    from core.zoo.evaluate import main as evaluate_main

    return evaluate_main(args)


# Modules that add their own subcommand: each defines
# ``add_command(subparsers, add_model_args, load)`` and sets ``func`` on its parser.
_COMMANDS: tuple[str, ...] = ("core.dataset_audit", "core.counterfactual_cli", "core.session_cli", "core.lens_cli")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vlm-readout", description="Read out what a vision-language model computed.")
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("answer", help="answer a question about an image (or a JSONL of pairs)")
    _add_model_args(a)
    a.add_argument("--image")
    a.add_argument("--question")
    a.add_argument("--pairs", help='JSONL, one {"image": path, "question": text} per line')
    a.add_argument("--out", help="write JSONL here (default: stdout)")
    a.add_argument("--top-k", type=int, default=5)
    a.add_argument("--batch-size", type=int, default=16)
    a.add_argument("--quiet", action="store_true", help="no progress bar")
    a.set_defaults(func=cmd_answer)

    an = sub.add_parser("analyze", help="capture once and write every text-side read-out as JSON")
    _add_model_args(an)
    an.add_argument("--image", required=True)
    an.add_argument("--question", required=True)
    an.add_argument("--answer", help="answer token (default: the model's top token)")
    an.add_argument("--foil", help="competing token; u = W_U[answer] - W_U[foil]")
    an.add_argument("--json", required=True, help="output file")
    an.add_argument("--session", help="also record the run into this session file (created if missing)")
    an.add_argument("--quiet", action="store_true")
    an.add_argument("--lens", help="tuned-lens folder: its reader and baselines beside the logit lens")
    an.set_defaults(func=cmd_analyze)

    e = sub.add_parser("evaluate-zoo", help="accuracy of a default model on held-out synthetic scenes")
    _add_model_args(e)
    e.add_argument("--n", type=int, default=2000)
    e.add_argument("--split", default="heldout")
    e.add_argument("--renderer", choices=["main", "alt"], default="main", help="alt: the independent second renderer")
    e.add_argument("--json", help="write the accuracy table here")
    e.add_argument("--batch-size", type=int, default=50)
    e.set_defaults(func=cmd_evaluate)

    import importlib

    for name in _COMMANDS:
        importlib.import_module(name).add_command(sub, _add_model_args, _load)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ReadoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
