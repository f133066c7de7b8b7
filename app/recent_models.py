"""The model specs the picker remembers between runs (``QSettings``): the last
few that loaded, built-in names left out (the picker always lists those)."""

from __future__ import annotations

from PySide6.QtCore import QSettings

BUILTIN_MODELS = ("shapes-llava", "shapes-coca")
KEEP = 8


def _settings() -> QSettings:
    return QSettings("VLM Readout", "vlm-readout")


def recent_models() -> list[str]:
    """The remembered specs, most recent first."""
    value = _settings().value("recent_models", [])
    return [str(v) for v in (value if isinstance(value, list) else [value]) if v]


def remember_model(spec: str) -> bool:
    """Put ``spec`` first among the remembered specs; False for a built-in name (not kept)."""
    if spec in BUILTIN_MODELS:
        return False
    recent = [spec] + [s for s in recent_models() if s != spec]
    _settings().setValue("recent_models", recent[:KEEP])
    return True
