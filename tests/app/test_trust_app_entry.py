"""``vlm-readout-app``'s terminal (issue 27): what the entry point
(app/__main__.py) sets up before the window opens. The fresh-process cases
(``--help`` with a full or closed stdout, the loader's zero requests, a
screenshot run whose stderr holds nothing else) are in
tests/core/test_trust_stderr.py and tests/core/test_trust_network.py."""

from __future__ import annotations

import os

from PySide6.QtCore import QtMsgType

import app.__main__ as entry


def test_qt_warnings_are_dropped_and_critical_messages_are_one_error_line(capfd):
    """Qt's own lines ("This plugin does not support propagateSizeHints()" on
    the offscreen platform) used to reach the terminal as they were."""
    capfd.readouterr()
    entry._qt_message(QtMsgType.QtWarningMsg, None, "This plugin does not support propagateSizeHints()")
    entry._qt_message(QtMsgType.QtDebugMsg, None, "debug chatter")
    entry._qt_message(QtMsgType.QtInfoMsg, None, "info chatter")
    assert capfd.readouterr().err == ""
    entry._qt_message(QtMsgType.QtCriticalMsg, None, "could not connect to display\n:99")
    assert capfd.readouterr().err == "error: Qt: could not connect to display :99\n"


def test_help_is_exit_0_and_the_app_is_offline(capsys):
    assert entry.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: vlm-readout-app")
    assert all(os.environ[name] == "1" for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


def test_refused_command_line_is_one_error_line(capsys):
    assert entry.main(["--no-such-option"]) == 2
    err = capsys.readouterr().err
    assert err == "error: unrecognized arguments: --no-such-option\n"
