"""``vlm-readout qk-ov``: one head's QK and OV circuits (docs/METHODS.md §4.3),
the weight level (position-free QK form, OV map, singular values, copying
score) kept apart from the activation level (the scores the head realised at
the answer row of one input, with the position scheme).

    vlm-readout qk-ov --model M --head L1.H1 [--image I --question Q]
        [--answer-text T [--token-index K]] [--copy-tokens W,W,...] --json OUT [--session S]
"""

from __future__ import annotations

from core.arguments import positive_int
from core.cli.args import (
    add_answer_text_args,
    add_model_args,
    add_raw_prompt_arg,
    answer_text_of,
    check_token_options,
)
from core.cli.loading import load_from_args
from core.cli.outputs import write_and_record

# The copying score's token set at most (core.methods.qk_ov.COPYING_VOCAB_LIMIT, not imported:
# it loads torch): its matrix is tokens x tokens, its eigenvalues cubic in them.
MAX_COPY_TOKENS = 2048


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
    q.add_argument("--json", required=True, help="output file")
    q.add_argument("--session", help="also record the run into this session file (created if missing)")
    add_raw_prompt_arg(q)
    add_answer_text_args(q, from_generation=False)
    q.set_defaults(func=lambda args: run(args, load))


def check_copy_words(words: str) -> list[str]:
    """The comma-separated words of ``--copy-tokens``, before the model loads;
    QuestionError (one line starting with ``--copy-tokens``) for text that is
    no word list (:func:`core.answer_text.text_problem`), an empty word, or
    more words than the copying score may run over (its matrix is tokens x
    tokens: :data:`MAX_COPY_TOKENS`)."""
    from core.answer_text import shown_text, text_problem
    from core.errors import QuestionError

    problem = text_problem(words)
    if problem is not None:
        raise QuestionError(f"--copy-tokens {problem}")
    split = [w.strip() for w in words.split(",")]
    if "" in split:
        raise QuestionError(f"--copy-tokens {shown_text(words)}: word {split.index('') + 1} is empty")
    if len(split) > MAX_COPY_TOKENS:
        raise QuestionError(
            f"--copy-tokens: {len(split):,} words; the copying score runs over at most {MAX_COPY_TOKENS}"
        )
    return split


def copy_token_ids(adapter, words: str) -> list[int]:
    """The token ids of comma-separated ``words`` (every sub-token, each once, in
    order); QuestionError (one line starting with ``--copy-tokens``) for a word
    that holds markup (an image placeholder, a special token) or that the
    vocabulary lacks (the unknown token: the score would run over it in the
    word's place), or more than :data:`MAX_COPY_TOKENS` tokens in all."""
    from core.answer_text import shown_text, word_tokens
    from core.errors import QuestionError

    ids: list[int] = []
    for word in check_copy_words(words):
        pieces = [i for i, _ in word_tokens(adapter, word)]
        label = f"--copy-tokens word {shown_text(word)}"
        adapter.check_markup(word, pieces, what=label)
        adapter.check_known_words(word, pieces, what=label)
        ids += [i for i in pieces if i not in ids]
    if len(ids) > MAX_COPY_TOKENS:
        raise QuestionError(
            f"--copy-tokens: the words are {len(ids):,} tokens; the copying score runs over at most {MAX_COPY_TOKENS}"
        )
    return ids


def run(args, load=load_from_args) -> int:
    # function-local: the method and the session import torch, not needed for --help
    from core.atomic import check_output_file
    from core.errors import QuestionError

    check_output_file(args.json)  # fail fast, before the model loads
    check_token_options(args)
    if args.copy_tokens is not None:
        check_copy_words(args.copy_tokens)
    if (args.image is None) != (args.question is None):
        raise QuestionError("--image and --question go together (the activation level needs both)")
    if args.answer_text is not None and args.image is None:
        raise QuestionError("--answer-text needs --image and --question (it is read out on that input)")
    image = None
    if args.image is not None:
        from core.images import load_image

        image = load_image(args.image)
    if args.session:
        from core.session import check_session_file

        check_session_file(args.session)
    loaded = load(args)
    from core.methods.qk_ov import head_of, qk_ov

    block, _, _ = head_of(loaded.adapter, args.head)  # a bad head fails before anything runs
    if args.copy_tokens is not None and loaded.adapter.blocks[block][1] != "self":
        raise QuestionError(
            f"--copy-tokens: {args.head} is a cross-attention head (its values are visual tokens, not token "
            "embeddings): it has no copying score"
        )
    result = qk_ov(
        loaded,
        args.head,
        image,
        args.question,
        copy_tokens=copy_token_ids(loaded.adapter, args.copy_tokens) if args.copy_tokens is not None else None,
        raw_prompt=args.raw_prompt,
        answer_text=answer_text_of(args, loaded),
        top_k=args.top_k,
    )
    on_image = {} if image is None else {"image": image, "image_path": args.image}
    write_and_record(args.json, result.to_dict(), args.session, result, model=loaded, **on_image)
    print(result.summary())
    return 0
