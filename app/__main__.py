"""``vlm-readout-app``: open the main window and read out the first question
(answer, attention, DLA, lens), recording it in a session."""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from core.shell.arguments import Parser  # a refused command line is one line "error: ..." (exit 2), as on the CLI

    p = Parser(prog="vlm-readout-app", description=__doc__)
    p.add_argument(
        "--model",
        default="shapes-llava",
        help="built-in name, model folder, cached repo id, or open_clip name:checkpoint",
    )
    p.add_argument("--image", help="image file (default: the first bundled sample)")
    p.add_argument("--question", help="question about the image (default: the first bundled sample's)")
    p.add_argument(
        "--session",
        help="session file to record into, created if missing (default: a new one in ~/.local/share/vlm-readout); "
        "one that cannot be used is named in the window, which records into a new default one instead",
    )
    p.add_argument(
        "--tab", default="Answer", help="the tab shown first: Answer, Attention, DLA, Lens, Counterfactual or Audit"
    )
    p.add_argument(
        "--screenshot", metavar="PNG", help="save the window to PNG once the first read-out (or error) shows, then quit"
    )
    return p.parse_args(argv)


# What Qt's xcb platform plugin (Linux, X11) loads from the system; PySide6 ships the rest.
# library -> its Debian/Ubuntu package
XCB_LIBRARIES = {
    "xcb-cursor": "libxcb-cursor0",
    "xcb-icccm": "libxcb-icccm4",
    "xcb-keysyms": "libxcb-keysyms1",
    "xcb-image": "libxcb-image0",
    "xcb-render-util": "libxcb-render-util0",
    "xkbcommon-x11": "libxkbcommon-x11-0",
}


def missing_display_libraries() -> list[str]:
    """System libraries Qt needs to open a window on X11 that are not installed
    (empty elsewhere, or when another platform plugin was chosen)."""
    import ctypes.util
    import os

    if not sys.platform.startswith("linux") or os.environ.get("QT_QPA_PLATFORM", "xcb") != "xcb":
        return []
    if not os.environ.get("DISPLAY") and os.environ.get("WAYLAND_DISPLAY"):
        return []
    return [name for name in XCB_LIBRARIES if ctypes.util.find_library(name) is None]


def _qt_message(kind, context, message: str) -> None:
    """Qt's own messages on the terminal: its debug, info and warning lines are
    diagnostics for Qt's developers (the offscreen platform alone prints "This
    plugin does not support propagateSizeHints()") and are dropped; a critical
    or fatal one (no display, no platform plugin) is one ``error:`` line."""
    from PySide6.QtCore import QtMsgType

    from core.shell import terminal

    if kind in (QtMsgType.QtCriticalMsg, QtMsgType.QtFatalMsg):
        terminal.say(f"error: Qt: {' '.join(str(message).split())}")


# How long closing the window waits for a cancelled job (most stop at once) before the process ends
# without it (exit_now_if_jobs_were_let_go).
CLOSE_GRACE_MS = 1500


def main(argv: list[str] | None = None) -> int:
    from core.shell import offline, terminal  # standard library only

    # Before anything is imported: the app never downloads (it has no --allow-download), and its
    # terminal holds only `error:` / `warning:` lines, as the command line's (core.cli.main).
    offline.go_offline()
    terminal.setup()
    with terminal.watched_stdout() as stdout:
        try:
            args = parse_args(argv)
        except SystemExit as e:  # -h, or a refused command line (its one line is printed)
            try:
                return terminal.parse_exit_status(e)
            except OSError:  # --help with a closed or full stdout
                return terminal.refuse_stdout(stdout.failure)
    missing = missing_display_libraries()
    if missing:
        packages = " ".join(XCB_LIBRARIES[name] for name in missing)
        terminal.say(
            f"error: Qt needs system libraries to open a window on X11 that are missing: {', '.join(missing)} "
            f"(Debian/Ubuntu: apt-get install {packages}; or run with QT_QPA_PLATFORM=offscreen)"
        )
        return 2
    from PySide6.QtCore import qInstallMessageHandler
    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow

    qInstallMessageHandler(_qt_message)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    window = MainWindow(model_spec=args.model, session_path=args.session)
    window.close_wait_ms = CLOSE_GRACE_MS  # the process ends with the window: a job mid-forward is not waited for
    if window.session_problem:  # shown in the window too; said here for whoever started it from a terminal
        print(f"warning: {window.session_problem}", file=sys.stderr)
    titles = [window.tabs.tabText(i).lower() for i in range(window.tabs.count())]
    if args.tab.lower() in titles:
        window.tabs.setCurrentIndex(titles.index(args.tab.lower()))
    image_ok = args.image is None or window.set_image(args.image)
    if args.question is not None:
        window.set_question(args.question)
    window.show()

    started = image_ok and window.actions.run_readout()
    if args.screenshot:
        return exit_now_if_jobs_were_let_go(_run_until_screenshot(app, window, args.screenshot, started))
    status = app.exec()
    return exit_now_if_jobs_were_let_go(status)


def _run_until_screenshot(app, window, path: str, started: bool) -> int:
    """Run the window until its read-out (if ``started``) is shown, save it to
    ``path`` and close it. A local event loop, not the application's: Qt 6's
    quit() closes every window of the process, and once the application has
    quit, every later event loop of the thread returns at once (a test's, a
    host's), so the application is left to whoever owns it."""
    from PySide6.QtCore import QEventLoop, QTimer

    loop = QEventLoop()

    def screenshot_and_close() -> None:
        if not window.grab().save(path):
            print(f"error: cannot write {path}", file=sys.stderr)
        window.close()
        loop.exit(0)

    if started:
        window.idle.connect(lambda: QTimer.singleShot(100, screenshot_and_close))
    else:
        QTimer.singleShot(100, screenshot_and_close)
    quit_on_close = app.quitOnLastWindowClosed()
    app.setQuitOnLastWindowClosed(False)  # closing the window ends this loop, not the application
    try:
        return loop.exec()
    finally:
        app.setQuitOnLastWindowClosed(quit_on_close)


def exit_now_if_jobs_were_let_go(status: int) -> int:
    """``status``; but when closing the window let a job go (cancelled in the middle of a forward
    it cannot leave, see app.workers), the process ends now rather than when that forward does:
    the session was closed with the window, and the job's result goes nowhere."""
    import contextlib
    import os

    from app.workers import abandoned_workers

    if abandoned_workers():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, or none
                stream.flush()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
