"""The models the picker remembers between runs (``QSettings``): the last few
that loaded, each with the dtype and device it was loaded in
(:class:`app.components.ModelChoice`), most recent first. The built-in names
are remembered too (their dtype and device), though the picker always lists them.

Stored under ``recent_model_choices`` (one JSON line each); the bare specs an
older version kept under ``recent_models`` are read when that is missing, as
choices of the default dtype and device."""

from __future__ import annotations

from PySide6.QtCore import QSettings

from app.components.model_choice import ModelChoice

BUILTIN_MODELS = ("shapes-llava", "shapes-coca")
KEEP = 10  # the built-in names among them
CHOICES_KEY = "recent_model_choices"
OLD_SPECS_KEY = "recent_models"  # bare specs (before the dtype and device were remembered)


def _settings() -> QSettings:
    return QSettings("VLM Readout", "vlm-readout")


def _stored(settings: QSettings, key: str) -> list:
    value = settings.value(key, [])
    return value if isinstance(value, list) else [value]


def recent_choices() -> list[ModelChoice]:
    """The remembered models, most recent first (one per spec)."""
    settings = _settings()
    entries = _stored(settings, CHOICES_KEY) if settings.contains(CHOICES_KEY) else _stored(settings, OLD_SPECS_KEY)
    choices, seen = [], set()
    for entry in entries:
        choice = ModelChoice.from_stored(entry)
        if choice is not None and choice.spec not in seen:
            seen.add(choice.spec)
            choices.append(choice)
    return choices


def recent_models() -> list[str]:
    """The remembered specs, most recent first."""
    return [choice.spec for choice in recent_choices()]


def remembered_choice(spec: str) -> ModelChoice | None:
    """The dtype and device ``spec`` was last loaded in, or None."""
    return next((choice for choice in recent_choices() if choice.spec == spec), None)


def remember_model(choice: ModelChoice) -> None:
    """Put ``choice`` first among the remembered models (replacing that spec's earlier dtype and device)."""
    kept = [choice] + [c for c in recent_choices() if c.spec != choice.spec]
    _settings().setValue(CHOICES_KEY, [c.to_json() for c in kept[:KEEP]])
