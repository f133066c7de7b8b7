"""Safe image loading: every accepted file comes back as an RGB ``PIL.Image``
with EXIF orientation applied; anything else is an :class:`ImageLoadError`
with a one-line reason naming the file.

The work is bounded before anything is decoded: Pillow reads only the header,
then the declared size, aspect ratio and the memory the decoder will allocate
are checked against the limits below. Any exception a decoder raises
afterwards (Pillow's plugins raise OSError, SyntaxError, ValueError, but also
struct.error, EOFError, IndexError, KeyError, TypeError, NotImplementedError,
MemoryError, ...) becomes an ImageLoadError too. What the decoders say on the
way (Pillow's warnings and log lines, libtiff's lines on file descriptor 2)
never reaches the terminal by itself: it is one :class:`ImageWarning` naming
the file, or the detail of the ImageLoadError."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import logging
import os
import struct
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from core.errors import ImageLoadError
from core.files.input_files import open_regular_file

# The formats images for a VLM come in: datasets (COCO, VQAv2, GQA, TextVQA:
# JPEG; CLEVR, DocVQA, screenshots: PNG), the web (WebP, GIF), scientific and
# scanned images (TIFF), tools' raw output (PPM/PGM/PBM, BMP). Pillow's other
# plugins are refused by name: DDS, PSD, ICNS, FITS, SGI, TGA, PCX, BLP, FLI,
# ... are texture, print or legacy formats with rarely exercised decoders
# (DDS raised NotImplementedError at start-up), and EPS/PS would run
# Ghostscript, an external program, on the file. "JPEG" also opens MPO (phone
# photos with a second picture); only its first picture is read.
ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "PPM")
_ACCEPTED_NAMES = "PNG, JPEG, WebP, GIF, BMP, TIFF, PPM/PGM/PBM"

# Width x height limit. No processor here feeds the model more than Qwen2-VL's
# default max_pixels (12,845,056); the others downsample to ~2M or fewer, so
# pixels beyond that never reach the model. 40M still admits 8K UHD frames
# (7680x4320 = 33.2M, the HR-Bench 8K images, the largest in common VLM
# benchmarks) and 36-megapixel photos; larger ones are refused with a hint to
# downscale rather than decoded into gigabytes (8000x8000 32-bit TIFF: 2.2 GB).
MAX_PIXELS = 40_000_000

# Longest / shortest side. Qwen2-VL's smart_resize refuses more than 200, and a
# shortest-edge resize (LLaVA's CLIP processor, open_clip's CoCa transform)
# scales the short side up to S: S*S*200 pixels is 22.6M at S = 336, but a
# 1x200,000 image would become 336x67,200,000 (10 GB at S = 128).
MAX_ASPECT_RATIO = 200

# Bytes alive at the peak of decoding one frame, per pixel, for the worst
# well-formed file of an accepted format: WebP, whose frame (4 bytes: Pillow
# stores every multi-band mode in 4) comes from libwebp's two RGBA canvases
# (current and previous frame) through a bytes copy, 16 in all (measured: 607 MB
# for 6000x6600). A progressive CMYK JPEG (4 + 8 of coefficients) or a
# one-strip 16-bit RGBA TIFF (4 + 8 of strip) needs 12. So every well-formed
# file within MAX_PIXELS fits; what goes over is a buffer the file declares
# beyond its pixels (a 16x16 TIFF with one 16384x16384 tile: 770 MB).
MAX_DECODE_BYTES = 16 * MAX_PIXELS

# An uncompressed 16-bit RGBA frame of MAX_PIXELS (8 bytes a pixel) is the
# largest well-formed single-frame file; multi-page stacks beyond it are
# refused (we would read only page 0). Also bounds the header parsing done in
# Python (chunk, block and token loops cost about 0.15 s per MB at worst).
MAX_FILE_BYTES = 8 * MAX_PIXELS

# A progressive JPEG is decoded once per scan over the whole coefficient
# buffer: 1,000 repeated scans (31 bytes each) made a 172 KB file take 9 s at
# 4000x4000. Encoders write about 10 (libjpeg's default script); EXIF
# thumbnails add their own.
MAX_JPEG_SCANS = 100

# Rows are converted to RGB in bands of about this many pixels, so a large
# 16-bit, float or transparent image costs its temporaries for one band only.
_BAND_PIXELS = 1 << 20

_TIFF_BITS_PER_SAMPLE, _TIFF_SAMPLES_PER_PIXEL, _TIFF_ROWS_PER_STRIP = 258, 277, 278
_TIFF_TILE_WIDTH, _TIFF_TILE_LENGTH, _TIFF_STRIP_OFFSETS, _TIFF_TILE_OFFSETS = 322, 323, 273, 324


def _row_bands(height: int, width: int) -> Iterator[tuple[int, int]]:
    """``(top, bottom)`` row ranges covering the image, ~_BAND_PIXELS each."""
    rows = max(1, _BAND_PIXELS // max(1, width))
    for top in range(0, height, rows):
        yield top, min(height, top + rows)


def _band(img: Image.Image, top: int, bottom: int) -> Image.Image:
    return img.crop((0, top, img.width, bottom))


def _scaled_to_rgb(img: Image.Image) -> Image.Image:
    """'I;16*' (full 16-bit scale), 'I' and 'F' (their own min..max) -> RGB,
    band by band with the same float64 arithmetic as a whole-image pass."""
    w, h = img.size
    if img.mode.startswith("I;16"):
        lo, hi = 0.0, 65535.0
    else:
        lo, hi = np.inf, -np.inf
        for top, bottom in _row_bands(h, w):
            arr = np.asarray(_band(img, top, bottom), dtype=np.float64)
            lo, hi = min(lo, float(arr.min())), max(hi, float(arr.max()))
        if not (np.isfinite(lo) and np.isfinite(hi)):
            raise ImageLoadError(f"{img.mode} image has NaN or infinite pixels, which have no 8-bit value")
    grey = np.empty((h, w), np.uint8)
    for top, bottom in _row_bands(h, w):
        if hi <= lo:
            grey[top:bottom] = 0
            continue
        arr = np.asarray(_band(img, top, bottom), dtype=np.float64)
        grey[top:bottom] = np.clip(np.rint((arr - lo) / (hi - lo) * 255.0), 0, 255).astype(np.uint8)
    return Image.fromarray(grey).convert("RGB")


def _composited_on_white(img: Image.Image) -> Image.Image:
    """A mode with alpha -> RGB over opaque white, band by band (the result is
    per pixel, so identical to compositing the whole image at once)."""
    out = Image.new("RGB", img.size)
    for top, bottom in _row_bands(img.height, img.width):
        rgba = _band(img, top, bottom).convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        out.paste(Image.alpha_composite(background, rgba).convert("RGB"), (0, top))
    return out


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode -> 8-bit RGB. Transparency is composited on white;
    16-bit and float greyscale are rescaled to their full range.

    Raises:
        ImageLoadError: float pixels that are NaN or infinite; a mode Pillow
            cannot convert.
    """
    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        return _scaled_to_rgb(img)
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        return _composited_on_white(img)
    return img.convert("RGB")


