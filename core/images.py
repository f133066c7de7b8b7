"""Safe image loading: every accepted file comes back as an RGB ``PIL.Image``
with EXIF orientation applied; anything else is an :class:`ImageLoadError`
with a one-line reason."""

from __future__ import annotations

import hashlib
import io
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from core.errors import ImageLoadError

# Refuse images above this many pixels (PIL's own bomb limit is ~179M and only
# warns below twice that); a VLM never needs more than a few megapixels.
MAX_PIXELS = 64_000_000


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode -> 8-bit RGB. Transparency is composited on white;
    16-bit and float greyscale are rescaled to their full range."""
    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        lo, hi = float(arr.min()), float(arr.max())
        if img.mode.startswith("I;16"):
            lo, hi = 0.0, 65535.0
        scaled = np.zeros_like(arr) if hi <= lo else (arr - lo) / (hi - lo) * 255.0
        return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), "L").convert("RGB")
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def load_image(source: str | Path | bytes | Image.Image | np.ndarray) -> Image.Image:
    """Open an image file (or bytes, array, PIL image) as RGB.

    Args:
        source: a path, the file's bytes, a PIL image, or a ``(H, W, 3)`` /
            ``(H, W)`` uint8 array.

    Raises:
        ImageLoadError: missing, truncated, not an image, or too large.
    """
    if isinstance(source, Image.Image):
        return to_rgb(ImageOps.exif_transpose(source) or source)
    if isinstance(source, np.ndarray):
        if source.dtype != np.uint8 or source.ndim not in (2, 3):
            raise ImageLoadError(f"image array must be uint8 (H, W) or (H, W, 3), got {source.dtype} {source.shape}")
        return to_rgb(Image.fromarray(source))
    name = "image bytes"
    if isinstance(source, (str, Path)):
        path = Path(source)
        name = str(path)
        if not path.is_file():
            raise ImageLoadError(f"{name}: no such file")
        data = path.read_bytes()
    else:
        data = bytes(source)
    if not data:
        raise ImageLoadError(f"{name}: file is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > MAX_PIXELS:
                raise ImageLoadError(
                    f"{name}: {w}x{h} pixels is over the {MAX_PIXELS:,}-pixel limit (decompression bomb?)"
                )
            img.load()  # decode now so truncation is caught here
            img = ImageOps.exif_transpose(img) or img
            return to_rgb(img)
    except ImageLoadError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageLoadError(f"{name}: refused as a decompression bomb ({e})") from None
    except UnidentifiedImageError:
        raise ImageLoadError(f"{name}: not an image file PIL can read") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageLoadError(f"{name}: corrupt or truncated image ({e})") from None


def image_sha256(img: Image.Image) -> str:
    """SHA-256 of the RGB pixels and size (stable across file formats)."""
    h = hashlib.sha256(f"{img.size[0]}x{img.size[1]}:".encode())
    h.update(np.asarray(img.convert("RGB")).tobytes())
    return h.hexdigest()
