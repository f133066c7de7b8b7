"""The options the model commands share: which model, where, and what it
may do at load (:func:`add_model_args`), the input (:func:`add_input_args`),
the measured tokens (:func:`add_token_args`), where the run goes
(:func:`add_output_args`) and ``--raw-prompt`` (:func:`add_raw_prompt_arg`).
Imports nothing heavy: the parser is built before anything loads. The generic
pieces (Parser, the number validators) are in :mod:`core.shell.arguments`."""

from __future__ import annotations

import argparse

from core.shell.precision import AUTO_DTYPE_MEANING, DTYPE_CHOICES  # torch-free


def device_name(text: str) -> str:
    """The ``--device`` type: a device this machine has (:func:`core.shell.precision.device_problem`,
    the loader's own check), refused at parse time with one line naming the ones it has.
    Torch is imported only to look for a GPU (not for cpu or auto)."""
    from core.shell.precision import device_problem, shown_device

    problem = device_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{shown_device(text)}: {problem}")
    return text


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--device``, ``--dtype``, ``--allow-pickle``, ``--trust-remote-code``,
    ``--allow-download``: what :func:`core.cli.loading.load_from_args` reads. Every
    model command takes them from here."""
    p.add_argument(
        "--model",
        default="shapes-llava",
        help="built-in name, model folder, cached repo id, or open_clip name:checkpoint",
    )
    p.add_argument(
        "--device",
        type=device_name,
        default=None,
        help="cpu, cuda, cuda:N, or auto (spread over devices); a device this machine lacks is refused, "
        "naming the ones it has",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help=f"the dtype the model runs in (default {AUTO_DTYPE_MEANING}); the result records the one used",
    )
    p.add_argument("--allow-pickle", action="store_true", help="accept pickle checkpoints (they can run code)")
    p.add_argument("--trust-remote-code", action="store_true", help="accept models that ship their own code")
    p.add_argument("--allow-download", action="store_true", help="allow fetching a repo id that is not cached")


def add_input_args(p: argparse.ArgumentParser, *, question_help: str = "the question about the image") -> None:
    """``--image`` and ``--question``, both required: the input a one-image command reads out."""
    p.add_argument("--image", required=True, help="the image (PNG, JPEG, ...)")
    p.add_argument("--question", required=True, help=question_help)


def add_token_args(
    p: argparse.ArgumentParser,
    *,
    answer_help: str = "answer token (default: the model's top token)",
    foil_help: str = "competing token; logit difference = answer - foil",
) -> None:
    """``--answer`` and ``--foil``: the tokens whose logit difference a read-out measures
    (:func:`answer_tokens` reads them)."""
    p.add_argument("--answer", help=answer_help)
    p.add_argument("--foil", help=foil_help)


def add_output_args(
    p: argparse.ArgumentParser,
    *,
    json_help: str = "output file",
    json_required: bool = True,
    session_help: str = "also record the run (with image and mask) into this session file",
    quiet: bool = True,
) -> None:
    """``--json``, ``--session`` and ``--quiet``: where a run's document goes
    (:func:`core.cli.outputs.finish` writes and records it) and whether a bar is drawn."""
    p.add_argument("--json", required=json_required, help=json_help)
    p.add_argument("--session", help=session_help)
    if quiet:
        p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_raw_prompt_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--raw-prompt",
        action="store_true",
        help="let the question hold the model's special tokens (</s>, <|im_start|>, ...); "
        "image placeholders stay refused",
    )


def add_answer_text_args(p: argparse.ArgumentParser, *, from_generation: bool = True) -> None:
    """``--answer-text`` (and, with ``from_generation``, ``--answer-from``) and
    ``--token-index``: read out at token K of an answer (teacher forcing;
    :func:`answer_text_of`)."""
    from core.shell.arguments import non_negative_int

    given = p.add_mutually_exclusive_group()
    given.add_argument(
        "--answer-text",
        help="an answer (typed): read out at one of its tokens, the prompt plus the tokens before it as context "
        "(default: the first token after the prompt); split by the model's tokenizer on its own",
    )
    if from_generation:
        given.add_argument(
            "--answer-from",
            metavar="GENERATE_JSON",
            help="the answer of a `vlm-readout generate --json` file, by its token ids (exact: decoding and re-encoding "
            "a generated answer need not give the same tokens)",
        )
    p.add_argument(
        "--token-index",
        type=non_negative_int,
        help="which answer token is read out, counted in the model's tokens of the answer (0 = the first; "
        "a word of several tokens has one index per sub-token; the tokens are listed when K is out of range)",
    )


def answer_text_request(args) -> tuple[str, int] | None:
    """``(answer text, token index)`` of ``--answer-text`` / ``--token-index`` (index
    0 when not given), or None without ``--answer-text``; a QuestionError for an
    index without an answer."""
    from core.errors import QuestionError

    if args.answer_text is None:
        if args.token_index is not None and getattr(args, "answer_from", None) is None:
            given = "--answer-text or --answer-from" if hasattr(args, "answer_from") else "--answer-text"
            raise QuestionError(f"--token-index needs {given} (the answer whose token is read out)")
        return None
    check_text_option("--answer-text", args.answer_text)
    return args.answer_text, args.token_index or 0


def check_text_option(option: str, value: str | None) -> None:
    """QuestionError (one line starting with ``option``) for a token or word option
    no model could take: empty, only whitespace, not UTF-8 text
    (:func:`core.answer_text.text_problem`); before the model loads."""
    from core.answer_text import text_problem
    from core.errors import QuestionError

    problem = None if value is None else text_problem(value)
    if problem is not None:
        blank = not value.strip() if isinstance(value, str) else False
        raise QuestionError(f"{option} {problem}" + (f" (leave {option} out for its default)" if blank else ""))


def check_token_options(args) -> None:
    """Before the model loads: ``--answer``, ``--foil`` and ``--answer-text``
    (:func:`check_text_option`; ``--foil ""`` is no "no foil": leave it out)."""
    for option in ("--answer", "--foil"):
        check_text_option(option, getattr(args, option.removeprefix("--"), None))
    if getattr(args, "answer_text", None) is not None:
        answer_text_request(args)


def answer_tokens(args, adapter) -> tuple[int | None, int | None]:
    """After the model loads: the ids of ``--answer`` and ``--foil`` (None: not
    given) by the one rule of a typed answer, the app's Target and foil fields'
    too (:func:`core.answer_text.typed_token`): one token is that token; text
    the tokenizer splits reads its first sub-token, said in a ``warning:`` line;
    markup or a word the vocabulary lacks is one error line starting with the option."""
    from core.answer_text import typed_token
    from core.shell.terminal import say

    ids = []
    for option in ("--answer", "--foil"):
        value = getattr(args, option.removeprefix("--"), None)
        typed = typed_token(adapter, value, what=option) if value is not None else None
        if typed is not None and typed.spans_several:
            say(f"warning: {option} {typed.note()}")
        ids.append(typed.token_id if typed is not None else None)
    return ids[0], ids[1]


def answer_text_of(args, loaded):
    """The :class:`core.answer_text.AnswerText` of the command line (None without
    an answer): ``--answer-text`` as the model's tokenizer splits it, or the
    token ids of the ``--answer-from`` generation, which must be of this model,
    this question and (where the file records it) this image, with tokens this
    model can be fed (:func:`core.generate.check_generation`; InputFileError otherwise)."""
    from core.answer_text import AnswerText

    request = answer_text_request(args)
    if request is not None:
        return AnswerText.of_text(loaded.adapter, *request, what="--answer-text", index_what="--token-index")
    if getattr(args, "answer_from", None) is None:
        return None
    from core.files.images import image_sha256, load_image
    from core.generate import check_generation, read_generation

    generation = read_generation(args.answer_from)
    check_generation(
        generation,
        loaded,
        args.answer_from,
        question=args.question,
        raw_prompt=getattr(args, "raw_prompt", False),
        # the command loaded the image already; a generation that records one is compared with it
        image_sha256=image_sha256(load_image(args.image)) if generation.image_sha256 is not None else None,
    )
    return generation.answer_text(args.token_index or 0)


def check_outputs(args) -> None:
    """``--json`` and ``--session`` checked before anything loads: a file that cannot be
    written, or a session that cannot be opened, fails first, in one line."""
    from core.files.atomic import check_output_file

    if getattr(args, "json", None) is not None:
        check_output_file(args.json)
    if getattr(args, "session", None):
        from core.session import check_session_file

        check_session_file(args.session)


def asked_of(args, image) -> dict:
    """The :class:`core.requests.base.AskedRequest` fields of the command line: the image (its
    pixels and ``--image`` as given), ``--question``, ``--answer`` and ``--foil`` as typed."""
    return {
        "image": image,
        "image_path": args.image,
        "question": args.question,
        "answer": args.answer or "",
        "foil": args.foil or "",
    }


def loaded_for(args, load, request, check=None):
    """``(loaded, request)`` once the fail-fast checks passed: the model loaded, ``check(loaded)``
    (what must fail before anything runs: a component or site the model lacks), the answer token
    read out set on ``request``, and the typed answer and foil checked by the one rule (a word of
    several tokens: a ``warning:`` line)."""
    from dataclasses import replace

    loaded = load(args)
    if check is not None:
        check(loaded)
    request = replace(request, answer_text=answer_text_of(args, loaded))
    answer_tokens(args, loaded.adapter)
    return loaded, request
