"""Exports of a session: the audit table as CSV, Markdown, self-contained HTML
and JSON, and the runs' patch-grid figures as PNG.

* :func:`audit_csv`, :func:`audit_markdown`: the rows of
  :meth:`core.session.Session.audit_table` (columns
  :data:`core.session.AUDIT_COLUMNS`: first what reproduces the run,
  :data:`core.session.RUN_COLUMNS`: run id, kind, time, the image's path as
  given and SHA-256 (a dataset run: the dataset file's), model spec and
  fingerprint, the question, the target, the method's specification and the
  numeric summary; then the audit columns of docs/ARCHITECTURE.md ("Audit
  rows"), the audit record's parameters and notes, the run's parameters in
  full). Lists are joined with ``"; "``, dicts written as JSON with sorted keys.
* :func:`audit_json`: ``{"schema_version": 1, "session": {...}, "columns",
  "audit_table": [...], "runs": [...]}`` with every run's full result; each
  run carries its :data:`~core.session.RUN_COLUMNS` too.
* :func:`audit_html`: one file, no external resources: the table, then each
  run's summary with its patch-grid pictures embedded as base64 PNG.
* :func:`run_figures` / :func:`patch_grid_png`: the pictures, drawn with PIL
  (no matplotlib): a run's rollout and most-visual heads' ``visual_patch_mass``
  grids (and those heads' attention among the prompt's text tokens, drawn by
  :func:`token_matrix_png`), an occlusion sweep's effect grid, a
  counterfactual's painted region.
  Patch-granular (one flat cell per visual token, drawn on the token's box in
  the original image when the session keeps the image); an upsampled map is
  never drawn here, so nothing needs the "interpolated" flag.
* :func:`export_session`: any of the above to a path, each file written
  atomically (:mod:`core.files.atomic`: sibling temporary file, then rename; the
  pictures of ``png`` all staged first and put in place together, so a
  failure leaves the folder as it was); the output path is checked before
  the session is read (a name over the file system's limit, a folder where a
  file is asked, a link: one line). A run holding values the session never
  writes (:class:`core.session.DamagedRunError`) is left out with a note
  ``run N: why``; the JSON and HTML list it under ``damaged_runs``.

The command line: ``vlm-readout export --session FILE --format csv|md|html|json|png --out PATH``
(``png``: ``PATH`` is a folder, one file per figure).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import ReadoutError
from core.results.audit_tables import audit_csv as table_csv
from core.results.audit_tables import audit_markdown as table_markdown
from core.results.audit_tables import cell as _cell
from core.session import AUDIT_COLUMNS, METHOD_COLUMNS, RUN_COLUMNS, Run, Session, SessionError, jsonable
from core.session.files import same_file
from core.session.records import DamagedRunError

SCHEMA_VERSION = 1
FORMATS = ("csv", "md", "html", "json", "png")
SUFFIX = {"csv": ".csv", "md": ".md", "html": ".html", "json": ".json"}
GRANULARITY = "patch-granular: one flat cell per visual token (not interpolated)"
MAX_HEAD_FIGURES = 2  # per analyze run: rollout plus the heads with the most visual mass
# A stored grid or token matrix larger than this is not drawn (a picture's memory grows with it; the
# largest real grids are a few thousand visual tokens, the text patterns a prompt's few hundred tokens).
MAX_GRID_CELLS = 1 << 16
MAX_MATRIX_SIDE = 512
# What a stored run can break while its pictures are drawn from its result JSON (a document of
# another shape or version): the run's pictures are left out with a note, never a traceback.
_DRAWING_ERRORS = (ReadoutError, KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError)
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9_-]+")

# ---------------------------------------------------------------- the table as text


def audit_csv(rows: Sequence[dict], columns: Sequence[str] = AUDIT_COLUMNS) -> str:
    """The session's audit table as CSV (:func:`core.results.audit_tables.audit_csv` with the session's columns)."""
    return table_csv(rows, columns)


def audit_markdown(rows: Sequence[dict], columns: Sequence[str] = AUDIT_COLUMNS, *, title: str | None = None) -> str:
    """The session's audit table as Markdown (:func:`core.results.audit_tables.audit_markdown` with the session's columns)."""
    return table_markdown(rows, columns, title=title)


def read_runs(session: Session, kinds: Iterable[str] | None, damaged: dict[int, str]) -> tuple[list[Run], list[dict]]:
    """The runs of ``kinds`` (None: all) that read in full, and the audit table
    of those runs. Each run holding a value the session never writes (its listed
    values, parameters, audit rows, result, image or mask row) is left out of
    both and goes into ``damaged`` as ``{run id: why}``."""
    kinds = list(kinds) if kinds is not None else None
    runs = []
    for info in session.runs(damaged=damaged):
        if kinds is not None and info.kind not in kinds:
            continue
        try:
            runs.append(session.run(info.id))
        except DamagedRunError as e:
            damaged.setdefault(e.run_id, e.why)
    table = [row for row in session.audit_table(kinds, damaged=damaged) if row["run_id"] not in damaged]
    return runs, table


def session_header(session: Session, damaged: dict[int, str] | None = None) -> dict:
    """What the exports say about the session itself (``damaged``: the runs left out, and why)."""
    return {
        "path": str(session.path),
        "schema_version": session.schema_version,
        "created": session.meta().get("created"),
        "models": [{k: m[k] for k in ("spec", "fingerprint", "family")} for m in session.models()],
        "n_runs": len(session.runs()),
        "damaged_runs": [{"run_id": rid, "problem": why} for rid, why in sorted((damaged or {}).items())],
    }


def audit_json(
    session: Session,
    *,
    kinds: Iterable[str] | None = None,
    results: bool = True,
    damaged: dict[int, str] | None = None,
) -> dict:
    """The session as one JSON document (schema version 1): the audit table
    and every run (with its full result unless ``results=False``). A damaged run
    is left out (see :func:`read_runs`), listed in ``session.damaged_runs`` and
    in ``damaged`` when given."""
    damaged = damaged if damaged is not None else {}
    runs, table = read_runs(session, kinds, damaged)
    docs = []
    for r in runs:
        doc = {
            "id": r.id,
            "kind": r.kind,
            "created": r.created,
            "model": r.model["spec"] if r.model else None,
            "image_sha256": r.image_sha256,
            "mask_id": r.mask_id,
            "parameters": r.parameters,
            "summary": r.summary,
            "audit": r.audits,
            **{k: v for k, v in r.columns().items() if k not in ("run_id", "kind", "created", "summary")},
        }
        if results:
            doc["result"] = r.result
        docs.append(doc)
    return jsonable(
        {
            "schema_version": SCHEMA_VERSION,
            "kind": "vlm-readout session export",
            "session": session_header(session, damaged),
            "columns": list(AUDIT_COLUMNS),
            "audit_table": table,
            "runs": docs,
        }
    )


# ---------------------------------------------------------------- pictures

# viridis at 9 stops (sequential maps), and a blue-white-red diverging map.
_VIRIDIS = [
    (68, 1, 84),
    (71, 44, 122),
    (59, 81, 139),
    (44, 113, 142),
    (33, 144, 141),
    (39, 173, 129),
    (92, 200, 99),
    (170, 220, 50),
    (253, 231, 37),
]
_DIVERGING = [
    (33, 102, 172),
    (103, 169, 207),
    (209, 229, 240),
    (247, 247, 247),
    (253, 219, 199),
    (239, 138, 98),
    (178, 24, 43),
]
_MISSING = (150, 150, 150)


def _lerp(stops, t: float) -> tuple[int, int, int]:
    t = min(1.0, max(0.0, t)) * (len(stops) - 1)
    i = min(int(t), len(stops) - 2)
    f = t - i
    a, b = stops[i], stops[i + 1]
    return tuple(round(a[k] + (b[k] - a[k]) * f) for k in range(3))


@dataclass
class Figure:
    """One picture of a run: ``png`` bytes, a short ``name`` (file stem), a
    ``title`` and a ``caption`` (value range, granularity)."""

    run_id: int
    name: str
    title: str
    caption: str
    png: bytes = field(repr=False)

    def data_uri(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png).decode("ascii")


def _limits(values: list[float], diverging: bool) -> tuple[float, float]:
    if not values:
        return 0.0, 1.0
    if diverging:
        m = max(abs(v) for v in values) or 1.0
        return -m, m
    lo, hi = min(0.0, min(values)), max(values)
    return lo, hi if hi > lo else lo + 1.0


def patch_grid_png(
    grid: Sequence[Sequence[float | None]],
    *,
    image=None,
    boxes: Sequence[Sequence[float] | None] | None = None,
    diverging: bool = False,
    title: str | None = None,
    size: int = 256,
    alpha: float = 0.65,
) -> bytes:
    """Draw a patch grid as a PNG with a colour bar.

    Args:
        grid: ``(rows, cols)`` values; None is drawn grey (no value).
        image: a PIL image the cells are drawn over (each cell on its box), or None.
        boxes: per cell in row-major order, ``[x0, y0, x1, y1]`` in the
            image's pixels (the visual tokens' boxes); default: the image cut
            evenly into ``rows x cols``.
        diverging: blue-white-red around 0 (signed effects), else viridis from
            min(0, min) to max.
        size: the longer side of the map in pixels (small grids are scaled up).
    """
    from PIL import Image, ImageDraw

    rows = [list(r) for r in grid]
    n_rows, n_cols = len(rows), max((len(r) for r in rows), default=0)
    if n_rows == 0 or n_cols == 0:
        raise SessionError("an empty grid has no picture")
    if n_rows * n_cols > MAX_GRID_CELLS:
        raise SessionError(f"a {n_rows} x {n_cols} grid is over the {MAX_GRID_CELLS:,} cells a picture draws")
    values = [float(v) for r in rows for v in r if v is not None and math.isfinite(float(v))]
    lo, hi = _limits(values, diverging)
    stops = _DIVERGING if diverging else _VIRIDIS

    def colour(v):
        if v is None or not math.isfinite(float(v)):
            return _MISSING
        return _lerp(stops, (float(v) - lo) / (hi - lo))

    if image is not None:
        w0, h0 = image.size
        scale = size / max(w0, h0)
        w, h = max(1, round(w0 * scale)), max(1, round(h0 * scale))
        resample = Image.NEAREST if scale >= 1 else Image.BILINEAR
        base = image.convert("RGB").resize((w, h), resample)
    else:
        cell = max(4, size // max(n_rows, n_cols))
        w0, h0 = n_cols * cell, n_rows * cell
        scale, (w, h) = 1.0, (w0, h0)
        base = Image.new("RGB", (w, h), (255, 255, 255))
    if boxes is None or len(boxes) != n_rows * n_cols:
        boxes = [
            [c * w0 / n_cols, r * h0 / n_rows, (c + 1) * w0 / n_cols, (r + 1) * h0 / n_rows]
            for r in range(n_rows)
            for c in range(n_cols)
        ]
    overlay = Image.new("RGBA", (w, h), (0, 0, 0, 0))
    draw = ImageDraw.Draw(overlay)
    a = round(255 * (alpha if image is not None else 1.0))
    lines = []
    for r in range(n_rows):
        for c in range(n_cols):
            box = boxes[r * n_cols + c]
            if box is None:
                continue
            x0, y0, x1, y1 = (round(v * scale) for v in box)
            v = rows[r][c] if c < len(rows[r]) else None
            draw.rectangle([x0, y0, x1 - 1, y1 - 1], fill=(*colour(v), a))
            lines.append([x0, y0, x1 - 1, y1 - 1])
    for b in lines:  # the patch grid, thin and light so the values stay readable
        draw.rectangle(b, outline=(255, 255, 255, 110))
    picture = Image.alpha_composite(base.convert("RGBA"), overlay).convert("RGB")

    return _framed(picture, title, (stops, lo, hi))


def _label_font():
    from PIL import ImageFont

    return ImageFont.load_default(size=11)


def _matrix_origin(row_labels: Sequence[str], col_labels: Sequence[str]) -> tuple[int, int]:
    """``(left, top)``: where :func:`token_matrix_png` puts the matrix's first cell
    (below the title, if any), after the widest row label and the longest column label."""
    from PIL import Image, ImageDraw

    from core.methods.patterns import display_token  # torch: imported when a picture is drawn, not to parse

    font, probe = _label_font(), ImageDraw.Draw(Image.new("RGB", (1, 1)))
    widest = max((probe.textlength(display_token(t), font=font) for t in row_labels), default=0.0)
    longest = max((probe.textlength(display_token(t), font=font) for t in col_labels), default=0.0)
    return int(math.ceil(4 + widest)), int(math.ceil(4 + longest))


def token_matrix_png(
    matrix: Sequence[Sequence[float]],
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    *,
    allowed: Sequence[Sequence[bool]] | None = None,
    title: str | None = None,
    cell: int = 18,
) -> bytes:
    """Draw a token x token matrix (a text-side attention pattern) as a PNG:
    row labels on the left, column labels written upwards above (the first
    cell at :func:`_matrix_origin`), viridis from min(0, min) to the largest
    value, a colour bar below.

    Args:
        matrix: ``(queries, keys)`` values.
        row_labels, col_labels: one token string per row / column.
        allowed: ``(queries, keys)``; False cells (a key the query may not
            attend: causal or prefix-LM mask) are drawn grey, not as a 0.
        cell: the side of one cell in pixels.
    """
    from PIL import Image, ImageDraw

    from core.methods.patterns import display_token

    if len(matrix) > MAX_MATRIX_SIDE or any(len(r) > MAX_MATRIX_SIDE for r in matrix):
        raise SessionError(f"a token matrix over {MAX_MATRIX_SIDE} tokens a side is not drawn")
    rows = [[float(v) for v in r] for r in matrix]
    n_rows, n_cols = len(rows), max((len(r) for r in rows), default=0)
    if n_rows == 0 or n_cols == 0:
        raise SessionError("an empty matrix has no picture")
    if len(row_labels) != n_rows or len(col_labels) != n_cols:
        raise SessionError(f"{n_rows} x {n_cols} matrix with {len(row_labels)} row and {len(col_labels)} column labels")
    font = _label_font()
    left, top = _matrix_origin(row_labels, col_labels)
    values = [v for r in rows for v in r if math.isfinite(v)]
    lo, hi = _limits(values, diverging=False)
    picture = Image.new("RGB", (left + n_cols * cell + 2, top + n_rows * cell + 2), (255, 255, 255))
    draw = ImageDraw.Draw(picture)
    for i, label in enumerate(row_labels):
        text = display_token(label)
        x = left - 3 - draw.textlength(text, font=font)
        draw.text((x, top + i * cell + (cell - 12) / 2), text, fill=(0, 0, 0), font=font)
    for j, label in enumerate(col_labels):  # written on a strip, turned upwards
        strip = Image.new("RGB", (top, cell), (255, 255, 255))
        ImageDraw.Draw(strip).text((2, (cell - 12) / 2), display_token(label), fill=(0, 0, 0), font=font)
        strip = strip.rotate(90, expand=True)
        picture.paste(strip, (left + j * cell, top - strip.height))
    for i in range(n_rows):
        for j in range(n_cols):
            v = rows[i][j] if j < len(rows[i]) else float("nan")
            masked = allowed is not None and not allowed[i][j]
            colour = _MISSING if masked or not math.isfinite(v) else _lerp(_VIRIDIS, (v - lo) / (hi - lo))
            x0, y0 = left + j * cell, top + i * cell
            draw.rectangle([x0, y0, x0 + cell - 1, y0 + cell - 1], fill=colour, outline=(255, 255, 255))
    return _framed(picture, title, (_VIRIDIS, lo, hi))


def _framed(picture, title: str | None, legend=None) -> bytes:
    """``picture`` with a title line above and (``legend = (stops, lo, hi)``)
    a colour bar with its end values below, as PNG bytes."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=12)
    w, h = picture.size
    bar_h, pad, text_h = 10, 4, 14
    top = text_h + pad if title else 0
    bottom = pad + bar_h + text_h + pad if legend else 0
    out = Image.new("RGB", (max(w, 160), top + h + bottom), (255, 255, 255))
    d = ImageDraw.Draw(out)
    if title:
        d.text((2, 1), title, fill=(0, 0, 0), font=font)
    out.paste(picture, (0, top))
    if legend:
        stops, lo, hi = legend
        y = top + h + pad
        bar_w = out.width - 4
        for x in range(bar_w):
            d.line([(2 + x, y), (2 + x, y + bar_h)], fill=_lerp(stops, x / max(1, bar_w - 1)))
        d.text((2, y + bar_h + 1), f"{lo:.3g}", fill=(0, 0, 0), font=font)
        hi_text = f"{hi:.3g}"
        d.text((out.width - 2 - d.textlength(hi_text, font=font), y + bar_h + 1), hi_text, fill=(0, 0, 0), font=font)
    buf = io.BytesIO()
    out.save(buf, "PNG")
    return buf.getvalue()


