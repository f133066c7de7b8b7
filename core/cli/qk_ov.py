"""``vlm-readout qk-ov``: one head's QK and OV circuits (docs/METHODS.md §4.3),
the weight level (position-free QK form, OV map, singular values, copying
score) kept apart from the activation level (the scores the head realised at
the answer row of one input, with the position scheme).

    vlm-readout qk-ov --model M --head L1.H1 [--image I --question Q]
        [--answer-text T [--token-index K]] [--copy-tokens W,W,...] --json OUT [--session S]
"""

from __future__ import annotations

from core.cli.args import (
    add_answer_text_args,
    add_model_args,
    add_output_args,
    add_raw_prompt_arg,
    answer_text_of,
    check_outputs,
    check_token_options,
)
from core.cli.loading import load_from_args
from core.cli.outputs import finish

# MAX_COPY_TOKENS and copy_token_ids are re-exported: their home was this module
from core.requests.qk_ov import MAX_COPY_TOKENS, QkOvRequest, check_copy_words, copy_token_ids  # noqa: F401
from core.shell.arguments import positive_int


def add_command(subparsers, load=load_from_args) -> None:
    q = subparsers.add_parser(
        "qk-ov", help="a head's QK / OV circuits: weight level, and with an input the realised scores"
    )
    add_model_args(q)
    q.add_argument(
        "--head",
        required=True,
        help="the head, as BLOCK.H<index> with the trace's block names (L1.H0; T0.H1, L1.xattn.H2 for CoCa)",
    )
    q.add_argument("--image", help="with --question: also read out the activation level on this input")
    q.add_argument("--question", help="with --image: the question whose answer row's scores are read out")
    q.add_argument(
        "--copy-tokens",
        metavar="WORDS",
        help="comma-separated words whose tokens the copying score runs over (default: the whole vocabulary, "
        "when it has at most 2048 tokens; otherwise the copying score is skipped)",
    )
    q.add_argument(
        "--top-k", type=positive_int, default=5, help="keys listed with the most attention (activation level)"
    )
    add_output_args(q, session_help="also record the run into this session file (created if missing)", quiet=False)
    add_raw_prompt_arg(q)
    add_answer_text_args(q, from_generation=False)
    q.set_defaults(func=lambda args: run(args, load))


def run(args, load=load_from_args) -> int:
    # function-local: the method and the session import torch, not needed for --help
    from dataclasses import replace

    from core.errors import QuestionError

    check_outputs(args)  # fail fast, before the model loads
    check_token_options(args)
    if args.copy_tokens is not None:
        check_copy_words(args.copy_tokens)
    if (args.image is None) != (args.question is None):
        raise QuestionError("--image and --question go together (the activation level needs both)")
    if args.answer_text is not None and args.image is None:
        raise QuestionError("--answer-text needs --image and --question (it is read out on that input)")
    image = None
    if args.image is not None:
        from core.files.images import load_image

        image = load_image(args.image)
    request = QkOvRequest(
        head=args.head,
        image=image,
        image_path=args.image,
        question=args.question,
        copy_tokens=args.copy_tokens,
        raw_prompt=args.raw_prompt,
        top_k=args.top_k,
    )
    loaded = load(args)
    request.copy_ids(loaded.adapter)  # a bad head or copy word fails before the answer text is read
    request = replace(request, answer_text=answer_text_of(args, loaded))
    result = request.run(loaded)
    return finish(args, request, result, model=loaded)
