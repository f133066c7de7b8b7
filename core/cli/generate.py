"""``vlm-readout generate``: the model's greedy answer to one question about
one image, token by token (the key / value cache; :mod:`core.generate`).

    vlm-readout generate --model M --image I --question Q [--max-new-tokens N]
        [--stop S ...] [--top-k K] [--raw-prompt] [--no-cache] [--json OUT]

Prints one line per token (index, token, probability, the top alternatives),
then the answer text and why it stopped.
"""

from __future__ import annotations

from core.cli.args import add_input_args, add_model_args, add_output_args, add_raw_prompt_arg, check_outputs
from core.cli.loading import load_from_args
from core.cli.outputs import finish
from core.requests.generate import GenerateRequest
from core.shell.arguments import positive_int
from core.shell.terminal import progress_bar


def add_command(subparsers, load=load_from_args) -> None:
    g = subparsers.add_parser("generate", help="greedy answer, token by token, with each token's probability")
    add_model_args(g)
    add_input_args(g)
    g.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help="most tokens to generate (default: the model folder's generation config, else 32)",
    )
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop once the answer contains TEXT (repeatable; the answer text is cut after it)",
    )
    g.add_argument("--top-k", type=positive_int, default=5, help="alternatives recorded per token")
    g.add_argument(
        "--no-cache", action="store_true", help="re-run the whole sequence at every step (the reference; slower)"
    )
    add_output_args(
        g,
        json_help="also write the generation as JSON here",
        json_required=False,
        session_help="also record the run into this session file (created if missing)",
    )
    add_raw_prompt_arg(g)
    g.set_defaults(func=lambda args: run(args, load))


def token_line(index: int, token: str, prob: float, top: list) -> str:
    """``  3  'circle'  p=0.8123  top: 'circle' 0.812 | 'square' 0.101``."""
    alternatives = " | ".join(f"{t!r} {p:.3f}" for t, p in top)
    return f"{index:>3}  {token!r}  p={prob:.4f}  top: {alternatives}"


def check_stop_strings(stops: list[str]) -> None:
    """QuestionError (one line starting with ``--stop``) for a stop string that is
    empty (every answer holds it: generation would stop before its first token)
    or not UTF-8 text, before the model loads. Whitespace is a stop string
    (``--stop $'\\n'`` ends the answer at its first line)."""
    from core.answer_text import text_problem
    from core.errors import QuestionError

    for text in stops:
        problem = text_problem(text, blank_ok=True)
        if problem is not None:
            raise QuestionError(f"--stop {problem} (a stop string is text the answer stops after)")


def run(args, load=load_from_args) -> int:
    # function-local: torch loads when the command runs, not for --help
    from core.files.images import load_image

    check_outputs(args)  # fail fast, before the model loads
    check_stop_strings(args.stop)
    image = load_image(args.image)
    request = GenerateRequest(
        image=image,
        image_path=args.image,
        question=args.question,
        max_new_tokens=args.max_new_tokens,
        stop_strings=tuple(args.stop),
        top_k=args.top_k,
        raw_prompt=args.raw_prompt,
        use_cache=not args.no_cache,
    )
    loaded = load(args)
    with progress_bar("generating", quiet=args.quiet) as progress:
        result = request.run(loaded, progress)
    for i, (token, prob, top) in enumerate(zip(result.tokens, result.probs, result.top)):
        print(token_line(i, token, prob, top))
    if result.stop_token is not None:
        s = result.stop_token
        print(f"end  {s['token']!r}  p={s['prob']:.4f}")
    print(f"answer: {result.text}")
    print(f"stop: {result.stop_reason} ({len(result.token_ids)} tokens, {'KV cache' if result.cache else 'no cache'})")
    return finish(args, request, result, model=loaded, lines=())  # the JSON's input names the image too
