"""Fills of a region (:class:`Fill`): ``mean``, ``constant``, ``blur``,
``noise``, ``inpaint`` (harmonic) and ``paste``; every fill changes the
region's pixels only, the rest of the image stays bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from core.files.images import image_sha256, load_image
from core.methods.counterfactual.regions import RegionError, check_mask

FILLS = ("mean", "constant", "blur", "noise", "inpaint", "paste")
IN_MEMORY_SOURCE = "in-memory image"  # what a paste fill records of a source that was no file


def _as_array(image) -> np.ndarray:
    """``(H, W, 3)`` uint8 from a PIL image, path or array."""
    if isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3:
        return image

    return np.asarray(load_image(image))


def gaussian_blur(image: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur of ``(H, W, C)`` (float64 out): kernel
    ``exp(-x^2 / 2 sigma^2)`` truncated at ``ceil(3 sigma)``, normalised; edges
    mirrored (``numpy.pad`` mode "symmetric")."""
    x = np.asarray(image, dtype=np.float64)
    r = max(1, int(math.ceil(3 * sigma)))
    t = np.arange(-r, r + 1, dtype=np.float64)
    k = np.exp(-(t**2) / (2 * sigma**2))
    k /= k.sum()
    for axis in (0, 1):
        n = x.shape[axis]
        pad = [(0, 0)] * x.ndim
        pad[axis] = (r, r)
        xp = np.pad(x, pad, mode="symmetric" if n > 1 else "edge")
        out = np.zeros_like(x)
        for i, w in enumerate(k):
            sl = [slice(None)] * x.ndim
            sl[axis] = slice(i, i + n)
            out += w * xp[tuple(sl)]
        x = out
    return x


def harmonic_inpaint(image: np.ndarray, mask: np.ndarray, *, tol: float = 1e-4, max_iter: int = 10_000) -> np.ndarray:
    """Fill ``mask`` by solving Laplace's equation (the discrete harmonic
    function with the 4-neighbour stencil) whose boundary values are the
    pixels around the region; image edges are free (Neumann). Conjugate
    gradients on the region's bounding box. ``(H, W, C)`` -> float64.

    A mask covering the whole image has no boundary: it gets the image mean."""
    img = np.asarray(image, dtype=np.float64)
    mask = np.asarray(mask, dtype=bool)
    out = img.copy()
    if mask.all():
        out[:] = img.reshape(-1, img.shape[-1]).mean(0)
        return out
    ys, xs = np.nonzero(mask)
    h, w = mask.shape
    y0, y1 = max(0, ys.min() - 1), min(h, ys.max() + 2)
    x0, x1 = max(0, xs.min() - 1), min(w, xs.max() + 2)
    m = mask[y0:y1, x0:x1]
    sub = img[y0:y1, x0:x1]  # (h', w', C); the box is 1 px wider than the region or at the image edge

    def shifts(a: np.ndarray) -> np.ndarray:
        """Sum over the in-box 4-neighbours of every pixel (missing neighbours count 0)."""
        s = np.zeros_like(a)
        s[1:] += a[:-1]
        s[:-1] += a[1:]
        s[:, 1:] += a[:, :-1]
        s[:, :-1] += a[:, 1:]
        return s

    ones = np.ones(m.shape + (1,), dtype=np.float64)
    deg = shifts(ones)  # number of neighbours inside the image
    mm = m[..., None]
    known = np.where(mm, 0.0, sub)
    b = np.where(mm, shifts(known), 0.0)

    def A(u: np.ndarray) -> np.ndarray:
        return np.where(mm, deg * u - shifts(u), 0.0)

    boundary = (shifts(m[..., None].astype(np.float64)) > 0) & ~mm
    start = sub[boundary[..., 0]].mean(0) if boundary.any() else sub.reshape(-1, sub.shape[-1]).mean(0)
    u = np.where(mm, start, 0.0)
    r = b - A(u)
    p = r.copy()
    rs = (r * r).sum(axis=(0, 1))  # per channel
    scale = max(1.0, float(np.abs(b).max()))
    for _ in range(max_iter):
        if float(np.sqrt(rs).max()) <= tol * scale:
            break
        Ap = A(p)
        denom = (p * Ap).sum(axis=(0, 1))
        alpha = np.where(denom > 0, rs / np.where(denom > 0, denom, 1), 0.0)
        u = u + alpha * p
        r = r - alpha * Ap
        rs_new = (r * r).sum(axis=(0, 1))
        p = r + np.where(rs > 0, rs_new / np.where(rs > 0, rs, 1), 0.0) * p
        rs = rs_new
    out[y0:y1, x0:x1] = np.where(mm, u, sub)
    return out


