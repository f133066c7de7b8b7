"""Fixtures for the app tests (pytest-qt, offscreen)."""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before any Qt import
# The app remembers recent models in QSettings: keep the tests' out of the user's config
# (removed when the run ends: a folder per run used to pile up in /tmp).
os.environ["XDG_CONFIG_HOME"] = __import__("tempfile").mkdtemp(prefix="vlm-readout-test-config-")
__import__("atexit").register(__import__("shutil").rmtree, os.environ["XDG_CONFIG_HOME"], ignore_errors=True)

import pytest  # noqa: E402
from PySide6.QtCore import QThreadPool  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_settings():
    """Each test starts with no remembered models (QSettings): what one test loaded does not
    change the dtype or device another test's picker opens with."""
    from PySide6.QtCore import QSettings

    QSettings("VLM Readout", "vlm-readout").clear()
    yield


@pytest.fixture(scope="session")
def model_cache() -> dict:
    """``{ModelChoice: LoadedModel}`` shared by every window, so each model loads once per run."""
    return {}


@pytest.fixture
def window(qtbot, model_cache, tmp_path):
    """A shown MainWindow (its session in ``tmp_path``); on teardown it is
    closed and must leave no worker thread behind."""
    from app.main_window import MainWindow

    win = MainWindow(model_cache=model_cache, session_path=tmp_path / "session.vlmr")
    win.show()
    qtbot.waitExposed(win)
    yield win
    win.close()
    assert win.runner.workers.running() == [], "worker threads still alive after close"
    assert QThreadPool.globalInstance().activeThreadCount() == 0


@pytest.fixture
def canvas(qtbot):
    """An ImageCanvas on its own, shown at 700 x 640 (torn down with the test)."""
    from app.canvas import ImageCanvas

    c = ImageCanvas()
    qtbot.addWidget(c)
    c.resize(700, 640)
    c.show()
    qtbot.waitExposed(c)
    return c
