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
from functools import cached_property
from pathlib import Path
from typing import Any

from core.errors import ImageLoadError, ReadoutError
from core.files.pairs import pairs_file
from core.results.readout import Readout, ResultDocumentError, jsonable, restore_result

KINDS = (
    "analyze",
    "generate",
    "counterfactual",
    "sweep",
    "intervention",
    "knockout",
    "patch-grid",
    "attribution-patching",
    "audit",
    "nonunique",
    "qk-ov",
    "label",
    "validate",
    "lens",
    "statistics",
    "note",
)
_KIND_RE = re.compile(r"^[a-z][a-z0-9_\-]{0,39}$")

# The audit-table columns (docs/ARCHITECTURE.md, "Audit rows") as AuditRecord names them.
METHOD_COLUMNS = ("method", "question", "operation", "controls", "supports", "cannot_support")
# What a row needs to reproduce its run (Run.columns()): which run, its input (the image's path as
# given and its SHA-256; a dataset run's file and the SHA-256 of its bytes), the model, the question,
# the target (answer, foil, position), the method's full specification and the run's numeric summary.
RUN_COLUMNS = (
    "run_id",
    "kind",
    "created",
    "image_path",
    "image_sha256",
    "model",  # the spec (the name kept from schema version 1 of the exports)
    "model_fingerprint",
    "run_question",
    "target",
    "specification",
    "summary",
)
# One row of Session.audit_table(): the run's columns, the audit columns, the audit
# record's own parameters and notes, then the run's parameters in full.
AUDIT_COLUMNS = (
    *RUN_COLUMNS,
    *METHOD_COLUMNS,
    "parameters",
    "notes",
    "run_parameters",
)
# Run parameters with a column of their own, left out of the specification.
_OWN_COLUMN = frozenset(
    {"question", "answer", "foil", "position", "dataset", "dataset_sha256", "model", "fingerprint", "family"}
)


class SessionError(ReadoutError):
    """A session file that cannot be opened or written (missing, corrupt, not
    a session, written by a newer version, busy, on a full disk)."""


class DamagedRunError(SessionError):
    """One run of a session holds a value the session never writes (text where
    a number belongs, parameters that are not a JSON object, a result nested
    thousands deep): ``"<file>: run <id>: <why>"``. The other runs read; an
    export leaves this one out with a ``warning: run <id>: ...`` line."""

    def __init__(self, path, run_id: int, why: str):
        self.run_id = run_id
        self.why = " ".join(str(why).split())
        super().__init__(f"{path}: run {run_id}: {self.why}")


@dataclass(frozen=True)
class RunInfo:
    """One run as :meth:`Session.runs` lists it (no result JSON).

    Attributes:
        created: ISO 8601 UTC time of the commit.
        model: the model spec the run used, or None.
        image_sha256: :func:`core.files.images.image_sha256` of the run's image, or None.
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
    """One run in full (:meth:`Session.run`): everything needed to show it again.

    Attributes:
        parameters: what the run was called with.
        result: the result JSON as recorded.
        audits: the audit rows (``AuditRecord.to_dict()`` form), in order.
        model: ``{"id", "spec", "fingerprint", "family", "info", "added"}`` or None.
        image: the run's image (hash, path as given, size and the PNG when the
            session keeps pixels: :meth:`ImageInfo.pixels`), or None.
        mask_png: the painted mask as stored (:meth:`mask` decodes it), or None.
        session_path: the session file it was read from (a damaged result names it).

    :attr:`readout` is the result as its kind's class (the JSON ``result`` restored).
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
    image: ImageInfo | None = None
    mask_png: bytes | None = field(default=None, repr=False)
    session_path: str | Path | None = field(default=None, repr=False, compare=False)

    @cached_property
    def readout(self) -> Readout:
        """The run's result as its kind's class (:func:`core.results.readout.restore_result`, restored
        once): a :class:`core.analyze.AnalyzeResult`, a ``RegionCounterfactual``...

        Raises:
            DamagedRunError: the stored result does not fit its kind's class (another shape
                or version): damaged as a run whose values the session never writes is.
        """
        try:
            return restore_result(self.kind, self.result)
        except ResultDocumentError as e:
            raise DamagedRunError(self.session_path, self.id, str(e)) from None

    @property
    def model_spec(self) -> str | None:
        """The spec of the model the run used (None: recorded without a model)."""
        return self.model["spec"] if self.model else None

    @property
    def model_fingerprint(self) -> str | None:
        """The fingerprint of the model the run used (None: not recorded)."""
        return self.model.get("fingerprint") if self.model else None

    @property
    def image_path(self) -> str | None:
        """Where the run's image came from (None for an image given without a path)."""
        return self.image.path if self.image is not None else None

    @property
    def question(self) -> str | None:
        """The question the model was asked (the run's ``question`` parameter)."""
        return self.parameters.get("question")

    @property
    def target(self) -> dict | None:
        """``{"answer", "foil", "position"}`` the run read out (see :func:`run_target`)."""
        return run_target(self.parameters, self.result)

    @property
    def dtype_and_device(self) -> dict:
        """``{"dtype", "device"}`` the run was computed in (see :func:`dtype_and_device`); ``{}``
        for a run recorded before they were."""
        return dtype_and_device(None, self.result, self.parameters)

    def pixels(self):
        """The run's image as an RGB ``PIL.Image`` (None without an image or stored pixels).

        Raises:
            SessionError: the stored bytes are not an image PIL can read.
        """
        return self.image.pixels() if self.image is not None else None

    def mask(self):
        """The painted mask as an ``(H, W)`` bool array (True = region), or None.

        Raises:
            SessionError: the stored mask is not a PNG PIL can read.
        """
        return stored_mask(self.mask_png, self.mask_id) if self.mask_png is not None else None

    def columns(self) -> dict:
        """The run's columns of the audit table (:data:`RUN_COLUMNS`)."""
        return run_columns(
            self.id,
            self.kind,
            self.created,
            self.summary,
            self.parameters,
            self.result,
            self.model,
            self.image_sha256,
            self.image_path,
            self.mask_id,
        )

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
        from core.files.images import load_image

        try:  # a shared session is a file from elsewhere: its pictures get every check a user's image gets
            return load_image(self.png)
        except ImageLoadError as e:
            reason = str(e).removeprefix("image bytes: ")
            raise SessionError(f"the stored image {self.sha256[:12]} is unreadable ({reason})") from None


