"""The window's loaded models (``{ModelChoice: LoadedModel}``, shared with a
caller that passes its own) and what a run learns of the model it ran on. No Qt."""

from __future__ import annotations

import dataclasses

import core
from app.components.model_choice import ModelChoice
from app.components.workspace import RunInput


class ModelCache:
    """Reads of ``models``, the dict the jobs load into (app.jobs) and reuse."""

    def __init__(self, models: dict):
        self.models = models

    def loaded(self, model: ModelChoice) -> core.LoadedModel | None:
        """``model`` when it is loaded (in its dtype, on its device), else None."""
        loaded = self.models.get(model)
        return loaded if isinstance(loaded, core.LoadedModel) else None

    def fields(self, model: ModelChoice) -> dict:
        """The RunInput fields known once ``model`` is loaded: its fingerprint and the dtype and
        device it runs in (each None while it is not loaded)."""
        loaded = self.loaded(model)
        if loaded is None:
            return {"model_fingerprint": None, "loaded_dtype": None, "loaded_device": None}
        ran = loaded.adapter.dtype_and_device()
        return {"model_fingerprint": loaded.fingerprint, "loaded_dtype": ran["dtype"], "loaded_device": ran["device"]}

    def made_for(self, asked: RunInput) -> RunInput:
        """``asked`` (the input a job started with) with the fingerprint, dtype and device of the model it ran."""
        known = self.fields(asked.model_choice())
        return dataclasses.replace(asked, **{k: v if v is not None else getattr(asked, k) for k, v in known.items()})
