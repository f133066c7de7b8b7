"""The model as the picker names it: the spec, the dtype asked for and the
device (:class:`ModelChoice`), the key of the window's model cache and what the
recent models remember; and the devices this machine offers (:func:`device_choices`).
No Qt."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from core.shell.precision import DTYPE_CHOICES

CPU = "cpu"


@dataclass(frozen=True)
class ModelChoice:
    """A model spec loaded in ``dtype`` (one of :data:`core.shell.precision.DTYPE_CHOICES`;
    "auto": the loader chooses) on ``device`` ("cpu", "cuda", "cuda:N", "auto": spread
    over the GPUs). Two choices that differ in any field are two models: the cache never
    serves a bfloat16 model for a float32 request."""

    spec: str
    dtype: str = "auto"
    device: str = CPU

    def __post_init__(self):
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")

    def load_options(self) -> dict:
        """``dtype=`` / ``device=`` for :func:`core.load_model`."""
        return {"dtype": self.dtype, "device": self.device}

    def to_json(self) -> str:
        """One line of JSON, as the recent models store it."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_stored(cls, value) -> ModelChoice | None:
        """A remembered entry: the JSON of :meth:`to_json`, or a bare spec (what older
        versions remembered: the default dtype and device). None for anything unusable."""
        text = str(value or "").strip()
        if not text:
            return None
        if text.startswith("{"):
            try:
                fields = json.loads(text)
                return cls(str(fields["spec"]), str(fields.get("dtype", "auto")), str(fields.get("device", CPU)))
            except (ValueError, KeyError, TypeError):
                return None
        return cls(text)


def device_choices() -> tuple[str, ...]:
    """The devices the picker offers: "cpu", and with CUDA "cuda", each "cuda:N" and
    (several GPUs) "auto", which spreads a model over them."""
    import torch  # function-local: asked once, when the picker is built

    if not torch.cuda.is_available():
        return (CPU,)
    n = torch.cuda.device_count()
    return (CPU, "cuda", *(f"cuda:{i}" for i in range(n)), *(("auto",) if n > 1 else ()))
