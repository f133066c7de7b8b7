"""VLM Readout desktop app (PySide6 + pyqtgraph).

Talks to the engine only through :mod:`core`'s public functions; long work
runs in :mod:`app.workers`, off the GUI thread.
"""

import sys


def _pin_none() -> None:
    """Give ``None`` a reference count no session can exhaust.

    Under Python 3.11, PySide6 6.12 releases one reference to ``None`` too
    many for several graphics items pyqtgraph builds (measured: a ViewBox
    -15, an AxisItem -17, a LabelItem -10 per item; about -3,000 per main
    window). ``None`` is immortal only from Python 3.12, so enough windows
    (the test suite builds about thirty) drive its count to zero and the
    interpreter aborts at exit ("none_dealloc"). This does what 3.12 does:
    ``ob_refcnt`` is the first field of every CPython object.
    """
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return
    import ctypes

    ctypes.c_ssize_t.from_address(id(None)).value += 1 << 40


_pin_none()
