"""VLM Readout desktop app (PySide6 + pyqtgraph).

Talks to the engine only through :mod:`core`'s public functions; long work
runs in :mod:`app.workers`, off the GUI thread.
"""

import sys


def _pin_singletons() -> None:
    """Give ``None``, ``True`` and ``False`` reference counts no session can exhaust.

    Under Python 3.11, PySide6 6.12 releases one reference to ``None`` too
    many for several graphics items pyqtgraph builds (measured: a ViewBox
    -15, an AxisItem -17, a LabelItem -10 per item; about -3,000 per main
    window), and likewise to ``True`` / ``False`` on some paths (the app
    test suite, about forty windows, drove ``True``'s count to zero: the
    interpreter aborted at exit with "bool_dealloc"). ``None`` and the bools
    are immortal only from Python 3.12, so enough windows make the
    interpreter abort at exit ("none_dealloc" / "bool_dealloc"). This does
    what 3.12 does: ``ob_refcnt`` is the first field of every CPython object.
    """
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return
    import ctypes

    for singleton in (None, True, False):
        ctypes.c_ssize_t.from_address(id(singleton)).value += 1 << 40


_pin_singletons()