@dataclass(frozen=True)
class Fill:
    """How a region is filled.

    Attributes:
        kind: one of :data:`FILLS`.
        color: ``constant``: the RGB colour (0-255).
        radius: ``blur``: the Gaussian's sigma in original-image pixels.
        seed: ``noise``: the generator seed (same seed, same noise).
        paste_from: ``paste``: the other image (path, PIL image or uint8 array);
            it is resized (bilinear) to this image's size when they differ.
    """

    kind: str = "mean"
    color: tuple[int, int, int] = (128, 128, 128)
    radius: float = 4.0
    seed: int = 0
    paste_from: Any = None

    def __post_init__(self):
        if self.kind not in FILLS:
            raise RegionError(f"unknown fill {self.kind!r}; expected one of {', '.join(FILLS)}")
        if self.kind == "constant":
            c = tuple(self.color)
            if len(c) != 3 or any(not (0 <= int(v) <= 255) or int(v) != v for v in c):
                raise RegionError(f"a constant fill needs an RGB colour of three integers 0-255, got {self.color!r}")
        if self.kind == "blur" and not self.radius > 0:
            raise RegionError(f"the blur radius must be positive, got {self.radius}")
        if self.kind == "paste" and self.paste_from is None:
            raise RegionError("a paste fill needs another image to paste from")

    def parameters(self) -> dict:
        """What the fill ran with (JSON-ready)."""
        if self.kind == "constant":
            return {"color": [int(v) for v in self.color]}
        if self.kind == "blur":
            return {"sigma_px": float(self.radius), "truncate": "ceil(3 sigma)", "edges": "mirrored"}
        if self.kind == "noise":
            return {
                "seed": int(self.seed),
                "distribution": "i.i.d. Gaussian per pixel and channel with the image's per-channel mean and std; "
                "one field for the whole image drawn from the seed, the region takes its pixels",
            }
        if self.kind == "inpaint":
            return {"method": "harmonic (Laplace, 4-neighbour, conjugate gradients), image edges free"}
        if self.kind == "paste":
            src = self.paste_from
            return {
                "source": str(src) if isinstance(src, (str, Path)) else IN_MEMORY_SOURCE,
                "source_sha256": self.source_sha256,
                "resize": "bilinear",
            }
        return {"color": "the image's mean colour (per channel, rounded)"}

    @classmethod
    def recorded(cls, kind: str, parameters: dict) -> Fill:
        """The fill a recorded run names by its ``fill`` and ``fill_parameters``
        (:meth:`parameters`): the colour, the sigma, the seed, a paste's source as
        recorded (a path, or :data:`IN_MEMORY_SOURCE`) with its recorded hash (the
        source is not read again: :attr:`has_source_file` says whether it can be)."""
        if kind == "constant":
            fill = cls(kind, color=tuple(int(v) for v in parameters["color"]))
        elif kind == "blur":
            fill = cls(kind, radius=float(parameters["sigma_px"]))
        elif kind == "noise":
            fill = cls(kind, seed=int(parameters["seed"]))
        elif kind == "paste":
            fill = cls(kind, paste_from=str(parameters["source"]))
            fill.__dict__["source_sha256"] = parameters.get("source_sha256")  # as recorded: cached_property's slot
        else:
            fill = cls(kind)
        return fill

    def describe(self) -> str:
        """``blur (sigma 2 px)``: the fill and the option that makes it this one."""
        option = {
            "constant": f"colour {', '.join(str(int(v)) for v in self.color)}",
            "blur": f"sigma {self.radius:g} px",
            "noise": f"seed {self.seed}",
            "paste": f"from {self.paste_from}" if isinstance(self.paste_from, (str, Path)) else "from pixels",
        }.get(self.kind)
        return f"{self.kind} ({option})" if option else self.kind

    @property
    def has_source_file(self) -> bool:
        """A paste fill whose source is a file (not pixels that had none)."""
        return self.kind == "paste" and self.paste_from != IN_MEMORY_SOURCE

    @cached_property
    def source_sha256(self) -> str | None:
        """A paste fill's source image, :func:`core.files.images.image_sha256` (hashed once); None for other fills."""
        return image_sha256(load_image(self.paste_from)) if self.kind == "paste" else None

    def apply(self, image, mask) -> np.ndarray:
        """The image with the region filled, ``(H, W, 3)`` uint8; pixels outside
        ``mask`` are bit-identical to the input."""
        return self.bind(image)(mask)

    def bind(self, image) -> Callable[[Any], np.ndarray]:
        """A function ``mask -> filled image`` for one image, with what does not
        depend on the mask (mean colour, the noise field, the resized paste
        source) computed once; :meth:`apply` for many masks of one image."""
        img = _as_array(image)
        h, w = img.shape[:2]
        value = source = None
        if self.kind == "mean":
            value = mean_color(img)
        elif self.kind == "constant":
            value = np.array(self.color, dtype=np.uint8)
        elif self.kind == "noise":
            # one field for the whole image, drawn from the seed: a pixel's noise does not depend on the mask
            flat = img.reshape(-1, 3).astype(np.float64)
            source = _to_uint8(np.random.default_rng(self.seed).normal(flat.mean(0), flat.std(0), size=img.shape))
        elif self.kind == "paste":
            source = _as_array(self.paste_from)
            if source.shape[:2] != (h, w):
                source = np.asarray(Image.fromarray(source).resize((w, h), Image.BILINEAR))

        def fill(mask) -> np.ndarray:
            m = check_mask(mask, (w, h), allow_empty=True)
            out = img.copy()
            if not m.any():
                return out
            if value is not None:
                out[m] = value
            elif source is not None:
                out[m] = source[m]
            elif self.kind == "blur":
                ys, xs = np.nonzero(m)
                r = max(1, int(math.ceil(3 * self.radius)))
                # a region pixel's blur reads pixels within r: a crop r px wider than the
                # region (or ending at the image edge, mirrored as the whole image is) is exact
                y0, y1 = max(0, ys.min() - r), min(h, ys.max() + 1 + r)
                x0, x1 = max(0, xs.min() - r), min(w, xs.max() + 1 + r)
                blurred = _to_uint8(gaussian_blur(img[y0:y1, x0:x1], self.radius))
                sub, sm = out[y0:y1, x0:x1], m[y0:y1, x0:x1]
                sub[sm] = blurred[sm]
            else:  # inpaint
                out[m] = _to_uint8(harmonic_inpaint(img, m))[m]
            return out

        return fill


def _to_uint8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def mean_color(image) -> np.ndarray:
    """``(3,)`` uint8: the image's per-channel mean over every pixel, rounded."""
    return _to_uint8(_as_array(image).reshape(-1, 3).astype(np.float64).mean(0))


def as_fill(fill: Fill | str, **options) -> Fill:
    """A :class:`Fill` from a name and options (``color``, ``radius``, ``seed``, ``paste_from``)."""
    if isinstance(fill, Fill):
        return fill
    return Fill(str(fill), **{k: v for k, v in options.items() if v is not None})


def fill_region(image, mask, fill: Fill | str = "mean", **options) -> np.ndarray:
    """``(H, W, 3)`` uint8: ``image`` with ``mask`` filled (see :class:`Fill`)."""
    return as_fill(fill, **options).apply(image, mask)
