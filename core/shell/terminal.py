"""What the entry points (``vlm-readout``: :func:`core.cli.main`;
``vlm-readout-app``: :func:`app.__main__.main`) leave on the terminal.

stderr holds only ``error: ...`` and ``warning: ...`` lines (and, on a
terminal, the progress bar): every Python warning and every log record of a
library (transformers and huggingface_hub print theirs themselves, as
``[transformers] ...``) becomes one ``warning:`` line
(:func:`one_line_warnings`). A standard stream that is closed is reserved
with /dev/null, so no file the tool opens takes its number (a C library
writing to fd 2 would write into it), and writing to a closed stdout fails
as writing to a full one does (:func:`guard_standard_streams`); such a failure
is one ``error: cannot write to standard output (...)`` line
(:func:`watched_stdout`, :func:`refuse_stdout`).

The progress bar of a long command (:func:`progress_bar`: tqdm, off with
``--quiet``) is drawn only where someone watches it: on a terminal (a log file
or a pipe would collect every redraw), from the first call on (a command
refused before its work starts shows nothing but its error line), and it is
wiped when the block fails (the error line stands alone). The engine's long
functions take ``progress(done, total[, message])`` (docs/ARCHITECTURE.md,
Conventions); :func:`progress_bar` gives one.

Imports nothing but the standard library (tqdm when a bar is first drawn): it
runs before the command line is parsed."""

from __future__ import annotations

import errno
import io
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# Libraries that give their root logger a stderr handler of their own (and stop it propagating).
LIBRARY_LOGGERS = ("transformers", "huggingface_hub")

# transformers' tokenizer, on a text longer than the tokenizer's declared maximum.
_TOO_LONG = re.compile(
    r"Token indices sequence length is longer than the specified maximum sequence length for this model "
    r"\((\d+) > (\d+)\)"
)


def say(line: str) -> None:
    """``line`` on stderr; a stderr that cannot be written loses it (there is nowhere else to say it)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def warning_text(text) -> str:
    """A library's warning as one line; the tokenizer's "Token indices
    sequence length..." named by the question's length and the limit."""
    text = " ".join(str(text).split())
    too_long = _TOO_LONG.search(text)
    if too_long:
        length, limit = too_long.groups()
        return (
            f"the question's prompt is {length} tokens, longer than the {limit} the tokenizer declares as its maximum "
            "(model_max_length): the model may not have been trained on prompts this long"
        )
    return text


# ---------------------------------------------------------------- warnings and library logs


def _format_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {warning_text(message)}\n"


class _WarningLines(logging.Handler):
    """A log record of warning level or above as one ``warning:`` line."""

    def __init__(self):
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a library's bad format arguments: its text as given
            text = str(record.msg)
        line = f"warning: {warning_text(text)}"
        if _held is not None and _TOO_LONG.search(text):
            _held.append(line)
        else:
            say(line)


_held: list[str] | None = None  # inside question_length_warnings_held: the lines it holds


@contextmanager
def question_length_warnings_held() -> Iterator[None]:
    """Within the block (a command's run) the tokenizer's question-length
    warning waits for its end: said after a run that finished, dropped when
    the run failed (a question too long for the model is refused with the
    model's own count: one line, not two)."""
    global _held
    _held = held = []
    try:
        yield
    finally:
        _held = None
    for line in held:
        say(line)


class _PropagatingLogger(logging.Logger):
    """A library's root logger whose own stderr handler is kept off (its
    records go up to the root's one-line handler); other handlers stay."""

    def addHandler(self, hdlr: logging.Handler) -> None:
        if type(hdlr) is not logging.StreamHandler:
            super().addHandler(hdlr)

    @property
    def propagate(self) -> bool:
        return True

    @propagate.setter
    def propagate(self, value: bool) -> None:  # the library turns it off; it stays on
        pass