def _grid_range(grid) -> str:
    vals = [v for r in grid for v in r if v is not None]
    return f"min {min(vals):.3g}, max {max(vals):.3g}" if vals else "no values"


def _token_boxes(result: dict, grid, image_index) -> list | None:
    """Visual-token boxes of one image in row-major grid order, from an analyze result."""
    tokens = (result.get("input") or {}).get("visual_tokens") or []
    n_rows, n_cols = len(grid), len(grid[0]) if grid else 0
    boxes: list = [None] * (n_rows * n_cols)
    found = 0
    for t in tokens:
        if image_index is not None and t.get("image") != image_index:
            continue
        r, c = t.get("row"), t.get("col")
        if r is None or c is None or not (0 <= r < n_rows and 0 <= c < n_cols) or t.get("box") is None:
            continue
        boxes[r * n_cols + c] = t["box"]
        found += 1
    return boxes if found == n_rows * n_cols else None


def _text_pattern(text: dict | None, head: dict):
    """One analyze attention row's head, its text-side pattern: ``(matrix, token
    labels, allowed, largest row mass outside the shown keys)``, or None (no
    text patterns, or a cross-attention block)."""
    from core.methods.patterns import head_text_pattern

    found = head_text_pattern(text, head["layer"], head["head"]) if head.get("layer") is not None else None
    if found is None:
        return None
    outside = [sum(q) for q in zip(*found["other_mass"].values(), strict=True)] if found["other_mass"] else [0.0]
    labels = list(text["tokens"])
    if labels and text["answer_position"] == text["positions"][-1]:
        labels[-1] = f"[answer] {labels[-1]}"
    return found["weights"], labels, found["allowed"], max(outside)


