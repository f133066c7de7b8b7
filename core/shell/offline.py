"""No network unless asked: the hub libraries' offline switches.

huggingface_hub (which transformers and open_clip fetch through) reads
``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` once, at import, into
``huggingface_hub.constants.HF_HUB_OFFLINE``; while that is true it refuses
every request it would make, whatever the caller asked. So the entry points
(``vlm-readout``, ``vlm-readout-app``, the bundle's launcher) call
:func:`go_offline` before anything imports those libraries, and only
``--allow-download`` gives the user's own settings back
(:func:`allow_network`). :func:`offline` does the same for one block, so that
``load_model(allow_download=False)`` fetches nothing in any process.

Imports nothing but the standard library: it runs before the command line is
parsed."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# What the hub libraries read: huggingface_hub (HF_HUB_OFFLINE, or
# TRANSFORMERS_OFFLINE), transformers (through huggingface_hub) and datasets.
SWITCHES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of an env switch

_users_switches: dict[str, str | None] | None = None  # the environment's values before go_offline changed them


def _is_true(value: str | None) -> bool:
    return value is not None and value.upper() in _TRUE


def _switches_say_offline(values) -> bool:
    return _is_true(values.get("HF_HUB_OFFLINE") or values.get("TRANSFORMERS_OFFLINE"))


def _set_hub_constant(value: bool) -> None:
    """huggingface_hub, once imported, reads only its constant (per request), never the environment again."""
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = value


def go_offline() -> None:
    """Make the whole process offline: the switches set in the environment
    (read by the libraries imported from now on, and by child processes) and in
    huggingface_hub if it is already imported."""
    global _users_switches
    if _users_switches is None:
        _users_switches = {name: os.environ.get(name) for name in SWITCHES}
    for name in SWITCHES:
        os.environ[name] = "1"
    _set_hub_constant(True)


def allow_network() -> None:
    """Undo :func:`go_offline` (``--allow-download``): the switches as the user
    set them, so a user's own ``HF_HUB_OFFLINE=1`` stays respected."""
    if _users_switches is None:
        return
    for name, value in _users_switches.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _set_hub_constant(_switches_say_offline(_users_switches))


def is_offline() -> bool:
    """Whether the hub libraries refuse to fetch now."""
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        return bool(constants.HF_HUB_OFFLINE)
    return _switches_say_offline(os.environ)


def users_offline_switch() -> str | None:
    """The offline switch the user set in the environment (before
    :func:`go_offline`), to name it when it is what refuses a download."""
    values = _users_switches if _users_switches is not None else {name: os.environ.get(name) for name in SWITCHES}
    return next((name for name in SWITCHES[:2] if _is_true(values.get(name))), None)


@contextmanager
def offline(when: bool = True) -> Iterator[None]:
    """Offline for the block (when ``when``), then as before: a load without
    ``allow_download`` fetches nothing even in a process that is not offline.
    Process-wide while it lasts (the libraries have no per-call switch)."""
    if not when:
        yield
        return
    saved = {name: os.environ.get(name) for name in SWITCHES}
    constants = sys.modules.get("huggingface_hub.constants")
    saved_constant = constants.HF_HUB_OFFLINE if constants is not None else None
    for name in SWITCHES:
        os.environ[name] = "1"
    _set_hub_constant(True)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        # imported inside the block, it read "1": give it what the environment says now
        _set_hub_constant(saved_constant if saved_constant is not None else _switches_say_offline(saved))