def one_line_warnings() -> None:
    """From now on every Python warning and every library log record of
    warning level or above is one ``warning:`` line on stderr. Works whether
    or not the libraries are imported yet (a library imported later finds its
    root logger already made)."""
    warnings.formatwarning = _format_warning
    root = logging.getLogger()
    if not any(isinstance(h, _WarningLines) for h in root.handlers):
        root.addHandler(_WarningLines())
    for name in LIBRARY_LOGGERS:
        existing = logging.Logger.manager.loggerDict.get(name)
        if isinstance(existing, logging.Logger):  # imported already: take its stderr handler off
            for handler in [h for h in existing.handlers if type(h) is logging.StreamHandler]:
                existing.removeHandler(handler)
            existing.propagate = True
            continue
        previous = logging.getLoggerClass()
        logging.setLoggerClass(_PropagatingLogger)
        try:
            logging.getLogger(name)
        finally:
            logging.setLoggerClass(previous)


# ---------------------------------------------------------------- standard streams


class _ClosedStdout(io.TextIOBase):
    """sys.stdout when the process started with it closed: a write fails as
    on a closed descriptor (print would otherwise drop it silently)."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
        return False
    except OSError:
        return True


def _reserve(fd: int) -> None:
    """Put /dev/null on the closed descriptor ``fd``."""
    try:
        devnull = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself when the ones below are open
    except OSError:
        return
    if devnull != fd:
        try:
            os.dup2(devnull, fd)
        except OSError:
            pass
        finally:
            os.close(devnull)


def guard_standard_streams() -> None:
    """Reserve closed descriptors 0-2 with /dev/null; a closed stdout then
    refuses writes (EBADF), a closed stderr swallows them."""
    for fd in (0, 1, 2):
        if _closed(fd):
            _reserve(fd)
            if fd == 1:
                sys.stdout = _ClosedStdout()
            elif fd == 2:
                sys.stderr = open(os.devnull, "w")  # noqa: SIM115  (the process's stderr, open until exit)
    if sys.stdout is None:  # no descriptor behind it
        sys.stdout = _ClosedStdout()


def setup() -> None:
    """What an entry point does first: :func:`guard_standard_streams`, :func:`one_line_warnings`."""
    guard_standard_streams()
    one_line_warnings()


class _WatchedStdout:
    """sys.stdout during a run, remembering a failed write: print's OSError
    does not say which file failed, and argparse swallows the failure of its
    help's write (then exits 0). Once failed, every flush raises it again."""

    def __init__(self, stream):
        self._stream = stream
        self.failure: OSError | None = None

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self.failure = e
            raise

    def flush(self) -> None:
        if self.failure is not None:
            raise self.failure
        try:
            self._stream.flush()
        except OSError as e:
            self.failure = e
            raise

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextmanager
def watched_stdout() -> Iterator[_WatchedStdout]:
    """Within the block, sys.stdout remembers its failure (``.failure``); restored after."""
    real = sys.stdout
    watch = _WatchedStdout(real)
    sys.stdout = watch
    try:
        yield watch
    finally:
        if sys.stdout is watch:
            sys.stdout = real


def parse_exit_status(e: SystemExit) -> int:
    """The status of argparse's exit (``-h``: 0; a refused command line: 2, its
    one line printed), once the help's text is flushed: a stdout that could not
    take it raises its OSError here, not exit 0."""
    sys.stdout.flush()
    return e.code if isinstance(e.code, int) else 0 if e.code is None else 2


def stdout_gone() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush at exit
    raises nothing (no "Exception ignored ... BrokenPipeError") after a write to it failed."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # io.UnsupportedOperation is both: a stream with no descriptor
        pass
    finally:
        os.close(devnull)


def refuse_stdout(failure: OSError) -> int:
    """The one line for a stdout that cannot be written (a full disk behind
    ``> FILE``, a closed stdout, a reader gone: ``| head``); the exit status."""
    stdout_gone()
    reason = os.strerror(failure.errno) if failure.errno else str(failure)
    say(f"error: cannot write to standard output ({reason})")
    return 2


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
