"""The progress bar of a long command: tqdm on stderr, off with ``--quiet``.
The engine's long functions take ``progress(done, total[, message])``
(docs/ARCHITECTURE.md, Conventions); :func:`progress_bar` gives one.

stderr holds only ``error:`` / ``warning:`` lines otherwise (core/terminal.py),
so the bar is drawn only where someone watches it: on a terminal (a log file
or a pipe would collect every redraw), from the first call on (a command
refused before its work starts shows nothing but its error line), and it is
wiped when the block fails (the error line stands alone)."""

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
    first_total, bar = total, None

    def progress(done: int, total: int | None = None, message: str = "") -> None:
        nonlocal bar
        if quiet:
            return
        if bar is None:
            from tqdm import tqdm  # function-local: tqdm is not needed to build the parser

            # disable=None: tqdm draws only when its file is a terminal
            bar = tqdm(total=first_total if total is None else total, desc=desc, file=sys.stderr, disable=None)
        if total is not None and bar.total != total:
            bar.reset(total=total)
        if messages and message:
            bar.set_description(message)
        bar.update(done - bar.n)

    try:
        yield progress
    except BaseException:
        if bar is not None:
            bar.leave = False  # wiped: the error line that follows stands alone
        raise
    finally:
        if bar is not None:
            bar.close()
