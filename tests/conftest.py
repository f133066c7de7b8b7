import os

# Tests never touch the network, and Qt always runs offscreen.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import torch  # noqa: E402

# Tiny models are overhead-bound: one thread is faster than two that contend
# (and CI shares the machine's two cores with nothing else to gain).
torch.set_num_threads(1)