def run_figures(session: Session, run: Run | int, notes: list[str] | None = None) -> list[Figure]:
    """The patch-grid pictures of one run (empty when it has none).

    A stored image or mask that cannot be decoded does not stop the export:
    the maps are drawn without the image (on an even grid) and the mask
    picture is left out; each such problem is one line appended to ``notes``.
    So is a result the pictures cannot be drawn from (a document of another
    shape, a grid too large to draw): that picture, or the run's, is left out.
    """
    if isinstance(run, int):
        run = session.run(run)
    notes = notes if notes is not None else []
    try:
        return _run_figures(session, run, notes)
    except _DRAWING_ERRORS as e:
        notes.append(f"run {run.id}: its pictures cannot be drawn from its stored result ({_why(e)}); left out")
        return []


def _why(e: BaseException) -> str:
    text = " ".join(str(e).split())[:160]
    return text if isinstance(e, ReadoutError) else f"{type(e).__name__}: {text}"


def safe_name(name: str) -> str:
    """``name`` as a file-name part: letters, digits, ``_`` and ``-`` only (a
    head's block name comes from the stored result: never a ``/`` or ``..``), at most 80."""
    return _UNSAFE_NAME.sub("_", str(name))[:80] or "figure"


def _readout(run: Run, notes: list[str]):
    """The run's result as its class (:attr:`Run.readout`), or None with a note when its stored
    JSON does not fit the class (another shape or version): the pictures drawn from it are left out."""
    try:
        return run.readout
    except DamagedRunError as e:
        notes.append(f"run {run.id}: its pictures cannot be drawn from its stored result ({e.why}); left out")
        return None