def run_target(parameters: dict, result) -> dict | None:
    """``{"answer", "foil", "position"}`` of a run (and ``answer_token_index`` when
    it was read at an answer token): the answer and foil tokens
    from its parameters; the position from its parameters (an intervention's
    answer position) or its result's ``target`` (analyze). ``position`` None:
    each forward read at its own answer position (counterfactual, sweep). A
    dataset run's ``target`` parameter (a description) is returned as is;
    None when the run names no target."""
    described = parameters.get("target")
    if "answer" not in parameters and isinstance(described, str):
        return {"answer": None, "foil": None, "position": None, "description": described}
    position = parameters.get("position")
    if position is None and isinstance(result, dict) and isinstance(result.get("target"), dict):
        position = result["target"].get("position")
    if parameters.get("answer") is None and parameters.get("foil") is None and position is None:
        return None
    target = {"answer": parameters.get("answer"), "foil": parameters.get("foil"), "position": position}
    if parameters.get("answer_token_index") is not None:  # read at an answer token (teacher forcing)
        target["answer_token_index"] = parameters["answer_token_index"]
    return target


def specification(parameters: dict, mask_id: int | None = None) -> str:
    """The method's full specification as one line, ``key=value; ...``: every
    run parameter but those with a column of their own (question, answer,
    foil, position, the dataset, the model), None values left out; text as
    is, numbers, lists and dicts as JSON (sorted keys); the stored mask's id last."""
    parts = []
    for key, value in parameters.items():
        if key in _OWN_COLUMN or value is None:
            continue
        text = value if isinstance(value, str) else json.dumps(jsonable(value), sort_keys=True)
        parts.append(f"{key}={text}")
    if mask_id is not None:
        parts.append(f"mask_id={mask_id}")
    return "; ".join(parts)


def run_columns(
    run_id: int,
    kind: str,
    created: str,
    summary: str,
    parameters: dict,
    result,
    model: dict | None,
    image_sha256: str | None,
    image_path: str | None,
    mask_id: int | None,
) -> dict:
    """A run's :data:`RUN_COLUMNS`. A run without an image whose parameters
    name a ``dataset`` (the dataset audit) takes the dataset file's path and
    the SHA-256 of its bytes as its input (see :func:`dataset_sha256`)."""
    if image_sha256 is None and parameters.get("dataset") is not None:
        image_path, image_sha256 = str(parameters["dataset"]), parameters.get("dataset_sha256")
    return {
        "run_id": run_id,
        "kind": kind,
        "created": created,
        "image_path": image_path,
        "image_sha256": image_sha256,
        "model": model["spec"] if model else None,
        "model_fingerprint": model["fingerprint"] if model else None,
        "run_question": parameters.get("question"),
        "target": run_target(parameters, result),
        "specification": specification(parameters, mask_id),
        "summary": summary,
    }


