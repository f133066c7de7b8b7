"""Safe image loading: every mode to RGB, EXIF applied, bad files refused in one line."""

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from core.errors import ImageLoadError
from core.files.images import image_sha256, load_image


def _save(img, tmp_path, name, **kw):
    p = tmp_path / name
    img.save(p, **kw)
    return p


def test_exif_orientation_is_applied(tmp_path):
    img = Image.new("RGB", (20, 10), (255, 0, 0))
    img.paste((0, 0, 255), (0, 0, 5, 10))  # blue stripe on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    p = _save(img, tmp_path, "rot.jpg", exif=exif, quality=95)
    out = load_image(p)
    assert out.size == (10, 20)
    top = np.asarray(out)[:3].mean(axis=(0, 1))
    assert top[2] > 150 and top[0] < 100, "the left stripe is on top after rotating 90 CW"


@pytest.mark.parametrize(
    "mode,color",
    [
        ("RGBA", (10, 20, 30, 255)),
        ("P", 3),
        ("CMYK", (0, 255, 255, 0)),
        ("L", 128),
        ("LA", (128, 255)),
        ("I;16", 65535),
    ],
)
def test_modes_become_rgb(tmp_path, mode, color):
    img = Image.new(mode, (8, 6), color)
    ext = "jpg" if mode == "CMYK" else "png" if mode != "LA" else "png"
    if mode == "CMYK":
        ext = "tiff"
    out = load_image(_save(img, tmp_path, f"x.{ext}"))
    assert out.mode == "RGB" and out.size == (8, 6)
    if mode == "I;16":
        assert np.asarray(out).min() == 255, "16-bit full scale maps to 255"
    if mode == "CMYK":
        assert tuple(np.asarray(out)[0, 0]) == (255, 0, 0)


def test_transparent_pixels_composite_on_white(tmp_path):
    out = load_image(_save(Image.new("RGBA", (4, 4), (0, 0, 0, 0)), tmp_path, "t.png"))
    assert np.asarray(out).min() == 255


def test_truncated_png_is_refused(tmp_path):
    good = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(good, "PNG")
    p = tmp_path / "cut.png"
    p.write_bytes(good.getvalue()[: len(good.getvalue()) // 2])
    with pytest.raises(ImageLoadError, match="corrupt or truncated") as e:
        load_image(p)
    assert "\n" not in str(e.value)


def test_non_image_and_missing_and_empty(tmp_path):
    (tmp_path / "a.png").write_text("this is not a picture")
    with pytest.raises(ImageLoadError, match="not an image"):
        load_image(tmp_path / "a.png")
    with pytest.raises(ImageLoadError, match="no such file"):
        load_image(tmp_path / "missing.png")
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(ImageLoadError, match="empty"):
        load_image(tmp_path / "empty.png")


def _png_header_only(width, height):
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def test_decompression_bomb_is_refused(tmp_path):
    p = tmp_path / "bomb.png"
    p.write_bytes(_png_header_only(100_000, 100_000))
    with pytest.raises(ImageLoadError, match="bomb"):
        load_image(p)


def test_arrays_and_hash():
    arr = np.zeros((5, 7, 3), np.uint8)
    img = load_image(arr)
    assert img.size == (7, 5)
    assert image_sha256(img) == image_sha256(load_image(arr.copy()))
    with pytest.raises(ImageLoadError):
        load_image(np.zeros((5, 7), np.float32))
