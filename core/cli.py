"""``vlm-readout`` command line.

Every expected failure (bad image, bad model folder, refused checkpoint,
question that does not fit, an option out of range, a bad line in a pairs
file, an output that cannot be written) prints one line ``error: ...`` to
stderr and exits with status 2; nothing prints a traceback for them.

Numeric options are checked when the command line is parsed, by the shared
``type=`` validators below (:class:`Number`: :data:`positive_int`,
:data:`non_negative_int`, :data:`positive_float`, :data:`probability`, ...),
so ``--top-k 0`` is refused before anything loads. Building the parser
imports no model code of its own (the command modules import torch when their
command runs; bench/startup.py measures it with ``core/__init__`` stubbed).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from pathlib import Path

from core.errors import ReadoutError
from core.pairs import (  # noqa: F401  (re-exported: callers import them from core.cli)
    _json_type,
    check_pair_image,
    load_pair_image,
    read_jsonl,
    read_pairs,
    resolve_beside,
    text_field,
)

# ---------------------------------------------------------------- parsing

INT_MAX = 2**31 - 1  # larger counts are typos, and overflow C ints further down


class Number:
    """An argparse ``type=``: a finite int or float in ``[lo, hi]`` (an end
    open where asked). A value outside is refused at parse time with one line,
    ``argument --top-k: must be a positive integer (got 0)``.

    Args:
        kind: ``int`` or ``float``.
        lo, hi: the bounds (None: unbounded on that side).
        lo_open, hi_open: exclude that bound.
    """

    def __init__(self, kind: type, lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False):
        self.kind, self.lo, self.hi, self.lo_open, self.hi_open = kind, lo, hi, lo_open, hi_open
        self.__name__ = self.describe()  # argparse names the type by it

    def describe(self) -> str:
        noun = "an integer" if self.kind is int else "a number"
        lo, hi = self.lo, self.hi
        if self.kind is int and lo == 1 and hi in (None, INT_MAX):
            return "a positive integer"
        if lo == 0 and self.lo_open and hi is None:
            return f"a positive {'integer' if self.kind is int else 'number'}"
        if lo is not None and hi in (None, INT_MAX):
            return f"{noun} {'>' if self.lo_open else '>='} {lo}"
        if lo is not None and hi is not None:
            return f"{noun} in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        return f"{noun} {'<' if self.hi_open else '<='} {hi}" if hi is not None else noun

    def __repr__(self) -> str:
        return f"Number({self.describe()})"

    def contains(self, value) -> bool:
        """Whether ``value`` (already a number) is in the domain."""
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            return False
        return not (self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi)))

    def __call__(self, text: str):
        got = text if str(text).strip() else "an empty value"
        try:
            value = self.kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {self.describe()} (got {got})") from None
        if not self.contains(value):
            too_large = self.hi is not None and math.isfinite(value) and value > self.hi
            domain = f"at most {self.hi}" if too_large else self.describe()
            raise argparse.ArgumentTypeError(f"must be {domain} (got {got})")
        return value


positive_int = Number(int, 1, INT_MAX)
non_negative_int = Number(int, 0, INT_MAX)
seed_int = Number(int, 0, 2**32 - 1)  # every generator the engine seeds (numpy, torch) takes these
positive_float = Number(float, 0, lo_open=True)
non_negative_float = Number(float, 0)
probability = Number(float, 0, 1)
share_below_one = Number(float, 0, 1, hi_open=True)  # momentum, a share of the steps
positive_share = Number(float, 0, 1, lo_open=True)  # a share that must cover something


class LazyChoices:
    """argparse ``choices`` read from ``module.NAME`` only when an option is
    checked or help is shown, so building the parser imports no model code
    (the modules holding the names import torch). Give the option a
    ``metavar`` (argparse lists the choices in it when the option is added)
    and ``%(choices)s`` in its help."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def _values(self) -> tuple:
        return tuple(getattr(importlib.import_module(self.module), self.name))

    def __contains__(self, value) -> bool:
        return value in self._values()

    def __iter__(self):
        return iter(self._values())

    def __len__(self) -> int:
        return len(self._values())


class Parser(argparse.ArgumentParser):
    """argparse in the house style: a refused command line is one line
    ``error: ...`` on stderr and exit status 2 (no usage block; ``-h`` shows it)."""

    def error(self, message: str):
        self.exit(2, f"error: {' '.join(str(message).split())}\n")


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


def add_raw_prompt_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--raw-prompt",
        action="store_true",
        help="let the question hold the model's special tokens (</s>, <|im_start|>, ...); "
        "image placeholders stay refused",
    )


def _load(args):
    """The model of ``--model``; each warning of the load (unexpected tensors
    in the weights, ...) is one ``warning: ...`` line on stderr."""
    import warnings

    from core.models.loading import ModelLoadWarning, load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ModelLoadWarning)  # printed below, one line each
        loaded = load_model(
            args.model,
            device=args.device,
            allow_pickle=args.allow_pickle,
            trust_remote_code=args.trust_remote_code,
            allow_download=args.allow_download,
        )
    for note in loaded.info.get("warnings", []):
        print(f"warning: {' '.join(str(note).split())}", file=sys.stderr)
    return loaded


