"""Entry point frozen by PyInstaller: points the engine at the bundled
resources, then starts the app."""

import os
import sys
from pathlib import Path

if getattr(sys, "frozen", False):
    os.environ.setdefault("VLM_READOUT_RESOURCES", str(Path(sys._MEIPASS) / "resources"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

from app.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
