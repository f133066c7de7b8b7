"""Build the onedir bundle: ``make installer`` -> dist/vlm-readout/."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    sys.exit(
        subprocess.call(
            [
                sys.executable,
                "-m",
                "PyInstaller",
                "--noconfirm",
                "--distpath",
                str(ROOT / "dist"),
                "--workpath",
                str(ROOT / "build"),
                str(ROOT / "installer" / "vlm_readout.spec"),
            ],
            cwd=ROOT,
        )
    )