# ---------------------------------------------------------------- JSONL input

# read_jsonl, text_field, read_pairs, load_pair_image, check_pair_image: in core.pairs (imported above).


# ---------------------------------------------------------------- commands


def cmd_answer(args) -> int:
    if bool(args.pairs) == bool(args.image or args.question):
        raise ReadoutError("give either --image and --question, or --pairs FILE.jsonl")
    from core.answer import answer, answer_batch
    from core.atomic import check_output_file, write_text_atomic
    from core.images import load_image

    if not args.pairs:
        if not (args.image and args.question):
            raise ReadoutError("--image and --question are both needed")
        if args.out:
            raise ReadoutError("--out goes with --pairs (one answer prints to stdout)")
        image = load_image(args.image)
        loaded = _load(args)
        a = answer(loaded, image, args.question, top_k=args.top_k, raw_prompt=args.raw_prompt)
        print(f"{a.answer}\t{a.prob:.4f}")
        return 0
    pairs = read_pairs(Path(args.pairs))
    if args.out:
        check_output_file(args.out)  # fail fast, before the images and the model load
    # every file checked before the model loads; each decoded only in its batch (memory stays one batch's)
    images = [check_pair_image(p) for p in pairs]
    loaded = _load(args)
    from tqdm import tqdm

    bar = tqdm(total=len(pairs), desc="answering", file=sys.stderr, disable=args.quiet)

    def progress(done: int, total: int) -> None:
        bar.update(done - bar.n)

    answers = answer_batch(
        loaded,
        images,
        [p["question"] for p in pairs],
        top_k=args.top_k,
        batch_size=args.batch_size,
        raw_prompt=args.raw_prompt,
        progress=progress,
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
        write_text_atomic(Path(args.out), text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_analyze(args) -> int:
    from core.analyze import analyze, summary
    from core.atomic import check_output_file, write_text_atomic
    from core.images import load_image

    check_output_file(args.json)  # fail fast, before the model loads
    image = load_image(args.image)
    if args.session:
        from core.session import check_session_file, record_into

        check_session_file(args.session)
    tuned = None
    if args.lens:
        from core.methods.tuned_lens.store import load_lens

        tuned = load_lens(args.lens)
    loaded = _load(args)
    from tqdm import tqdm

    bar = tqdm(total=4, desc="analyze", file=sys.stderr, disable=args.quiet)

    def progress(done: int, total: int, message: str) -> None:
        bar.set_description(message)
        bar.update(done - bar.n)

    result = analyze(
        loaded,
        image,
        args.question,
        answer=args.answer,
        foil=args.foil,
        tuned=tuned,
        raw_prompt=args.raw_prompt,
        progress=progress,
    )
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
# Importing them (and building their parsers) must not import torch: see LazyChoices.
_COMMANDS: tuple[str, ...] = ("core.audit_cli", "core.counterfactual_cli", "core.session_cli", "core.lens_cli")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="vlm-readout", description="Read out what a vision-language model computed.")
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("answer", help="answer a question about an image (or a JSONL of pairs)")
    _add_model_args(a)
    a.add_argument("--image")
    a.add_argument("--question")
    a.add_argument("--pairs", help='JSONL, one {"image": path, "question": text} per line')
    a.add_argument("--out", help="write JSONL here (default: stdout)")
    a.add_argument("--top-k", type=positive_int, default=5)
    a.add_argument("--batch-size", type=positive_int, default=16)
    a.add_argument("--quiet", action="store_true", help="no progress bar")
    add_raw_prompt_arg(a)
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
    add_raw_prompt_arg(an)
    an.add_argument("--lens", help="tuned-lens folder: its reader and baselines beside the logit lens")
    an.set_defaults(func=cmd_analyze)

    e = sub.add_parser("evaluate-zoo", help="accuracy of a default model on held-out synthetic scenes")
    _add_model_args(e)
    e.add_argument("--n", type=positive_int, default=2000)
    e.add_argument("--split", default="heldout")
    e.add_argument("--renderer", choices=["main", "alt"], default="main", help="alt: the independent second renderer")
    e.add_argument("--json", help="write the accuracy table here")
    e.add_argument("--batch-size", type=positive_int, default=50)
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.set_defaults(func=cmd_evaluate)

    for name in _COMMANDS:
        importlib.import_module(name).add_command(sub, _add_model_args, _load)
    return p


def _stdout_gone() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush at exit
    raises nothing after a write to it failed."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # -h (0), or a refused command line (2; its one line is printed)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    try:
        code = args.func(args)
        sys.stdout.flush()
        return code
    except ReadoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (| head): nothing to add
        _stdout_gone()
        return 1
    except OSError as e:
        try:  # was it stdout (a full disk behind > FILE)? Then the buffer still cannot be flushed
            sys.stdout.flush()
        except OSError:
            _stdout_gone()
            print(f"error: cannot write to standard output ({os.strerror(e.errno) if e.errno else e})", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
