"""``python -m core.cli``: the ``vlm-readout`` command line."""

import sys

from core.cli import main

sys.exit(main())
