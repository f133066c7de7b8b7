"""The progress bar of a long command: tqdm on stderr, off with ``--quiet``.
The engine's long functions take ``progress(done, total[, message])``
(docs/ARCHITECTURE.md, Conventions); :func:`progress_bar` gives one."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(
    desc: str, *, quiet: bool, total: int | None = None, messages: bool = False
) -> Iterator[Callable[..., None]]:
    """Within the block, ``progress(done, total, message="")`` moves a bar
    (closed on exit). A new ``total`` restarts it; with ``messages`` each
    message becomes the bar's description."""
    from tqdm import tqdm  # function-local: tqdm is not needed to build the parser

    bar = tqdm(total=total, desc=desc, file=sys.stderr, disable=quiet)

    def progress(done: int, total: int | None = None, message: str = "") -> None:
        if total is not None and bar.total != total:
            bar.reset(total=total)
        if messages and message:
            bar.set_description(message)
        bar.update(done - bar.n)

    try:
        yield progress
    finally:
        bar.close()