def _run_figures(session: Session, run: Run, notes: list[str]) -> list[Figure]:
    readout = _readout(run, notes)
    r = run.result if readout is not None and isinstance(run.result, dict) else {}
    image = None
    if run.image_sha256:
        try:
            info = session.image(run.image_sha256)
            image = info.pixels() if info is not None else None
        except SessionError as e:
            notes.append(f"run {run.id}: {e}; its maps are drawn without the image")
    figs: list[Figure] = []

    def add(name: str, short: str, title: str, grid, *, boxes=None, diverging=False, note="", granularity=GRANULARITY):
        # the boxes are the image's pixels: without the image, the cells are an even grid
        boxes = boxes if image is not None else None
        try:
            png = patch_grid_png(grid, image=image, boxes=boxes, diverging=diverging, title=f"run {run.id}: {short}")
            caption = f"{title}; {_grid_range(grid)}; {granularity}" + (f"; {note}" if note else "")
        except _DRAWING_ERRORS as e:
            notes.append(f"run {run.id}: its {short} picture cannot be drawn ({_why(e)}); left out")
            return
        figs.append(Figure(run.id, safe_name(name), title, caption, png))

    rollout = r.get("rollout")
    if isinstance(rollout, dict) and rollout.get("visual_patch_mass"):
        grid = rollout["visual_patch_mass"]
        boxes = _token_boxes(r, grid, rollout.get("primary_image", 0))
        add(
            "rollout",
            "rollout",
            f"rollout mass on the visual tokens (alpha {rollout.get('alpha')})",
            grid,
            boxes=boxes,
        )

    # The head with the most visual mass and the visual-key head with the largest |frozen-scale DLA|:
    # where the answer row looks, and which head that sees the image writes most directly to the answer.
    def head_name(h: dict) -> str:  # the residual component's name: "L1.H2", "L0.xattn.H3", "T0.H1"
        return f"{h['block']}.H{h['head']}" if h.get("block") else f"L{h['layer']}.H{h['head']}"

    heads = {
        head_name(h): h
        for h in r.get("attention") or []
        if isinstance(h, dict) and h.get("visual_patch_mass") and (h.get("visual_mass") or 0.0) > 0
    }
    dla = {
        str(c.get("name")): c["dla_frozen"]
        for c in (r.get("residual_decomposition") or {}).get("components") or []
        if isinstance(c, dict) and c.get("dla_frozen") is not None
    }
    picked = sorted(heads, key=lambda k: -(heads[k].get("visual_mass") or 0.0))[:1]
    by_dla = sorted((k for k in heads if k in dla), key=lambda k: -abs(dla[k]))
    if by_dla and by_dla[0] not in picked:
        picked.append(by_dla[0])
    primary = rollout.get("primary_image", 0) if isinstance(rollout, dict) else 0
    for name in picked[:MAX_HEAD_FIGURES]:
        h = heads[name]
        grid = h["visual_patch_mass"]
        extra = f", frozen DLA {dla[name]:+.2f}" if name in dla else ""
        add(
            name.replace(".", "_"),
            f"{name} attention",
            f"{name} answer-row attention on the visual tokens (visual mass {h.get('visual_mass', 0):.2f}{extra})",
            grid,
            boxes=_token_boxes(r, grid, primary),
        )
        text = _text_pattern(r.get("text_patterns"), h)
        if text is not None:
            matrix, labels, allowed, other = text
            try:
                png = token_matrix_png(matrix, labels, labels, allowed=allowed, title=f"run {run.id}: {name} text")
            except _DRAWING_ERRORS as e:
                notes.append(f"run {run.id}: its {name} text picture cannot be drawn ({_why(e)}); left out")
                continue
            figs.append(
                Figure(
                    run.id,
                    safe_name(name.replace(".", "_") + "_text"),
                    f"{name} attention among the prompt's text tokens",
                    f"{name} attention among the prompt's text tokens (rows: queries, the answer position last; "
                    f"columns: keys; grey: masked); each row's mass on keys not shown (BOS, image, special) is "
                    f"up to {other:.2f}, so a row sums to 1 only with it; routing only, not a cause",
                    png,
                )
            )
    if run.kind == "sweep" and readout is not None and readout.effect.size:
        sweep = readout  # core.methods.counterfactual.OcclusionMap
        key = "logit_diff_change" if sweep.logit_diff_change is not None else "logit_change"
        add(
            "sweep",
            f"occlusion sweep, k={sweep.k}",
            f"occlusion sweep {key} (k={sweep.k}, fill {sweep.fill.kind})",
            _grid_of(sweep.effect),
            boxes=sweep.cell_boxes(),
            diverging=True,
            note="blue: the answer loses",
            granularity="patch-granular: one flat cell per k x k block of patches (not interpolated)",
        )
    if run.mask_id is not None:
        try:
            mask = session.mask(run.mask_id)
        except SessionError as e:
            notes.append(f"run {run.id}: {e}; its painted-region picture is left out")
            mask = None
        if mask is not None:
            fill = getattr(readout, "fill", None)  # a fill run's (counterfactual, sweep)
            figs.append(_mask_figure(run, mask, image, fill.kind if fill is not None else None))
    return figs


