"""Byte-level builders of hostile (and minimal well-formed) image files, for
the trust tests and the fuzz corpus. Each returns the file's bytes; nothing
here decodes anything."""

from __future__ import annotations

import io
import struct
import zlib

SHORT, LONG = 3, 4  # TIFF field types


def tiff_bytes(
    width: int,
    height: int,
    *,
    samples: int = 3,
    bits: int = 8,
    compression: int = 8,
    rows_per_strip: int | None = None,
    tile: tuple[int, int] | None = None,
    data: bytes | None = None,
) -> bytes:
    """A little-endian TIFF with ONE strip (or one tile) holding ``data``
    (default: 16x16 deflated zero pixels), whatever size it declares.

    Args:
        compression: 1 raw, 8 deflate, 32773 packbits (libtiff decodes all but raw).
        rows_per_strip: rows the one strip declares (default: the whole height).
        tile: ``(tile_width, tile_length)`` to write one tile instead of a strip.
    """
    if data is None:
        data = zlib.compress(b"\0" * (16 * 16 * samples * max(1, bits // 8)))
    data_at = 8
    arrays = b""
    arrays_at = data_at + len(data) + len(data) % 2

    def out_of_line(payload: bytes) -> int:
        nonlocal arrays
        offset = arrays_at + len(arrays)
        arrays += payload + b"\0" * (len(payload) % 2)
        return offset

    entries = [(256, LONG, 1, width), (257, LONG, 1, height)]
    if samples == 1:
        entries.append((258, SHORT, 1, bits))
    else:
        entries.append((258, SHORT, samples, ("at", out_of_line(struct.pack(f"<{samples}H", *[bits] * samples)))))
    entries += [(259, SHORT, 1, compression), (262, SHORT, 1, 2 if samples >= 3 else 1), (277, SHORT, 1, samples)]
    if tile is None:
        rows = height if rows_per_strip is None else rows_per_strip
        entries += [(273, LONG, 1, data_at), (278, LONG, 1, rows), (279, LONG, 1, len(data))]
    else:
        entries += [(322, LONG, 1, tile[0]), (323, LONG, 1, tile[1])]
        entries += [(324, LONG, 1, data_at), (325, LONG, 1, len(data))]
    ifd_at = arrays_at + len(arrays)
    ifd = struct.pack("<H", len(entries))
    for tag, kind, count, value in sorted(entries):
        if isinstance(value, tuple):
            ifd += struct.pack("<HHII", tag, kind, count, value[1])
        elif kind == SHORT:
            ifd += struct.pack("<HHIHH", tag, kind, count, value, 0)
        else:
            ifd += struct.pack("<HHII", tag, kind, count, value)
    ifd += struct.pack("<I", 0)
    return b"II*\0" + struct.pack("<I", ifd_at) + data + b"\0" * (len(data) % 2) + arrays + ifd


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bytes(width: int, height: int, *, color_type: int = 2, bit_depth: int = 8) -> bytes:
    """A complete PNG of mid-grey pixels (filter 0 rows), compressed at level 9:
    a 1 x 200,000 one is under 1 KB."""
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color_type]
    row = b"\0" + b"\x80" * (width * channels * bit_depth // 8)
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(row * height, 9))
        + png_chunk(b"IEND", b"")
    )


def dds_bytes(width: int = 4, height: int = 4, fourcc: bytes = b"ZZZZ") -> bytes:
    """A DDS header whose compressed pixel format (FourCC) Pillow does not
    implement: its plugin raises NotImplementedError while opening."""
    pixel_format = struct.pack("<II4sI4I", 32, 0x4, fourcc, 0, 0, 0, 0, 0)  # DDPF_FOURCC
    header = struct.pack("<7I", 124, 0x1007, height, width, 0, 0, 0) + b"\0" * 44 + pixel_format + b"\0" * 20
    return b"DDS " + header + b"\0" * (width * height)


def eps_bytes() -> bytes:
    """An EPS file: Pillow would hand it to Ghostscript to rasterise."""
    return (
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n%%EndComments\n"
        b"newpath 0 0 moveto 10 10 lineto stroke\nshowpage\n%%EOF\n"
    )


def jpeg_bytes(width: int, height: int, **save_options) -> bytes:
    from PIL import Image

    img = Image.new("RGB", (width, height), (120, 30, 200))
    buffer = io.BytesIO()
    img.save(buffer, "JPEG", **save_options)
    return buffer.getvalue()


def jpeg_with_repeated_scans(width: int, height: int, repeats: int) -> bytes:
    """A progressive JPEG whose last scan is repeated ``repeats`` more times:
    libjpeg only warns, and rescans the whole image each time."""
    data = jpeg_bytes(width, height, progressive=True, quality=90)
    last_scan = data[data.rindex(b"\xff\xda") : -2]  # up to the end-of-image marker
    return data[:-2] + last_scan * repeats + b"\xff\xd9"
