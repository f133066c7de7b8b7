"""What a session stores, and the conversions into it: the run, image and
mask rows (:class:`RunInfo`, :class:`Run`, :class:`ImageInfo`), the audit-table
columns, :class:`SessionError`, and the checks that turn a model, an image, a
mask or a JSON document into the values one row holds (see :mod:`core.session`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sqlite3
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from core.errors import ImageLoadError, ReadoutError
from core.readout import jsonable

KINDS = (
    "analyze",
    "counterfactual",
    "sweep",
    "intervention",
    "audit",
    "nonunique",
    "label",
    "lens",
    "note",
)
_KIND_RE = re.compile(r"^[a-z][a-z0-9_\-]{0,39}$")

# The audit-table columns (docs/ARCHITECTURE.md, "Audit rows") as AuditRecord names them.
METHOD_COLUMNS = ("method", "question", "operation", "controls", "supports", "cannot_support")
# One row of Session.audit_table(): run identity, the audit columns, the audit
# record's own parameters and notes, then the run's parameters and summary.
AUDIT_COLUMNS = (
    "run_id",
    "kind",
    "created",
    "model",
    *METHOD_COLUMNS,
    "parameters",
    "notes",
    "run_parameters",
    "summary",
)


class SessionError(ReadoutError):
    """A session file that cannot be opened or written (missing, corrupt, not
    a session, written by a newer version, busy)."""


@dataclass(frozen=True)
class RunInfo:
    """One run as :meth:`Session.runs` lists it (no result JSON).

    Attributes:
        created: ISO 8601 UTC time of the commit.
        model: the model spec the run used, or None.
        image_sha256: :func:`core.images.image_sha256` of the run's image, or None.
    """

    id: int
    kind: str
    created: str
    summary: str
    model: str | None
    image_sha256: str | None
    mask_id: int | None
    n_audits: int


@dataclass
class Run:
    """One run in full (:meth:`Session.run`).

    Attributes:
        parameters: what the run was called with.
        result: the result JSON as recorded.
        audits: the audit rows (``AuditRecord.to_dict()`` form), in order.
        model: ``{"id", "spec", "fingerprint", "family", "info"}`` or None.
    """

    id: int
    kind: str
    created: str
    summary: str
    parameters: dict
    result: Any
    audits: list[dict]
    model: dict | None
    image_sha256: str | None
    mask_id: int | None

    @property
    def info(self) -> RunInfo:
        return RunInfo(
            self.id,
            self.kind,
            self.created,
            self.summary,
            self.model["spec"] if self.model else None,
            self.image_sha256,
            self.mask_id,
            len(self.audits),
        )


@dataclass
class ImageInfo:
    """A session image: hash, where it came from, size, and the PNG if stored."""

    sha256: str
    path: str | None
    size: tuple[int, int] | None
    png: bytes | None = field(default=None, repr=False)

    def pixels(self):
        """The stored image as an RGB ``PIL.Image`` (None when only the hash was kept).

        Raises:
            SessionError: the stored bytes are not an image PIL can read.
        """
        if self.png is None:
            return None
        from core.images import load_image

        try:  # a shared session is a file from elsewhere: its pictures get every check a user's image gets
            return load_image(self.png)
        except ImageLoadError as e:
            reason = str(e).removeprefix("image bytes: ")
            raise SessionError(f"the stored image {self.sha256[:12]} is unreadable ({reason})") from None


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _dumps(x, what: str) -> str:
    try:
        return json.dumps(jsonable(x), allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise SessionError(f"cannot record the {what}: {e}") from None


def _mask_sha(mask) -> str:
    import numpy as np

    h = hashlib.sha256(f"{mask.shape[1]}x{mask.shape[0]}:".encode())
    h.update(np.packbits(mask.astype(bool)).tobytes())
    return h.hexdigest()


def _mask_array(png: bytes):
    from core.images import load_mask  # imported here: numpy and PIL load only when a mask is read

    return load_mask(png)


def _mask_png(mask) -> bytes:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.where(mask, 255, 0).astype(np.uint8), "L").save(buf, "PNG")
    return buf.getvalue()


def _as_mask(mask, size: tuple[int, int] | None):
    """``(H, W)`` bool from an array, a PIL image, PNG bytes or a PNG path (white = region)."""
    import numpy as np
    from PIL import Image

    if isinstance(mask, (str, Path, bytes)):
        try:
            data = Path(mask).read_bytes() if not isinstance(mask, bytes) else mask
            m = _mask_array(data)
        except (OSError, ValueError) as e:
            raise SessionError(f"cannot read the mask ({type(e).__name__}: {e})") from None
    elif isinstance(mask, Image.Image):
        m = np.asarray(mask.convert("L")) >= 128
    else:
        m = np.asarray(mask)
        if m.ndim != 2:
            raise SessionError(f"a mask is an (H, W) array, got shape {m.shape}")
        m = m.astype(bool) if m.dtype == bool or m.max(initial=0) <= 1 else m >= 128
    if size is not None and (m.shape[1], m.shape[0]) != tuple(size):
        raise SessionError(f"the mask is {m.shape[1]}x{m.shape[0]}, the image {size[0]}x{size[1]}")
    return m


def _exists(p: Path) -> bool:
    """Whether ``p`` exists; a path that cannot even be looked at (a folder
    without search permission) is a :class:`SessionError`."""
    try:
        return p.exists()
    except OSError as e:
        raise SessionError(f"{p}: cannot look at it ({os.strerror(e.errno) if e.errno else e})") from None


def _sqlite_problem(p: Path, e: sqlite3.Error) -> str:
    """One line for an SQLite failure while opening ``p``: not a database,
    cannot be written, busy, or corrupt (SQLite's words in brackets)."""
    text = str(e)
    if "not a database" in text:
        return f"{p}: not a session file (not an SQLite database)"
    if "readonly" in text or "read-only" in text or "unable to open" in text:
        return f"{p}: cannot be opened for writing: the file or its folder is read-only ({text})"
    if "locked" in text or "busy" in text:
        return f"{p}: busy (another process holds the session); try again"
    return f"{p}: corrupt session file ({text})"


def _model_fields(model) -> dict | None:
    """``{"spec", "fingerprint", "family", "info"}`` from a LoadedModel, a dict
    (an analyze result's ``model``) or a spec string."""
    if model is None:
        return None
    if isinstance(model, str):
        return {"spec": model, "fingerprint": None, "family": None, "info": None}
    if isinstance(model, dict):
        if not model.get("spec"):
            return None
        info = {k: v for k, v in model.items() if k not in ("spec", "fingerprint", "family")}
        return {
            "spec": str(model["spec"]),
            "fingerprint": model.get("fingerprint") or None,
            "family": model.get("family"),
            "info": info or None,
        }
    spec = getattr(model, "spec", None)
    if spec is None:
        raise SessionError(f"model must be a spec, a dict or a LoadedModel, got {type(model).__name__}")
    adapter = getattr(model, "adapter", None)
    info = adapter.describe() if adapter is not None and hasattr(adapter, "describe") else None
    return {
        "spec": str(spec),
        "fingerprint": getattr(model, "fingerprint", None) or None,
        "family": getattr(model, "family", None),
        "info": info,
    }


def _prepare_image(image, image_path, store: bool):
    """``(sha256, path, (w, h), png or None)`` from a path, bytes, PIL image or array."""
    from core.images import image_sha256, load_image

    if isinstance(image, (str, Path)) and image_path is None:
        image_path = str(image)
    img = load_image(image)
    png = None
    if store:
        buf = io.BytesIO()
        img.save(buf, "PNG")
        png = buf.getvalue()
    return image_sha256(img), (str(image_path) if image_path is not None else None), img.size, png