def _grid_of(values) -> list[list[float | None]]:
    """A float array as the pictures take a grid: rows of numbers, None where not finite."""
    return [[float(v) if math.isfinite(v) else None for v in row] for row in values.tolist()]


def _mask_figure(run: Run, mask, image, fill: str | None = None, size: int = 256) -> Figure:
    """The painted region on the image (``fill``: the fill it was replaced with): tinted magenta,
    outlined in yellow."""
    import numpy as np
    from PIL import Image

    h0, w0 = mask.shape
    scale = size / max(w0, h0)
    w, h = max(1, round(w0 * scale)), max(1, round(h0 * scale))
    base = image.convert("RGB") if image is not None else Image.new("RGB", (w0, h0), (255, 255, 255))
    base = base.resize((w, h), Image.NEAREST if scale >= 1 else Image.BILINEAR)
    m = np.asarray(Image.fromarray(mask.astype(np.uint8) * 255).resize((w, h), Image.NEAREST)) >= 128
    arr = np.asarray(base, dtype=np.float32).copy()
    arr[m] = arr[m] * 0.5 + np.array([255.0, 0.0, 255.0]) * 0.5
    inner = m.copy()  # the outline: region pixels with a 4-neighbour outside the region
    inner[1:, :] &= m[:-1, :]
    inner[:-1, :] &= m[1:, :]
    inner[:, 1:] &= m[:, :-1]
    inner[:, :-1] &= m[:, 1:]
    arr[m & ~inner] = (255.0, 230.0, 0.0)
    title = "painted region" + (f", fill {fill}" if fill else "")
    png = _framed(Image.fromarray(arr.round().astype(np.uint8)), f"run {run.id}: {title}")
    caption = f"{title}; {int(mask.sum())} px of {w0}x{h0}; tinted magenta, outlined yellow"
    return Figure(run.id, "mask", title, caption, png)


