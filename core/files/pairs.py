"""Pairs files: JSONL of ``{"image", "question"[, "answer", "foil", ...]}`` lines.

One reader, :func:`read_pairs`, for every command that reads image-question
pairs (``answer --pairs``, ``audit --dataset``, the tuned lens's corpus): a
JSONL file, or a folder holding ``dataset.jsonl`` or exactly one ``*.jsonl``
(:func:`pairs_file`); each line is one :class:`Pair`. The line-level parts
are :func:`read_jsonl` and :func:`text_field`. :func:`load_pair_image`,
:func:`check_pair_image` and :func:`load_pair_mask` load a pair's files,
naming its line when they fail.

A line's fields (paths are relative to the JSONL file's folder)::

    image (required), question (required), answer, foil, target_mask,
    id, kind, template (free-text labels: any JSON scalar)

``target_mask`` is the one mask convention: a PNG of the image's size, white
(luminance >= 128, and alpha >= 128 where it has alpha) inside the region
(:func:`core.files.images.load_mask`). Other keys (``core.zoo.dataset`` writes
``objects``, ``distractor_masks``, ...) are not read here; each pair keeps its
line's object in :attr:`Pair.row` for the readers that need them (the
validation chain's, :mod:`core.validate`).

Below the command line and the methods, both of which read pairs files.
"""

from __future__ import annotations

import codecs
import json
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import ImageLoadError, InputFileError
from core.files.input_files import MAX_JSON_DEPTH, read_regular_bytes
from core.files.json_fields import json_kind as _json_type

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

DATASET_JSONL = "dataset.jsonl"  # the file a dataset folder holds (core.zoo.dataset writes it)
# A pairs file is read whole: its size and its number of pairs bound what it makes
# the reader allocate (a pair in memory is about 1 KB; a line is rarely under 60 bytes).
MAX_PAIRS_BYTES = 512 * 2**20
MAX_PAIRS = 2_000_000
PROGRESS_EVERY = 20_000  # lines (or images) between two progress calls

Progress = Callable[..., None] | None


def _no_constant(token: str):
    raise ValueError(f"{token} is not JSON")


_LINE_DECODER = json.JSONDecoder(parse_constant=_no_constant)  # one for every line: json.loads builds one a call


