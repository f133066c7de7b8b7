"""Entry point frozen by PyInstaller: points the engine at the bundled
resources, then starts the app."""

import os
import sys
from pathlib import Path

from core.shell import offline  # standard library only

# Before torch and transformers are imported below: the app never downloads, as
# app.__main__.main and `vlm-readout` without --allow-download (core/shell/offline.py).
offline.go_offline()

if getattr(sys, "frozen", False):
    os.environ.setdefault("VLM_READOUT_RESOURCES", str(Path(sys._MEIPASS) / "resources"))

if getattr(sys, "frozen", False):
    # Load torchvision's compiled ops eagerly and say why when they are missing: transformers
    # otherwise hides the failure behind "Could not import module 'LlamaConfig'".
    try:
        import torch  # noqa: F401
        from torchvision import extension

        extension._assert_has_ops()
    except Exception as e:  # a broken bundle: report it in one line, the app still opens
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"warning: torchvision's compiled ops did not load in this bundle ({reason})", file=sys.stderr)

from app.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