def dataset_sha256(dataset: str | Path) -> str | None:
    """SHA-256 of the bytes of a dataset file (a pairs JSONL, or a folder's
    ``dataset.jsonl`` / one ``*.jsonl``: :func:`core.files.pairs.pairs_file`); None
    when it cannot be read (the run is recorded all the same)."""
    try:
        h = hashlib.sha256()
        with open(pairs_file(dataset), "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    except (OSError, ReadoutError):
        return None


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
    from core.files.images import load_mask  # imported here: numpy and PIL load only when a mask is read

    return load_mask(png)


def stored_mask(png: bytes, mask_id: int | None):
    """A stored mask's PNG as an ``(H, W)`` bool array; an unreadable one is a
    :class:`SessionError` naming it."""
    try:
        return _mask_array(png)
    except ImageLoadError as e:
        reason = str(e).removeprefix("image bytes: ")
        raise SessionError(f"the stored mask {mask_id} is unreadable ({reason})") from None


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
    without search permission, a name too long) is a :class:`SessionError`,
    and so is a symbolic link to nothing: a session is never created through
    a link (it would be written wherever the link points)."""
    try:
        if p.exists():
            return True
        if p.is_symlink():
            raise SessionError(
                f"{p}: a symbolic link to {os.readlink(p)}, which does not exist; refusing to create a session "
                "through it"
            )
        return False
    except OSError as e:
        raise SessionError(f"{p}: cannot look at it ({os.strerror(e.errno) if e.errno else e})") from None


def _sqlite_problem(p: Path, e: sqlite3.Error, doing: str = "open it") -> str:
    """One true line for an SQLite failure on the session ``p`` while ``doing``:
    not a database, corrupt (only when SQLite says the file is), the disk full
    (SQLite's "database or disk is full", or an I/O error where no space is
    left: :func:`core.files.atomic.no_space_reason`), read-only, busy, or SQLite's
    own words. An intact file is never called corrupt."""
    from core.files.atomic import no_space_reason

    text = str(e)
    name = getattr(e, "sqlite_errorname", "") or ""
    if name.startswith("SQLITE_NOTADB") or "not a database" in text:
        return f"{p}: not a session file (not an SQLite database)"
    if name.startswith("SQLITE_CORRUPT") or "malformed" in text:
        return f"{p}: corrupt session file ({text})"
    if name.startswith(("SQLITE_FULL", "SQLITE_IOERR")) or "disk is full" in text or "disk I/O error" in text:
        full = no_space_reason(p, (p.with_name(p.name + "-wal"), p.with_name(p.name + "-shm")))
        if full is None and name.startswith("SQLITE_FULL"):
            full = "the disk is full"
        if full is not None:
            kept = "" if doing == "create it" else "; the runs already in the session are unchanged"
            return f"{p}: cannot {doing}: {full} (SQLite: {text}){kept}"
        return f"{p}: cannot {doing}: an input/output error on its disk (SQLite: {text})"
    if name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN")) or "readonly" in text or "unable to open" in text:
        return f"{p}: cannot {doing}: the file or its folder is read-only ({text})"
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text or "busy" in text:
        return f"{p}: busy (another process holds the session) while trying to {doing}; try again"
    return f"{p}: cannot {doing} (SQLite: {text})"


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


def dtype_and_device(model_fields: dict | None, result, parameters: dict | None = None) -> dict:
    """``{"dtype", "device"}`` a run's numbers were computed in: as its ``parameters``
    state them, else its model (:meth:`core.models.adapter.Adapter.dtype_and_device`,
    through ``describe()`` or a result's ``model`` block), else the result's ``input``
    block; only the keys known (an older run states neither)."""
    sources = [parameters, (model_fields or {}).get("info")]
    if isinstance(result, dict):
        sources += [result.get("model"), result.get("input")]
    found = {}
    for source in sources:
        if isinstance(source, dict):
            for key in ("dtype", "device"):
                if source.get(key) is not None:
                    found.setdefault(key, source[key])
    return found


def _prepare_image(image, image_path, store: bool):
    """``(sha256, path, (w, h), png or None)`` from a path, bytes, PIL image or array."""
    from core.files.images import image_sha256, load_image

    if isinstance(image, (str, Path)) and image_path is None:
        image_path = str(image)
    img = load_image(image)
    png = None
    if store:
        buf = io.BytesIO()
        img.save(buf, "PNG")
        png = buf.getvalue()
    return image_sha256(img), (str(image_path) if image_path is not None else None), img.size, png