def read_jsonl(path: str | Path, what: str = "pairs file", progress: Progress = None) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line of a JSONL file.

    The file must be a regular file (a FIFO, device or socket is refused,
    never waited on) of at most :data:`MAX_PAIRS_BYTES`, UTF-8 (a leading
    byte-order mark is accepted), and each non-blank line one JSON object
    nested no deeper than :data:`core.files.input_files.MAX_JSON_DEPTH`, without
    NaN / Infinity. Lines end at ``\\n`` only (a JSON string may hold U+2028
    and the like). Every problem is one :class:`InputFileError` naming the
    file and the line, ``what`` the file's role. ``progress(lines read,
    lines)`` is called every :data:`PROGRESS_EVERY` lines.
    """
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise InputFileError(f"{path}: no such {what}") from None
    except OSError as e:
        raise InputFileError(f"{path}: cannot read the {what} ({os.strerror(e.errno) if e.errno else e})") from None
    except ValueError as e:  # a NUL in the name
        raise InputFileError(f"{path}: cannot read the {what} ({e})") from None
    if stat.S_ISDIR(mode):
        raise InputFileError(f"{path}: is a folder, not a {what}")
    if stat.S_ISFIFO(mode):
        raise InputFileError(f"{path}: is a FIFO (a pipe), not a {what}; save it to a file first")
    if not stat.S_ISREG(mode):
        raise InputFileError(f"{path}: is a device or socket, not a {what}")
    if not os.access(path, os.R_OK):
        raise InputFileError(f"{path}: cannot read the {what} (Permission denied)")
    data = read_regular_bytes(path, InputFileError, MAX_PAIRS_BYTES)  # non-blocking: a swap for a FIFO is refused
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    utf16 = data[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
    try:
        text = data.decode("utf-8")
        bad = text.find("\x00")  # UTF-16 without a byte-order mark decodes, with a NUL in every other byte
    except UnicodeDecodeError as e:
        text, bad = "", -1
        line = data.count(b"\n", 0, e.start) + 1
    else:
        line = text.count("\n", 0, bad) + 1 if bad >= 0 else 0
        utf16 = utf16 or bad >= 0
    del data
    if line:
        hint = "; it looks like UTF-16" if utf16 else ""
        raise InputFileError(f"{path}: not UTF-8 (line {line}){hint}; save the {what} as UTF-8")
    lines = text.split("\n")
    del text
    for n, raw in enumerate(lines, 1):
        if progress is not None and n % PROGRESS_EVERY == 0:
            progress(n, len(lines))
        line_text = raw.rstrip("\r")
        if not line_text.strip():
            continue
        yield n, _line_object(line_text, f"{path}:{n}")
    if progress is not None:
        progress(len(lines), len(lines))


def _line_object(line: str, where: str) -> dict:
    """One JSONL line as a JSON object; InputFileError naming ``where`` (``file:line``)."""
    try:
        item = _LINE_DECODER.decode(line)  # the C scanner: past the recursion limit, a RecursionError
    except json.JSONDecodeError as e:
        raise InputFileError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise InputFileError(f"{where}: JSON nested too deeply (over {MAX_JSON_DEPTH} levels)") from None
    except ValueError as e:  # NaN / Infinity; an integer of over 4300 digits (Python's int limit)
        why = str(e) if str(e).endswith("is not JSON") else "a number with too many digits"
        raise InputFileError(f"{where}: not JSON ({why})") from None
    # the walk runs only on a line with brackets enough to be too deep (brackets in strings count here)
    if line.count("[") + line.count("{") > MAX_JSON_DEPTH and _nested_deeper(item, MAX_JSON_DEPTH):
        raise InputFileError(f"{where}: JSON nested too deeply (over {MAX_JSON_DEPTH} levels)")
    if not isinstance(item, dict):
        raise InputFileError(f"{where}: expected a JSON object {{...}}, got {_json_type(item)}")
    return item


def _nested_deeper(value, max_depth: int) -> bool:
    """Whether the decoded ``value`` holds arrays / objects more than
    ``max_depth`` deep (iterative: no recursion; each container visited once)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > max_depth:
                    return True
                stack.append((child, depth + 1))
    return False


