"""The options every model command shares: which model, where, and what it
may do at load (:func:`add_model_args`), and ``--raw-prompt``
(:func:`add_raw_prompt_arg`). Imports nothing heavy: the parser is built
before anything loads. The generic pieces (Parser, the number validators) are
in :mod:`core.arguments`."""

from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--device``, ``--allow-pickle``, ``--trust-remote-code``,
    ``--allow-download``: what :func:`core.cli.loading.load_from_args` reads."""
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
