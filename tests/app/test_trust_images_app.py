"""The window given a hostile image: the error shows in the window, the
previous image stays, the app keeps running (at start-up too)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtGui import QImage

from tests.fuzz.hostile_images import dds_bytes, png_bytes, tiff_bytes

REPO = Path(__file__).resolve().parents[2]
HOSTILE = {
    "texture.dds": dds_bytes(),  # Pillow raises NotImplementedError opening it
    "wide.png": png_bytes(1, 200_000),  # would resize to 128 x 25,600,000
    "tall.tif": tiff_bytes(16, 2_686_988, samples=1, bits=32, compression=1, rows_per_strip=16, data=b"\x40" * 1024),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_image_shows_error_and_keeps_previous(qtbot, window, tmp_path, name):
    path = tmp_path / name
    path.write_bytes(HOSTILE[name])
    shown_before, name_before = window.image, window.image_name
    assert shown_before is not None
    assert not window.set_image(path)
    message = window.inputs.error_label.text()
    assert message.startswith(f"{path}: ") and "\n" not in message
    assert window.image is shown_before and window.image_name == name_before
    assert not window.is_busy()
    assert window.set_image(png_bytes(8, 6), name="fine") and window.inputs.error_label.text() == ""  # still works


def test_hostile_bytes_pasted_show_error(window):
    shown_before = window.image
    assert not window.set_image(dds_bytes(), name="pasted image")
    assert window.inputs.error_label.text().startswith("image bytes: looks like DDS")
    assert window.image is shown_before


def test_app_starts_with_a_dds_image(tmp_path):
    """Filed: a DDS given at start-up crashed the app before any window showed.
    In a fresh process, as at start-up (and because app.main's quit leaves this
    process's QApplication unable to run the later tests' event loops)."""
    dds = tmp_path / "texture.dds"
    dds.write_bytes(dds_bytes())
    shot = tmp_path / "app.png"
    argv = ["--model", "shapes-coca", "--image", str(dds), "--screenshot", str(shot)]
    argv += ["--session", str(tmp_path / "s.vlmr")]
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "app", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert not QImage(str(shot)).isNull()