def text_field(row: dict, key: str, where: str, *, required: bool = True) -> str | None:
    """``row[key]`` as a string; ``where`` is ``file:line`` for the message.

    A required field must be a non-blank string; an optional one is absent,
    null, or a non-empty string. NUL characters and unpaired surrogates (which
    no file or model can take) are refused.
    """
    value = row.get(key)
    if value is None:
        if not required:
            return None
        if key not in row:
            raise InputFileError(f'{where}: no "{key}" field')
        raise InputFileError(f'{where}: "{key}" must be a non-empty string, got null')
    if not isinstance(value, str):
        shown = json.dumps(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise InputFileError(f'{where}: "{key}" must be a string, got {_json_type(value)} ({shown})')
    if not (value.strip() if required else value):
        raise InputFileError(f'{where}: "{key}" is empty')
    if "\x00" in value:
        raise InputFileError(f'{where}: "{key}" contains a NUL character')
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InputFileError(f'{where}: "{key}" contains an unpaired surrogate (\\ud800-\\udfff)') from None
    return value


def resolve_beside(path: Path, name: str, where: str | None = None, key: str = "image") -> Path:
    """A path from a JSONL line: ``~`` / ``~user`` expanded; relative paths are
    relative to the JSONL file's folder. A ``~`` that names no user (or no home
    folder) is an InputFileError naming ``where`` (``file:line``) and the field."""
    try:
        p = Path(name).expanduser()
    except RuntimeError:  # "Could not determine home directory."
        user = name.split("/", 1)[0]
        raise InputFileError(
            f'{where or path}: "{key}": cannot expand {user!r} in {name[:80]!r} (no such user, or no home folder)'
        ) from None
    return p if p.is_absolute() else path.parent / p


@dataclass(frozen=True, slots=True)
class Pair:
    """One image-question pair of a pairs file.

    Attributes:
        index: 0-based position among the file's pairs (the order of every output).
        line: the line number in the file; ``where`` is ``file:line``, for messages.
        image: the image path as the file wrote it; ``image_path`` resolved.
        question: the question text.
        answer, foil: target and competing token, or None.
        answer_text, answer_token_index: read out at token ``answer_token_index``
            (default 0) of this answer text (teacher forcing, core.answer_text),
            or None: the first token after the prompt.
        target_mask: resolved path of the region mask (white = region, the
            image's size; :func:`load_pair_mask`), or None.
        id, kind, template: free-text labels, or None.
        row: the line's JSON object as read (every key, for readers of further fields).
    """

    index: int
    line: int
    where: str
    image: str
    image_path: Path
    question: str
    answer: str | None = None
    foil: str | None = None
    target_mask: Path | None = None
    answer_text: str | None = None
    answer_token_index: int | None = None
    id: str | None = None
    kind: str | None = None
    template: str | None = None
    row: dict | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict:
        """The fields as a plain dict (paths stay :class:`~pathlib.Path`; the raw ``row`` left out)."""
        d = asdict(self)
        d.pop("row")
        return d


def pairs_file(path: str | Path, what: str = "pairs file") -> Path:
    """The JSONL file of ``path``: the file itself, or in a folder its
    ``dataset.jsonl`` or its one ``*.jsonl``. A missing file is left to
    :func:`read_jsonl` to name."""
    p = Path(path)
    if not p.is_dir():
        return p
    if (p / DATASET_JSONL).is_file():
        return p / DATASET_JSONL
    found = sorted(f for f in p.glob("*.jsonl") if f.is_file())
    if len(found) != 1:
        raise InputFileError(
            f"{p}: is a folder, not a {what}; expected {DATASET_JSONL} or exactly one *.jsonl in it, found {len(found)}"
        )
    return found[0]


def index_field(row: dict, key: str, where: str) -> int | None:
    """``row[key]`` as a non-negative integer, or None when absent or null."""
    value = row.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputFileError(f'{where}: "{key}" must be a non-negative integer, got {json.dumps(value)[:40]}')
    return value


def _label(row: dict, key: str) -> str | None:
    """A free-text label (id, kind, template): any JSON scalar, as text."""
    v = row.get(key)
    return None if v is None else str(v)


def read_pairs(
    path: str | Path, *, limit: int | None = None, what: str = "pairs file", progress: Progress = None
) -> list[Pair]:
    """The pairs of a JSONL file or folder (:func:`pairs_file`), in file order.

    Args:
        limit: only the first N pairs (later lines are not checked).
        what: the file's role in messages ("pairs file", "dataset file").
        progress: ``progress(lines read, lines, message)``, every
            :data:`PROGRESS_EVERY` lines (a file of a million lines takes seconds).

    Every problem is one :class:`InputFileError` naming the file and the line;
    a file without any pair is one too, and so is one of over :data:`MAX_PAIRS`.
    """
    f = pairs_file(path, what)
    pairs: list[Pair] = []
    beside: dict[str, Path] = {}  # each path named once is resolved once (a million lines may share one image)

    def resolved(name: str, where: str, key: str) -> Path:
        if name not in beside:
            beside[name] = resolve_beside(f, name, where, key)
        return beside[name]

    def lines_read(done: int, total: int) -> None:
        progress(done, total, f"reading {f.name}: line {done:,} of {total:,}")

    for n, row in read_jsonl(f, what, lines_read if progress is not None else None):
        if limit is not None and len(pairs) >= limit:
            break
        where = f"{f}:{n}"
        if len(pairs) >= MAX_PAIRS:
            raise InputFileError(f"{where}: over {MAX_PAIRS:,} pairs, the most one file may hold; split the {what}")
        image = text_field(row, "image", where)
        question = text_field(row, "question", where)
        answer = text_field(row, "answer", where, required=False)
        foil = text_field(row, "foil", where, required=False)
        mask = text_field(row, "target_mask", where, required=False)
        answer_text = text_field(row, "answer_text", where, required=False)
        token_index = index_field(row, "answer_token_index", where)
        if token_index is not None and answer_text is None:
            raise InputFileError(f'{where}: "answer_token_index" needs an "answer_text"')
        pairs.append(
            Pair(
                index=len(pairs),
                line=n,
                where=where,
                image=image,
                image_path=resolved(image, where, "image"),
                question=question,
                answer=answer,
                foil=foil,
                target_mask=resolved(mask, where, "target_mask") if mask else None,
                answer_text=answer_text,
                answer_token_index=token_index,
                id=_label(row, "id"),
                kind=_label(row, "kind"),
                template=_label(row, "template"),
                row=row,
            )
        )
    if not pairs:
        raise InputFileError(f"{f}: no pairs (the file has no non-blank line)")
    return pairs


@contextmanager
def _naming_the_line(pair: Pair):
    """An ImageLoadError inside names the pairs file's line
    (``pairs.jsonl:3: images/a.png: no such file``)."""
    try:
        yield
    except ImageLoadError as e:
        if pair.where is None:
            raise
        raise ImageLoadError(f"{pair.where}: {e}") from None


def load_pair_image(pair: Pair) -> Image.Image:
    """The image of one pair, decoded (:func:`core.files.images.load_image`); a failure names the line."""
    from core.files.images import load_image  # function-local: PIL, off the parser's path

    with _naming_the_line(pair):
        return load_image(pair.image_path)


def check_pair_image(pair: Pair) -> Path:
    """The image path of one pair after its header's checks
    (:func:`core.files.images.check_image_file`, no decoding); a failure names the line."""
    from core.files.images import check_image_file  # function-local: PIL, off the parser's path

    with _naming_the_line(pair):
        check_image_file(pair.image_path)
    return pair.image_path


def check_pair_images(pairs: list[Pair], progress: Progress = None) -> list[Path]:
    """:func:`check_pair_image` of every pair, in order, each distinct image
    file once; ``progress(done, pairs, message)`` every :data:`PROGRESS_EVERY`
    pairs. The first failure names its line."""
    checked: set[Path] = set()
    for done, pair in enumerate(pairs, 1):
        if pair.image_path not in checked:
            check_pair_image(pair)
            checked.add(pair.image_path)
        if progress is not None and (done % PROGRESS_EVERY == 0 or done == len(pairs)):
            progress(done, len(pairs), f"checking images: {done:,} of {len(pairs):,}")
    return [p.image_path for p in pairs]


def load_pair_mask(pair: Pair, size: tuple[int, int], path: Path | None = None) -> np.ndarray | None:
    """The pair's region mask (or the mask at ``path``, another of its line's
    masks) as ``(H, W)`` bool (white is inside), or None without one. It must
    have the image's ``size = (width, height)``; an empty mask is allowed. A
    failure names the line."""
    path = pair.target_mask if path is None else path
    if path is None:
        return None
    from core.files.images import load_mask  # function-local: numpy and PIL, off the parser's path

    with _naming_the_line(pair):
        mask = load_mask(path)
        if (mask.shape[1], mask.shape[0]) != tuple(size):
            raise ImageLoadError(
                f"{path}: mask is {mask.shape[1]}x{mask.shape[0]}, the image is {size[0]}x{size[1]}; they must match"
            )
    return mask
