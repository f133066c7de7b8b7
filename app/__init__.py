"""VLM Readout desktop app (PySide6 + pyqtgraph).

Talks to the engine only through :mod:`core`'s public functions; long work
runs in :mod:`app.workers`, off the GUI thread.
"""
