import os

import pytest

# Tests never touch the network, and Qt always runs offscreen.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import torch  # noqa: E402

# Tiny models are overhead-bound: one thread is faster than two that contend
# (and CI shares the machine's two cores with nothing else to gain).
torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``make test``'s ``--dist loadfile``: the longest file left goes to the worker that asks
    (tests/scheduling.py), so the two workers end together."""
    if config.getoption("dist") != "loadfile":
        return None
    from tests.scheduling import LongestFileFirst

    return LongestFileFirst(config, log)