# ---------------------------------------------------------------- HTML

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.5em;color:#222}
div.table{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;font-size:12px}
th,td{border:1px solid #ccc;padding:3px 5px;vertical-align:top;text-align:left}
th{background:#f0f0f0;position:sticky;top:0}
tr:nth-child(even) td{background:#fafafa}
td{max-width:24em;overflow-wrap:break-word}
td.json{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:11px;min-width:14em;overflow-wrap:anywhere}
td.c-created{white-space:nowrap}
td.c-notes,td.c-controls,td.c-summary,td.c-specification{min-width:16em}
td.c-image_sha256,td.c-model_fingerprint{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:11px;
overflow-wrap:anywhere;min-width:10em}
td.c-question,td.c-operation,td.c-supports,td.c-cannot_support{min-width:9em}
section.run{margin:1.2em 0;padding-top:.6em;border-top:1px solid #ddd}
figure{display:inline-block;margin:.4em 1em .4em 0;vertical-align:top;max-width:300px}
figcaption{font-size:11px;color:#444}
.meta{color:#555;font-size:13px}
"""


def audit_html(
    session: Session,
    *,
    kinds: Iterable[str] | None = None,
    title: str | None = None,
    notes: list[str] | None = None,
    damaged: dict[int, str] | None = None,
) -> str:
    """One self-contained HTML page: the audit table (with the chapter's
    column names), then each run's summary and pictures (base64 PNG). A
    picture that cannot be drawn is noted in its run's section and in ``notes``
    (see :func:`run_figures`); a damaged run is left out (see :func:`read_runs`),
    listed at the top and in ``damaged`` when given."""
    notes = notes if notes is not None else []
    damaged = damaged if damaged is not None else {}
    runs, table = read_runs(session, kinds, damaged)
    head = session_header(session, damaged)
    title = title or f"VLM Readout session {Path(head['path']).name}"
    e = html.escape
    models = ", ".join(
        f"{m['spec']}" + (f" ({m['family']}, {m['fingerprint']})" if m["fingerprint"] else "") for m in head["models"]
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        f'<p class="meta">file {e(head["path"])}; created {e(str(head["created"]))}; session schema '
        f"{head['schema_version']}; {head['n_runs']} runs; models: {e(models or 'none recorded')}</p>",
        *(
            f'<p class="meta"><strong>left out:</strong> run {d["run_id"]}: {e(d["problem"])}</p>'
            for d in head["damaged_runs"]
        ),
        "<h2>Audit table</h2>",
        '<p class="meta">One row per audit record of each run. The first columns reproduce the run: '
        f"{', '.join(RUN_COLUMNS)} (the image by its path as given and its SHA-256; a dataset run by its file). "
        "The method columns are the chapter's "
        f"audit table (4.13): {', '.join(METHOD_COLUMNS)}; parameters and notes are this call's; "
        "run_parameters are the run's in full.</p>",
        '<div class="table"><table><thead><tr>'
        + "".join(f"<th>{e(c)}</th>" for c in AUDIT_COLUMNS)
        + "</tr></thead><tbody>",
    ]
    for row in table:
        cells = []
        for c in AUDIT_COLUMNS:
            v = row.get(c)
            if c == "created" and isinstance(v, str):  # 2026-01-02T03:04:05.678+00:00 -> 2026-01-02 03:04:05 UTC
                v = v[:19].replace("T", " ") + (" UTC" if v.endswith("+00:00") else "")
            cls = f"c-{c} json" if isinstance(v, dict) else f"c-{c}"
            cells.append(f'<td class="{cls}">{e(_cell(v))}</td>')
        parts.append("<tr>" + "".join(cells) + "</tr>")
    parts.append("</tbody></table></div>")
    parts.append("<h2>Runs</h2>")
    for run in runs:
        parts.append(f'<section class="run" id="run-{run.id}">')
        parts.append(f"<h3>Run {run.id}: {e(run.kind)}</h3>")
        columns = run.columns()
        fingerprint = f" ({columns['model_fingerprint']})" if columns["model_fingerprint"] else ""
        # the image by its path when it has one, else by its full hash (a 12-character prefix names nothing)
        source = columns["image_path"] or columns["image_sha256"]
        what = "dataset" if run.image_sha256 is None and columns["image_path"] else "image"
        parts.append(
            f'<p class="meta">{e(run.created)}; model {e(columns["model"] or "unknown")}{e(fingerprint)}'
            + (f"; {what} {e(source)}" if source else "")
            + (f" (sha256 {e(columns['image_sha256'])})" if columns["image_path"] and columns["image_sha256"] else "")
            + "</p>"
        )
        parts.append(f"<p>{e(run.summary)}</p>")
        if run.parameters:
            parts.append(f'<p class="meta">parameters: <code>{e(_cell(run.parameters))}</code></p>')
        run_notes: list[str] = []
        figures = run_figures(session, run, run_notes)
        notes += run_notes
        for note in run_notes:
            parts.append(f'<p class="meta"><strong>note:</strong> {e(note)}</p>')
        for fig in figures:
            parts.append(
                f'<figure><img src="{fig.data_uri()}" alt="{e(fig.title)}">'
                f"<figcaption>{e(fig.caption)}</figcaption></figure>"
            )
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------- writing


def export_session(
    session: Session | str | Path,
    fmt: str,
    out: str | Path,
    *,
    kinds: Iterable[str] | None = None,
    notes: list[str] | None = None,
    damaged: dict[int, str] | None = None,
) -> list[Path]:
    """Write one export of ``session`` (an open Session, or a session file,
    which is opened read-only: the export never writes to it) to ``out``,
    atomically; returns the files written. ``fmt``: ``csv``, ``md``,
    ``html``, ``json`` (``out`` is the file) or ``png`` (``out`` is a folder:
    ``run0003_rollout.png``, ...; every picture is staged first and they are
    put in place together, so a failure changes none of the folder's files).

    ``out`` is checked before the session is read. Problems that leave the
    rest exported are lines in ``notes``: first each damaged run, left out
    (``run N: why``; also ``{N: why}`` in ``damaged``), then each picture that
    could not be drawn as recorded (an unreadable stored image).

    Raises:
        OutputError: ``out`` cannot be written (a name too long, a folder
            where a file is asked or the reverse, a link, a full disk).
        SessionError: the session cannot be read, or it has runs and none
            of them (of ``kinds``) reads.
    """
    from core.files.atomic import check_output_file, check_output_folder, staged_writes, write_text_atomic

    if fmt not in FORMATS:
        raise SessionError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    out = Path(out)
    own = not isinstance(session, Session)
    if same_file(out, Path(session) if own else Path(session.path)):
        raise SessionError(f"{out}: is the session file itself; give another output path")
    if fmt == "png":
        check_output_folder(out)
    else:
        check_output_file(out)
    s = Session.open(session, read_only=True) if own else session
    damaged = damaged if damaged is not None else {}
    drawn: list[str] = []  # the pictures' notes, after the damaged runs'
    try:
        kinds = list(kinds) if kinds is not None else None
        if fmt == "png":
            runs, _ = read_runs(s, kinds, damaged)
            _refuse_if_nothing_read(s, damaged)
            figures = [fig for run in runs for fig in run_figures(s, run, drawn)]
            written = []
            with staged_writes() as staging:
                for fig in figures:
                    written.append(staging.add(out / f"run{fig.run_id:04d}_{fig.name}.png", fig.png))
            return written
        if fmt in ("csv", "md"):  # the table only: a run's result is not read
            s.runs(damaged=damaged)
            table = [row for row in s.audit_table(kinds, damaged=damaged) if row["run_id"] not in damaged]
            if fmt == "csv":
                text = audit_csv(table)
            else:
                text = audit_markdown(table, title=f"Audit table of {Path(s.path).name}")
            _refuse_if_nothing_read(s, damaged)
        elif fmt == "json":
            doc = audit_json(s, kinds=kinds, damaged=damaged)
            _refuse_if_nothing_read(s, damaged)
            text = json.dumps(doc, indent=1, allow_nan=False) + "\n"
        else:
            text = audit_html(s, kinds=kinds, notes=drawn, damaged=damaged)
            _refuse_if_nothing_read(s, damaged)
        write_text_atomic(out, text)
        return [out]
    finally:
        if notes is not None:
            notes += [f"run {rid}: {why}; left out of the export" for rid, why in sorted(damaged.items())] + drawn
        if own:
            s.close()


def _refuse_if_nothing_read(session: Session, damaged: dict[int, str]) -> None:
    """Every run of the session is damaged: nothing can be exported (one line, the first run's problem)."""
    if damaged and all(info.id in damaged for info in session.runs()):
        rid, why = min(damaged.items())
        raise SessionError(
            f"{session.path}: none of its runs can be read ({len(damaged)} damaged; run {rid}: {why}); nothing exported"
        )
