"""Write the seed corpus of the load_image fuzzer (tests/fuzz/corpus/load_image/):
small files of every accepted format and mode, and hostile ones of each kind
load_image refuses. Re-run after changing it; the inputs the fuzzer found live
beside them as ``crash-*`` / ``timeout-*`` and are kept.

    .venv/bin/python tests/fuzz/make_corpus.py
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
from PIL import Image

from tests.fuzz.hostile_images import (
    dds_bytes,
    eps_bytes,
    jpeg_with_repeated_scans,
    png_bytes,
    tiff_bytes,
)

CORPUS = Path(__file__).parent / "corpus" / "load_image"


def _pattern(width: int = 12, height: int = 8) -> np.ndarray:
    """(height, width, 4) uint8: a colour gradient with a partly transparent alpha."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 20 % 256, y * 30 % 256, (x + y) * 10 % 256, (x * 40 + 15) % 256], axis=-1).astype(np.uint8)


def _saved(img: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, fmt, **options)
    return buffer.getvalue()


def well_formed() -> dict[str, bytes]:
    rgba = Image.fromarray(_pattern())
    rgb, grey = rgba.convert("RGB"), rgba.convert("L")
    palette = rgb.quantize(16)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW to display
    wide16 = Image.fromarray(np.arange(96, dtype=np.uint16).reshape(8, 12) * 600)  # I;16
    frames = [palette, rgb.rotate(90).quantize(16)]
    return {
        "rgb.png": _saved(rgb, "PNG"),
        "rgba.png": _saved(rgba, "PNG"),
        "palette-trns.png": _saved(palette, "PNG", transparency=0),
        "grey16.png": _saved(wide16, "PNG"),
        "apng.png": _saved(frames[0], "PNG", save_all=True, append_images=frames[1:]),
        "baseline.jpg": _saved(rgb, "JPEG", quality=80),
        "progressive.jpg": _saved(rgb, "JPEG", progressive=True),
        "exif-rotated.jpg": _saved(rgb, "JPEG", exif=exif),
        "cmyk.jpg": _saved(rgb.convert("CMYK"), "JPEG"),
        "two-pictures.mpo": _saved(rgb, "MPO", save_all=True, append_images=[rgb.rotate(180)]),
        "grey.jpg": _saved(grey, "JPEG"),
        "lossy.webp": _saved(rgb, "WEBP", quality=50),
        "lossless-alpha.webp": _saved(rgba, "WEBP", lossless=True),
        "animated.gif": _saved(frames[0], "GIF", save_all=True, append_images=frames[1:], transparency=0),
        "rgb.bmp": _saved(rgb, "BMP"),
        "palette.bmp": _saved(palette, "BMP"),
        "deflate.tif": _saved(rgb, "TIFF", compression="tiff_adobe_deflate"),
        "lzw-rgba.tif": _saved(rgba, "TIFF", compression="tiff_lzw"),
        "raw-cmyk.tif": _saved(rgb.convert("CMYK"), "TIFF"),
        "float.tif": _saved(Image.fromarray(np.linspace(-1, 3, 96, dtype=np.float32).reshape(8, 12)), "TIFF"),
        "tiled.tif": tiff_bytes(16, 16, tile=(16, 16)),
        "jpeg.tif": _saved(rgb, "TIFF", compression="jpeg"),
        "rgb.ppm": _saved(rgb, "PPM"),
        "grey16.pgm": _saved(wide16, "PPM"),
        "bitmap.pbm": _saved(grey.convert("1"), "PPM"),
        "plain.pgm": b"P2\n3 2\n255\n0 128 255\n255 128 0\n",
        "float.pfm": _saved(Image.fromarray(np.linspace(0, 1, 96, dtype=np.float32).reshape(8, 12)), "PPM"),
    }


def hostile() -> dict[str, bytes]:
    png = png_bytes(12, 8)
    return {
        "truncated.png": png[: len(png) // 2],
        "truncated.jpg": _saved(Image.fromarray(_pattern()).convert("RGB"), "JPEG")[:200],
        "tall-one-strip.tif": tiff_bytes(
            16, 2_686_988, samples=1, bits=32, compression=1, rows_per_strip=16, data=b"\x40" * (16 * 16 * 4)
        ),
        "one-strip-8000.tif-header": tiff_bytes(8000, 8000, samples=1, bits=32, data=b"x\x9c\x03\x00\x00\x00\x00\x01"),
        "huge-tile.tif": tiff_bytes(16, 16, tile=(16384, 16384)),
        "wide-1x200000.png": png_bytes(1, 200_000),
        "zero-width.png": png_bytes(0, 4),
        "many-scans.jpg": jpeg_with_repeated_scans(16, 16, 150),
        "unimplemented.dds": dds_bytes(),
        "ghostscript.eps": eps_bytes(),
        "text.png": b"this is not a picture",
    }


def main() -> None:
    CORPUS.mkdir(parents=True, exist_ok=True)
    files = {**well_formed(), **hostile()}
    for name, data in files.items():
        (CORPUS / name).write_bytes(data)
    total = sum(p.stat().st_size for p in CORPUS.iterdir())
    print(f"{len(files)} seeds written to {CORPUS} ({total:,} bytes in the folder)")


if __name__ == "__main__":
    main()