def _stored_bytes_per_pixel(mode: str) -> int:
    """Bytes a pixel of ``mode`` takes in Pillow's memory: every multi-band mode
    is stored in 4 (RGB too), 16-bit greyscale in 2, 'I' and 'F' in 4."""
    if mode in ("1", "L", "P"):
        return 1
    if mode.startswith("I;16"):
        return 2
    return 4


def _tiff_tag(img: Image.Image, tag: int, default: int) -> int:
    value = img.tag_v2.get(tag, default)
    if isinstance(value, tuple):
        value = max(value) if value else default
    return int(value)


def _tiff_buffer_bytes(img: Image.Image) -> int:
    """The buffer libtiff decodes one strip or tile into (Pillow hands it every
    compressed TIFF): tile or strip area x samples x bytes per sample, at least
    4 bytes a pixel (its RGBA path). Tiles may be declared far larger than the
    image; strips are cut at the image's height."""
    if not getattr(img, "use_load_libtiff", False):
        return 0  # uncompressed: read straight into the frame
    sample_bytes = -(-_tiff_tag(img, _TIFF_BITS_PER_SAMPLE, 1) // 8)
    pixel_bytes = max(4, _tiff_tag(img, _TIFF_SAMPLES_PER_PIXEL, 1) * sample_bytes)
    if _TIFF_TILE_WIDTH in img.tag_v2:
        area = _tiff_tag(img, _TIFF_TILE_WIDTH, 0) * _tiff_tag(img, _TIFF_TILE_LENGTH, 0)
    else:
        area = img.width * min(img.height, _tiff_tag(img, _TIFF_ROWS_PER_STRIP, img.height))
    return area * pixel_bytes


def _jpeg_streams(img: Image.Image) -> int:
    """How many JPEG streams the file holds by design: one, one per picture of
    an MPO, one per strip or tile of a JPEG-compressed TIFF; 0 for others."""
    if img.format == "JPEG":
        return 1
    if img.format == "MPO":  # a JPEG per picture, listed in its header
        return max(1, getattr(img, "n_frames", 1))
    if img.format == "TIFF" and getattr(img, "_compression", "") in ("jpeg", "tiff_jpeg"):
        offsets = img.tag_v2.get(_TIFF_TILE_OFFSETS, img.tag_v2.get(_TIFF_STRIP_OFFSETS, ()))
        return max(1, len(offsets) if isinstance(offsets, tuple) else 1)
    return 0


def _count_in_file(fp: BinaryIO, needle: bytes) -> int:
    """Occurrences of a 2-byte ``needle`` in the whole file, read in 1 MB
    blocks; the file position is kept."""
    position, count, tail = fp.tell(), 0, b""
    fp.seek(0)
    while block := fp.read(1 << 20):
        block = tail + block
        count += block.count(needle)
        tail = block[-1:]  # a marker split across two blocks
    fp.seek(position)
    return count


def _check_size(name: str, size: tuple[int, int]) -> None:
    """Refuse an empty, too large or too elongated ``(width, height)``."""
    w, h = size
    if w < 1 or h < 1:
        raise ImageLoadError(f"{name}: the image has no pixels ({w}x{h})")
    if w * h > MAX_PIXELS:
        raise ImageLoadError(
            f"{name}: {w}x{h} is {w * h:,} pixels, over the {MAX_PIXELS:,}-pixel limit "
            "(decompression bomb? downscale it first)"
        )
    if max(w, h) / min(w, h) > MAX_ASPECT_RATIO:
        raise ImageLoadError(
            f"{name}: {w}x{h} has an aspect ratio of {max(w, h) / min(w, h):,.0f}:1, over the "
            f"{MAX_ASPECT_RATIO}:1 the models' image processors handle (crop or pad it first)"
        )


def _check_decode_cost(name: str, img: Image.Image, fp: BinaryIO) -> None:
    """Refuse, from the header alone, a file whose decode of frame 0 (the only
    one read) would allocate over MAX_DECODE_BYTES or rescan a JPEG over
    MAX_JPEG_SCANS times."""
    pixels = img.width * img.height
    frame = pixels * _stored_bytes_per_pixel(img.mode)
    buffers = 0
    if img.format == "TIFF":
        buffers = _tiff_buffer_bytes(img)
    elif img.format == "WEBP":
        buffers = pixels * 12  # libwebp's two RGBA canvases, then a bytes copy of one
    streams = _jpeg_streams(img)
    if streams:
        scans = _count_in_file(fp, b"\xff\xda")  # start-of-scan markers
        if scans > MAX_JPEG_SCANS * streams:
            raise ImageLoadError(
                f"{name}: {scans:,} JPEG scans, over the {MAX_JPEG_SCANS} a stream may have "
                "(each rescans the whole image)"
            )
        if img.format != "TIFF" and scans > 1:  # a multi-scan JPEG keeps all its coefficients
            buffers = pixels * 2 * getattr(img, "layers", 3)
    # After the decoder: an EXIF rotation copies the frame; then the RGB result.
    converted = 4 * pixels + (4 * pixels if img.mode == "P" and "transparency" in img.info else 0)
    peak = frame + max(buffers, frame, converted)
    if peak > MAX_DECODE_BYTES:
        raise ImageLoadError(
            f"{name}: decoding this {img.width}x{img.height} {img.format} would take {peak / 1e6:,.0f} MB, "
            f"over the {MAX_DECODE_BYTES / 1e6:,.0f} MB limit (the decoder's own buffers: {buffers / 1e6:,.0f} MB)"
        )


def _reason(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if not isinstance(e, (OSError, SyntaxError, ValueError)):
        text = f"{type(e).__name__}: {text}"
    return text if len(text) <= 160 else text[:157] + "..."


def _sniffed_format(fp: BinaryIO) -> str | None:
    """The Pillow format whose magic bytes start the file (only the plugins'
    prefix checks run, none of their parsing), or None."""
    try:
        fp.seek(0)
        prefix = fp.read(16)
    except (OSError, ValueError):  # the file went away or broke while we read it
        return None
    Image.init()
    for fmt in Image.ID:
        accept = Image.OPEN[fmt][1]
        try:
            if accept is not None and accept(prefix):
                return fmt
        except Exception:  # a plugin's magic check on a short prefix
            continue
    return None


def _refused_format(name: str, fp: BinaryIO, suffix: str) -> ImageLoadError:
    """The error for a file no accepted plugin opened: a damaged header of an
    accepted format, a format we refuse (named by the file's extension, else
    guessed from its first bytes: magic numbers are short and shared, a TGA
    starts like a CUR), or not an image."""
    sniffed = _sniffed_format(fp)
    if sniffed in ACCEPTED_FORMATS:
        return ImageLoadError(f"{name}: corrupt or truncated {sniffed} image (its header cannot be read)")
    by_extension = Image.registered_extensions().get(suffix.lower())
    if by_extension and by_extension not in ACCEPTED_FORMATS:
        return ImageLoadError(f"{name}: {by_extension} images are not accepted (accepted: {_ACCEPTED_NAMES})")
    if sniffed:
        return ImageLoadError(
            f"{name}: looks like {sniffed} by its first bytes, not an accepted format ({_ACCEPTED_NAMES})"
        )
    return ImageLoadError(f"{name}: not an image file in an accepted format ({_ACCEPTED_NAMES})")


def _image_error(name: str, fp: BinaryIO, suffix: str, e: Exception) -> ImageLoadError:
    """The one-line ImageLoadError for anything opening or decoding raised."""
    if isinstance(e, ImageLoadError):
        return e
    if isinstance(e, UnidentifiedImageError):
        return _refused_format(name, fp, suffix)
    if isinstance(e, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return ImageLoadError(f"{name}: refused as a decompression bomb ({e})")
    if isinstance(e, MemoryError):
        return ImageLoadError(f"{name}: out of memory while decoding the image")
    if isinstance(e, (OSError, SyntaxError, ValueError, EOFError, struct.error)):
        return ImageLoadError(f"{name}: corrupt or truncated image ({_reason(e)})")
    # any other decoder failure (IndexError, KeyError, NotImplementedError, ...)
    return ImageLoadError(f"{name}: cannot decode this {_sniffed_format(fp) or 'image'} file ({_reason(e)})")


def _open_checked(name: str, fp: BinaryIO, suffix: str = "", decode: bool = True) -> Image.Image:
    """The header read and checked (format, size, decode cost) and, with
    ``decode``, frame 0 decoded; every failure an ImageLoadError."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            Image.init()  # a Pillow built without a plugin (WebP) must not break the others
            img = Image.open(fp, formats=[fmt for fmt in ACCEPTED_FORMATS if fmt in Image.OPEN])
            _check_size(name, img.size)
            _check_decode_cost(name, img, fp)
            if decode:
                img.load()  # decode now so truncation is caught here
            return img
    except Exception as e:
        raise _image_error(name, fp, suffix, e) from None


class ImageWarning(UserWarning):
    """A decoder complained about a file it still read (Pillow's "Corrupt EXIF
    data", a libtiff warning): one line naming the file."""


_ABOUT_CODE = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)  # not what a file holds
_MAX_DECODER_OUTPUT = 64 * 1024  # bytes of a decoder's stderr kept; the rest is dropped with the file
_capturing = threading.local()  # .active: this thread is inside _decoder_messages
_FD2_LOCK = threading.Lock()
_fd2_sink = None  # (pid, the temporary file fd 2 points at during a capture)


@contextlib.contextmanager
def _fd2_captured() -> Iterator[list[str]]:
    """What is written to file descriptor 2 inside the block (libtiff prints
    its errors and warnings there from C, past Python), as lines, instead of
    the terminal. Process-wide while it lasts (one descriptor), so a lock keeps
    threads' captures apart; without a usable fd 2 or temporary file nothing
    is captured."""
    global _fd2_sink
    lines: list[str] = []
    with _FD2_LOCK:
        try:
            sys.stderr.flush()
        except (AttributeError, OSError, ValueError):
            pass
        try:
            if _fd2_sink is None or _fd2_sink[0] != os.getpid():  # one per process: a file per image costs more
                _fd2_sink = (os.getpid(), tempfile.TemporaryFile())
                atexit.register(_fd2_sink[1].close)
            sink = _fd2_sink[1].fileno()
            os.ftruncate(sink, 0)
            os.lseek(sink, 0, os.SEEK_SET)
            saved = os.dup(2)
        except OSError:  # no temporary folder, or no stderr at all
            yield lines
            return
        os.dup2(sink, 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.lseek(sink, 0, os.SEEK_SET)
            text = os.read(sink, _MAX_DECODER_OUTPUT).decode("utf-8", "replace")
            lines.extend(line.strip() for line in text.splitlines() if line.strip())


class _Collected(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.messages.append(record.getMessage())
        except Exception:  # bad format arguments: the text as given
            self.messages.append(str(record.msg))


@contextlib.contextmanager
def _pillow_logs_collected() -> Iterator[list[str]]:
    """Pillow's log records of warning level or above inside the block (its
    plugins log some refusals before raising: "More samples per pixel than can
    be decoded"), kept instead of printed."""
    logger = logging.getLogger("PIL")
    collected, propagate = _Collected(), logger.propagate
    logger.addHandler(collected)
    logger.propagate = False
    try:
        yield collected.messages
    finally:
        logger.removeHandler(collected)
        logger.propagate = propagate


@contextlib.contextmanager
def _decoder_messages(name: str) -> Iterator[None]:
    """Read ``name`` with what the decoders say (Python warnings, Pillow's log
    records, C libraries' lines on fd 2) kept off the terminal: after a success it is one
    :class:`ImageWarning` naming the file; an :class:`ImageLoadError` gets the
    first of it as its detail. Nested blocks add to the outer one."""
    if getattr(_capturing, "active", False):
        yield
        return
    _capturing.active = True
    said: list[str] = []
    raised: list[warnings.WarningMessage] = []
    try:
        with _fd2_captured() as printed, _pillow_logs_collected() as logged:
            with warnings.catch_warnings(record=True) as raised:
                warnings.simplefilter("always")
                try:
                    yield
                finally:
                    said = [str(w.message) for w in raised if not issubclass(w.category, _ABOUT_CODE)] + logged
        said += printed
    except ImageLoadError as e:
        said += printed
        if said:
            raise ImageLoadError(f"{e}; the decoder said: {_shortened(said[0])}") from None
        raise
    finally:
        _capturing.active = False
    for w in raised:  # about code, not the file: as if never held
        if issubclass(w.category, _ABOUT_CODE):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if said:
        more = f" (and {len(said) - 1} more)" if len(said) > 1 else ""
        warnings.warn(f"{name}: the decoder said: {_shortened(said[0])}{more}", ImageWarning, stacklevel=3)


def _shortened(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 200 else text[:197] + "..."


def _decode(name: str, fp: BinaryIO, suffix: str = "", finish=None):
    """Header, checks, frame 0, EXIF orientation, then ``finish(name, img)``
    (default: RGB); every failure an ImageLoadError. ``suffix``: the file's
    extension, to name a refused format. What the decoders say on the way is
    one ImageWarning (:func:`_decoder_messages`)."""
    with _decoder_messages(name):
        img = _open_checked(name, fp, suffix)
        try:
            ImageOps.exif_transpose(img, in_place=True)  # in place: no copy when there is nothing to turn
        except Exception as e:
            raise ImageLoadError(f"{name}: unreadable EXIF orientation ({_reason(e)})") from None
        return (finish or _converted)(name, img)


def _converted(name: str, img: Image.Image) -> Image.Image:
    try:
        return to_rgb(img)
    except ImageLoadError as e:
        raise ImageLoadError(f"{name}: {e}") from None
    except MemoryError:
        raise ImageLoadError(f"{name}: out of memory while converting the image to RGB") from None
    except Exception as e:
        raise ImageLoadError(f"{name}: cannot convert its {img.mode} pixels to RGB ({_reason(e)})") from None


def _open_regular_file(path: Path) -> BinaryIO:
    """``path`` opened for reading: a readable, regular (a FIFO is refused, not
    waited on), non-empty file of at most MAX_FILE_BYTES (core.files.input_files)."""
    fp = open_regular_file(path, ImageLoadError, max_bytes=MAX_FILE_BYTES)
    if os.fstat(fp.fileno()).st_size == 0:
        fp.close()
        raise ImageLoadError(f"{path}: file is empty")
    return fp


def load_image(source: str | Path | bytes | Image.Image | np.ndarray) -> Image.Image:
    """Open an image file (or bytes, array, PIL image) as RGB.

    Args:
        source: a path, the file's bytes, a PIL image, or a ``(H, W, 3)`` /
            ``(H, W)`` uint8 array (``(H, W, 4)``: RGBA, composited on white).

    Returns:
        An RGB image with EXIF orientation applied, at most MAX_PIXELS pixels
        and MAX_ASPECT_RATIO long.

    Raises:
        ImageLoadError: missing, unreadable or not a regular file; empty,
            truncated, corrupt, not an accepted format; too large, too
            elongated, or too costly to decode.
    """
    if isinstance(source, Image.Image):
        _check_size("image", source.size)
        with _decoder_messages("image"):  # its EXIF is parsed here
            try:
                img = ImageOps.exif_transpose(source)  # a copy: the caller's image is left as it is
            except Exception as e:
                raise ImageLoadError(f"image: unreadable EXIF orientation ({_reason(e)})") from None
            return _converted("image", img)
    if isinstance(source, np.ndarray):
        channels = source.shape[2] if source.ndim == 3 else None
        if source.dtype != np.uint8 or source.ndim not in (2, 3) or channels not in (None, 3, 4):
            raise ImageLoadError(
                f"image array must be uint8 (H, W), (H, W, 3) or (H, W, 4), got {source.dtype} {source.shape}"
            )
        _check_size("image array", (source.shape[1], source.shape[0]))
        return to_rgb(Image.fromarray(source))
    return _decode_file_or_bytes(source)


def _decode_file_or_bytes(source, finish=None):
    """:func:`_decode` of a path (a regular file, opened safely) or of bytes."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        with _open_regular_file(path) as fp:
            return _decode(str(path), fp, path.suffix, finish)
    if not isinstance(source, (bytes, bytearray, memoryview)):
        raise ImageLoadError(f"cannot load an image from a {type(source).__name__}")
    data = bytes(source)
    if not data:
        raise ImageLoadError("image bytes: file is empty")
    if len(data) > MAX_FILE_BYTES:
        raise ImageLoadError(f"image bytes: {len(data) / 1e6:,.0f} MB, over the {MAX_FILE_BYTES / 1e6:,.0f} MB limit")
    return _decode("image bytes", io.BytesIO(data), "", finish)


def check_image_file(path: str | Path) -> tuple[int, int]:
    """``(width, height)`` of an image file after every check :func:`load_image`
    makes before decoding (a regular file, an accepted format, the size,
    aspect and decode-cost limits), without decoding it: to refuse a bad file
    among many before anything loads, and decode each only when it is used.

    Raises:
        ImageLoadError: as :func:`load_image`, except for damage only decoding finds.
    """
    path = Path(path)
    with _open_regular_file(path) as fp, _decoder_messages(str(path)):
        return _open_checked(str(path), fp, path.suffix, decode=False).size


def _mask_pixels(name: str, img: Image.Image) -> np.ndarray:
    try:
        inside = np.asarray(img.convert("L")) >= 128
        if "A" in img.getbands():
            inside &= np.asarray(img.getchannel("A")) >= 128
        return inside
    except MemoryError:
        raise ImageLoadError(f"{name}: out of memory while reading the mask") from None
    except Exception as e:
        raise ImageLoadError(f"{name}: cannot read its {img.mode} pixels as a mask ({_reason(e)})") from None


def load_mask(source: str | Path | bytes) -> np.ndarray:
    """A painted region mask file (or its bytes) as an ``(H, W)`` bool array:
    white (luminance >= 128) is inside, and where the file has an alpha
    channel also alpha >= 128. Read with every check of :func:`load_image`
    (format, size, decode cost, EXIF orientation, so a mask lines up with its
    image as loaded).

    Raises:
        ImageLoadError: as :func:`load_image`.
    """
    return _decode_file_or_bytes(source, _mask_pixels)


def image_sha256(img: Image.Image) -> str:
    """SHA-256 of the RGB pixels and size (stable across file formats)."""
    h = hashlib.sha256(f"{img.size[0]}x{img.size[1]}:".encode())
    h.update(np.asarray(img.convert("RGB")).tobytes())
    return h.hexdigest()
