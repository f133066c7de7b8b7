"""Command-line arguments in the house style: :class:`Parser` (a refused
command line is one line ``error: ...``, exit status 2) and the ``type=``
validators for numbers (:class:`Number`: :data:`positive_int`,
:data:`non_negative_int`, :data:`positive_float`, :data:`probability`, ...),
so ``--top-k 0`` is refused before anything loads; :class:`LazyChoices` and
:class:`LazyHelp` for choices and help read from a module only when needed.

Below every command line of the project: ``vlm-readout`` (:mod:`core.cli`),
the zoo's scripts (``python -m core.zoo.dataset``) and the app's launcher.
It imports nothing but the standard library.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
from collections.abc import Callable

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
            too_small = self.lo is not None and math.isfinite(value) and value <= self.lo
            # the side the value is out on: "at most 4096", "a positive integer" (not "an integer in [1, 4096]")
            below = Number(self.kind, self.lo, None, lo_open=self.lo_open).describe()
            domain = f"at most {self.hi}" if too_large else below if too_small else self.describe()
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
# Inputs in one forward or one training step: every --batch-size. A batch of scenes is drawn whole
# before it runs, so the bound is on memory, not only on time; the memory checks refuse less.
MAX_BATCH = 4096
batch_size = Number(int, 1, MAX_BATCH)
# Inputs a command draws from a generator or reads in all (--n, --eval-n): bounded so that no
# typo runs for days or holds millions of scenes.
MAX_INPUTS = 1_000_000
input_count = Number(int, 1, MAX_INPUTS)
# torch CPU threads: more than this machine's cores only slows it down, and a huge count makes
# the OpenMP runtime allocate per-thread state until it fails.
thread_count = Number(int, 1, getattr(os, "process_cpu_count", os.cpu_count)() or 1)


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


class LazyHelp:
    """An argparse ``help=`` computed only when the help is shown, for a help
    text that names what a heavy module registers (``--methods``: the audit's
    read-outs). argparse formats a help as ``help % params``, so this object
    answers ``%`` with ``make() % params``."""

    def __init__(self, make: Callable[[], str]):
        self.make = make

    def __mod__(self, params: dict) -> str:
        return self.make() % params

    def strip(self) -> str:  # argparse asks whether the help is blank
        return self.make().strip()

    def __str__(self) -> str:
        return self.make()


class Parser(argparse.ArgumentParser):
    """argparse in the house style: a refused command line is one line
    ``error: ...`` on stderr and exit status 2 (no usage block; ``-h`` shows it)."""

    def error(self, message: str):
        self.exit(2, f"error: {' '.join(str(message).split())}\n")
