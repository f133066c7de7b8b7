"""Region counterfactuals (docs/METHODS.md §4.12, §4.11): fill a pixel region of the
ORIGINAL image, run the edited image through the model's own processor and
forward, and report what happened to the answer, with the routing read-outs
for the same region beside it.

* A region is an ``(H, W)`` bool mask on the original image (``True`` = in the
  region): :func:`mask_from_box`, :func:`mask_from_polygon`,
  :func:`mask_from_png` (white = region), :func:`mask_from_scene_object`.
* Fills (:class:`Fill`): ``mean`` (the image's mean colour), ``constant``,
  ``blur`` (Gaussian, sigma = ``radius`` px), ``noise`` (seeded i.i.d.
  Gaussian with the image's per-channel mean and std), ``inpaint`` (harmonic:
  the region solves Laplace's equation with the surrounding pixels as
  boundary values), ``paste`` (the same region of another image, resized to
  this one). Every fill changes the region's pixels only; the rest of the
  image stays bit-identical.
* Answer effect (:class:`AnswerEffect`): change in the answer logit, in the
  answer-minus-foil logit difference, in the answer probability, and whether
  the argmax changed; with the original and edited values.
* Routing (:class:`RegionRouting`), read from ONE capture of the original
  image: the answer row's attention mass on the visual tokens that overlap the
  region, each token weighted by ``area(token box & mask) / area(token box)``;
  rollout mass weighted the same way; and frozen-scale DLA through those
  tokens (:func:`core.methods.contributions.source_contributions`, summed over
  blocks and heads, weighted the same way). These show routing and the direct
  write only: the counterfactual is the causal read-out.
* :func:`region_agreement`: over many regions of one image, how well
  attention-on-region predicts the causal drop (Spearman and Pearson), and the
  regions where they disagree most.
* :func:`occlusion_sweep`: every patch (or k x k block of patches) filled in
  turn, batched; a patch-grid map of the answer effect. An interpolated map
  exists only on request (:meth:`OcclusionMap.interpolated`) and always carries
  ``interpolated: "visual smoothing, not a causal pixel mask"``.
* :func:`object_fill_effects`: the target-versus-distractor check on synthetic
  scenes with ground-truth masks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from core.audit import AuditRecord
from core.errors import QuestionError, ReadoutError, oom_guard

SCHEMA_VERSION = 1
FILLS = ("mean", "constant", "blur", "noise", "inpaint", "paste")
INTERPOLATED_FLAG = "visual smoothing, not a causal pixel mask"
TOKEN_WEIGHT = "area(token box & mask) / area(token box), in original-image pixels"
DLA_CONVENTION = (
    "frozen-scale DLA (source_contributions.dla_frozen) summed over blocks, heads and region tokens, "
    "each token weighted by its overlap fraction"
)

Progress = Callable[[int, int, str], None] | None
Cancel = Callable[[], bool] | None


class RegionError(ReadoutError):
    """A region or a fill that cannot be used (wrong size, empty, unknown fill)."""


# ---------------------------------------------------------------- regions


def _size_of(image) -> tuple[int, int]:
    """``(width, height)`` of a PIL image, an ``(H, W[, 3])`` array or a size tuple."""
    if isinstance(image, Image.Image):
        return image.size
    if isinstance(image, np.ndarray):
        return int(image.shape[1]), int(image.shape[0])
    w, h = image
    return int(w), int(h)


def check_mask(mask, image_size: tuple[int, int], *, allow_empty: bool = False) -> np.ndarray:
    """``mask`` as an ``(H, W)`` bool array matching ``image_size = (width, height)``.

    Raises:
        RegionError: wrong shape, or no pixel in the region (unless ``allow_empty``).
    """
    m = np.asarray(mask)
    w, h = image_size
    if m.ndim != 2 or m.shape != (h, w):
        raise RegionError(f"the mask is {_shape_text(m)} but the image is {w}x{h} (width x height); they must match")
    m = m.astype(bool)
    if not allow_empty and not m.any():
        raise RegionError("the mask selects no pixel")
    return m


def _shape_text(m: np.ndarray) -> str:
    return f"{m.shape[1]}x{m.shape[0]}" if m.ndim == 2 else f"an array of shape {tuple(m.shape)}"


def mask_from_box(image_size: tuple[int, int], box: Sequence[float]) -> np.ndarray:
    """``(H, W)`` bool: the pixels whose centre lies in ``box = [x0, y0, x1, y1]``
    (end-exclusive pixel coordinates of the original image; clipped to it)."""
    w, h = image_size
    x0, y0, x1, y1 = (float(v) for v in box)
    xs = np.arange(w) + 0.5
    ys = np.arange(h) + 0.5
    return ((ys >= y0) & (ys < y1))[:, None] & ((xs >= x0) & (xs < x1))[None, :]


def mask_from_polygon(image_size: tuple[int, int], points: Sequence[Sequence[float]]) -> np.ndarray:
    """``(H, W)`` bool: the polygon ``[(x, y), ...]`` (original-image pixels)
    filled as PIL draws it (outline included)."""
    from PIL import ImageDraw

    if len(points) < 3:
        raise RegionError(f"a polygon needs at least 3 points, got {len(points)}")
    canvas = Image.new("L", tuple(image_size), 0)
    ImageDraw.Draw(canvas).polygon([(float(x), float(y)) for x, y in points], fill=255, outline=255)
    return np.asarray(canvas) > 0


def mask_from_png(path: str | Path, image_size: tuple[int, int]) -> np.ndarray:
    """Read a painted mask: white (luminance >= 128) is the region; a mask
    with an alpha channel also needs alpha >= 128. It must have the image's size.

    Raises:
        RegionError: the size differs from ``image_size`` or the mask is empty.
        ImageLoadError: the file is not an image.
    """
    from core.images import load_mask

    p = Path(path)
    mask = load_mask(p)
    size = (mask.shape[1], mask.shape[0])
    if tuple(size) != tuple(image_size):
        raise RegionError(
            f"{p}: the mask is {size[0]}x{size[1]} but the image is {image_size[0]}x{image_size[1]}; they must match"
        )
    return check_mask(mask, image_size)


def mask_from_scene_object(sample, index: int) -> np.ndarray:
    """The ground-truth ``(H, W)`` bool mask of object ``index`` of a synthetic
    scene (:class:`core.zoo.scenes.Sample`): every pixel its ink touches."""
    return np.array(sample.objects[index].mask, dtype=bool, copy=True)


def mask_from_boxes(image_size: tuple[int, int], boxes: Sequence[Sequence[float]]) -> np.ndarray:
    """Union of :func:`mask_from_box` over ``boxes``."""
    w, h = image_size
    out = np.zeros((h, w), dtype=bool)
    for b in boxes:
        out |= mask_from_box(image_size, b)
    return out


# ---------------------------------------------------------------- fills


def _as_array(image) -> np.ndarray:
    """``(H, W, 3)`` uint8 from a PIL image, path or array."""
    if isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3:
        return image
    from core.images import load_image

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
            return {"source": str(src) if isinstance(src, (str, Path)) else "in-memory image", "resize": "bilinear"}
        return {"color": "the image's mean colour (per channel, rounded)"}

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


# ---------------------------------------------------------------- answer numbers


@dataclass
class AnswerNumbers:
    """The answer position's numbers on one image (the "counterfactual" JSON of docs/ARCHITECTURE.md)."""

    answer: str
    answer_id: int
    foil: str | None
    foil_id: int | None
    logit: float
    logit_diff: float | None  # answer logit minus foil logit (None without a foil)
    prob: float
    predicted: str
    predicted_id: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class AnswerEffect:
    """Edited minus original. ``flipped``: the argmax token changed."""

    logit_change: float
    logit_diff_change: float | None
    prob_change: float
    flipped: bool

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @property
    def drop(self) -> float:
        """The decrease of the target score (logit difference with a foil, else the
        answer logit): positive when the edit hurt the answer."""
        return -(self.logit_diff_change if self.logit_diff_change is not None else self.logit_change)


def answer_numbers(adapter, logits: torch.Tensor, answer_id: int, foil_id: int | None) -> AnswerNumbers:
    """Numbers from the answer position's logits ``(vocab,)`` (float64 arithmetic)."""
    z = logits.detach().double().cpu()
    probs = z.softmax(-1)
    pred = int(z.argmax())
    return AnswerNumbers(
        adapter.token_str(answer_id),
        int(answer_id),
        adapter.token_str(foil_id) if foil_id is not None else None,
        int(foil_id) if foil_id is not None else None,
        float(z[answer_id]),
        float(z[answer_id] - z[foil_id]) if foil_id is not None else None,
        float(probs[answer_id]),
        adapter.token_str(pred),
        pred,
    )


def answer_effect(original: AnswerNumbers, edited: AnswerNumbers) -> AnswerEffect:
    return AnswerEffect(
        edited.logit - original.logit,
        edited.logit_diff - original.logit_diff if original.logit_diff is not None else None,
        edited.prob - original.prob,
        edited.predicted_id != original.predicted_id,
    )


def resolve_tokens(adapter, answer: str | int | None, foil: str | int | None, logits: torch.Tensor):
    """Answer id (default: the model's top token on ``logits (vocab,)``) and foil id (or None)."""
    answer_id = int(logits.argmax()) if answer is None else _tok(adapter, answer)
    foil_id = None if foil is None else _tok(adapter, foil)
    if foil_id is not None and foil_id == answer_id:
        raise QuestionError("the foil must differ from the answer")
    return answer_id, foil_id


def _tok(adapter, t: str | int) -> int:
    return int(t) if isinstance(t, (int, np.integer)) else adapter.token_id(t)


@torch.no_grad()
def answer_logits(
    loaded, images: Sequence, question: str, *, batch_size: int = 16, progress: Progress = None, cancel: Cancel = None
) -> torch.Tensor:
    """Answer-position logits ``(n_images, vocab)`` of ``question`` on each image,
    through ``adapter.prepare`` + ``adapter.next_token_logits``, ``batch_size`` at a time."""
    adapter = loaded.adapter
    out = []
    for start in range(0, len(images), batch_size):
        if cancel is not None and cancel():
            break
        chunk = list(images[start : start + batch_size])
        with oom_guard(f"running a batch of {len(chunk)} edited images"):
            inputs = adapter.prepare(chunk, [question] * len(chunk))
            out.append(adapter.next_token_logits(inputs).detach().cpu())
        if progress is not None:
            progress(min(start + batch_size, len(images)), len(images), "edited forwards")
    return torch.cat(out) if out else torch.zeros(0)


# ---------------------------------------------------------------- routing


def overlap_weights(tokens, mask) -> np.ndarray:
    """``(n_tokens,)``: for each visual token, ``area(box & mask) / area(box)``
    with the box in original-image pixels (fractional boxes handled exactly:
    each mask pixel is the unit square it covers). Tokens without a patch
    (``col < 0``) weigh 0. A box reaching past the image counts its outside
    part as not in the region."""
    m = np.asarray(mask, dtype=np.float64)
    h, w = m.shape
    out = np.zeros(len(tokens))
    xs, ys = np.arange(w, dtype=np.float64), np.arange(h, dtype=np.float64)
    for i, t in enumerate(tokens):
        if t.col < 0:
            continue
        x0, y0, x1, y1 = (float(v) for v in t.box)
        area = (x1 - x0) * (y1 - y0)
        if area <= 0:
            continue
        xa, xb = max(0, int(math.floor(x0))), min(w, int(math.ceil(x1)))
        ya, yb = max(0, int(math.floor(y0))), min(h, int(math.ceil(y1)))
        if xb <= xa or yb <= ya:
            continue
        # each pixel's overlap with the box along x and y (1 inside, a fraction on a fractional edge)
        wx = np.clip(np.minimum(xs[xa:xb] + 1, x1) - np.maximum(xs[xa:xb], x0), 0, None)
        wy = np.clip(np.minimum(ys[ya:yb] + 1, y1) - np.maximum(ys[ya:yb], y0), 0, None)
        out[i] = float(wy @ m[ya:yb, xa:xb] @ wx) / area
    return out


@dataclass
class TokenRouting:
    """Per-visual-token routing read-outs of the answer position from one
    capture of the original image; a region's numbers are weighted sums.

    Attributes:
        tokens: the :class:`core.geometry.VisualToken` list.
        heads: ``[(block, block_name, head)]`` rows of ``attention``.
        attention: ``(n_heads_with_visual_keys, n_tokens)`` the answer row's
            weight on each visual token.
        rollout: ``(n_tokens,)`` rollout mass of the answer position on each
            visual token (None when the prompt was too long for full patterns).
        dla: ``(n_blocks, n_tokens)`` frozen-scale DLA through each visual
            token, summed over the block's heads (rows of blocks without
            visual keys are 0).
    """

    tokens: list
    heads: list[tuple[int, str, int]]
    attention: np.ndarray
    rollout: np.ndarray | None
    dla: np.ndarray
    rollout_alpha: float
    answer_id: int
    foil_id: int | None
    position: int
    audit: list[AuditRecord] = field(default_factory=list, repr=False)

    def for_region(self, mask) -> RegionRouting:
        w = overlap_weights(self.tokens, mask)
        mass = self.attention @ w
        return RegionRouting(
            [{"layer": b, "block": name, "head": h, "mass": float(v)} for (b, name, h), v in zip(self.heads, mass)],
            float(self.rollout @ w) if self.rollout is not None else None,
            float(self.dla.sum(0) @ w),
            [{"block": b, "dla": float(v)} for b, v in enumerate(self.dla @ w) if self.dla[b].any()],
            [{"index": int(i), "weight": float(w[i])} for i in np.nonzero(w)[0]],
            self.rollout_alpha,
        )


@dataclass
class RegionRouting:
    """Routing read-outs for one region (what attention shows; not the effect).

    Attributes:
        attention_mass: per head with visual keys, ``{"layer", "block", "head", "mass"}``:
            ``sum_t A[answer, t] * weight_t`` over the visual tokens.
        rollout_mass: ``sum_t R[answer, t] * weight_t`` (None: no full patterns).
        dla_through_region: frozen-scale DLA through the region's tokens
            (:data:`DLA_CONVENTION`).
        dla_by_block: the same per block (blocks with visual keys).
        token_weights: ``{"index", "weight"}`` of every token the region touches.
    """

    attention_mass: list[dict]
    rollout_mass: float | None
    dla_through_region: float
    dla_by_block: list[dict]
    token_weights: list[dict]
    rollout_alpha: float

    @property
    def mean_attention_mass(self) -> float:
        """The region's attention mass averaged over every head with visual keys."""
        return float(np.mean([r["mass"] for r in self.attention_mass])) if self.attention_mass else float("nan")

    def to_dict(self) -> dict:
        return {
            "attention_mass": self.attention_mass,
            "rollout_mass": self.rollout_mass,
            "rollout_alpha": self.rollout_alpha,
            "dla_through_region": self.dla_through_region,
            "dla_convention": DLA_CONVENTION,
            "dla_by_block": self.dla_by_block,
            "token_weight": TOKEN_WEIGHT,
            "token_weights": self.token_weights,
        }


@torch.no_grad()
def token_routing(
    loaded,
    image,
    question: str,
    answer_id: int,
    foil_id: int | None = None,
    *,
    rollout_alpha: float = 0.5,
    inputs=None,
) -> TokenRouting:
    """One capture of the ORIGINAL image: the answer row at every block (the
    full pattern, for rollout, when the prompt has at most
    ``core.methods.patterns.FULL_PATTERN_LIMIT`` tokens), then per visual token its
    attention weight per head, rollout mass and frozen-scale DLA."""
    from core.capture import capture
    from core.images import load_image
    from core.methods.contributions import source_contributions
    from core.methods.patterns import FULL_PATTERN_LIMIT, rollout, rollout_audit

    adapter = loaded.adapter
    img = load_image(image)
    if inputs is None:
        inputs = adapter.prepare([img], [question])
    n = inputs.input_ids.shape[1]
    full = n <= FULL_PATTERN_LIMIT
    pos = int(inputs.answer_positions[0])
    trace = capture(loaded, img, question, query_positions=range(n) if full else [pos], inputs=inputs)
    qi = pos if full else 0
    tokens = adapter.visual_tokens(img.size, trace.visual_positions[0].tolist())
    vis_pos = trace.visual_positions[0]
    heads, rows = [], []
    for block in range(trace.n_blocks):
        pat = trace.patterns[block][0, :, qi].double().cpu()  # (heads, keys)
        if trace.block_kinds[block] == "cross":
            vis = pat[:, : len(tokens)]
        elif vis_pos.numel():
            vis = pat[:, vis_pos.cpu()]
        else:  # a text-only block (CoCa's text tower): no visual key
            continue
        for h in range(vis.shape[0]):
            heads.append((block, trace.block_names[block], h))
            rows.append(vis[h].numpy())
    attention = np.stack(rows) if rows else np.zeros((0, len(tokens)))
    roll = None
    audits = []
    if full:
        r = rollout(trace, rollout_alpha)[pos].double().cpu()
        vis_nodes = vis_pos.cpu() if vis_pos.numel() else torch.arange(n, r.shape[0])
        roll = r[vis_nodes].numpy()
    sc = source_contributions(adapter, trace, answer_id, foil_id, position=pos)
    dla = np.zeros((trace.n_blocks, len(tokens)))
    for block, d in enumerate(sc.dla_frozen):
        d = d.double().cpu().sum(0)  # (sources,) summed over heads
        if trace.block_kinds[block] == "cross":
            dla[block] = d[: len(tokens)].numpy()
        elif vis_pos.numel():
            dla[block] = d[vis_pos.cpu()].numpy()
    audits.append(
        AuditRecord.for_method(
            "pattern analysis",
            controls=[
                "answer row of one capture of the original image",
                f"token weight = {TOKEN_WEIGHT}",
                "sink / text mass excluded (visual keys only)",
                "patch-granular",
            ],
            parameters={"position": pos, "n_heads": len(heads), "n_visual_tokens": len(tokens)},
            notes=["attention on the region shows routing co-occurrence only; compare with the answer effect"],
        )
    )
    if full:
        audits.append(rollout_audit(rollout_alpha, "mean"))
    audits.append(sc.audit)
    audits[-1].notes.append(
        "DLA through region tokens reads the direct write from those tokens' residuals (self-attention: "
        "positions that earlier layers already mixed) or the vision tower's outputs (cross-attention: "
        "already mixed across patches by the vision tower); it is not the region's pixel information"
    )
    return TokenRouting(tokens, heads, attention, roll, dla, rollout_alpha, answer_id, foil_id, pos, audits)


# ---------------------------------------------------------------- one region


def counterfactual_audit(fill: Fill, parameters: dict, notes: Sequence[str] = ()) -> AuditRecord:
    return AuditRecord.for_method(
        "region counterfactual",
        controls=[
            f"fill: {fill.kind}",
            "edited image through the model's own processor",
            "pixels outside the region bit-identical",
            "original and edited numbers reported side by side",
        ],
        parameters={"fill": fill.kind, **fill.parameters(), **parameters},
        notes=[
            "a fill is itself new evidence (a mean patch, a blur, an inpainted surface): the effect is of "
            "this replacement, not of 'the object being absent'; compare fills and a matched-area control region",
            *notes,
        ],
    )


@dataclass
class RegionCounterfactual:
    """One region, one fill: the answer effect with the routing read-outs beside it."""

    fill: Fill
    mask_area_px: int
    original: AnswerNumbers
    edited: AnswerNumbers
    effect: AnswerEffect
    routing: RegionRouting | None
    audit: list[AuditRecord] = field(default_factory=list, repr=False)
    edited_image: np.ndarray | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        """The ``counterfactual`` JSON of docs/ARCHITECTURE.md (schema version 1)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "fill": self.fill.kind,
            "fill_parameters": self.fill.parameters(),
            "mask_area_px": self.mask_area_px,
            "original": self.original.to_dict(),
            "edited": self.edited.to_dict(),
            "effect": self.effect.to_dict(),
            "routing": self.routing.to_dict() if self.routing is not None else None,
            "audit": [a.to_dict() for a in self.audit],
        }


@torch.no_grad()
def region_counterfactual(
    loaded,
    image,
    question: str,
    mask,
    fill: Fill | str = "mean",
    *,
    answer: str | int | None = None,
    foil: str | int | None = None,
    routing: bool = True,
    rollout_alpha: float = 0.5,
    **fill_options,
) -> RegionCounterfactual:
    """Fill ``mask`` ``(H, W)`` bool (original-image pixels) and re-run the model.

    Args:
        answer: the answer token (default: the model's top token on the original).
        foil: a competing token; the logit difference is answer minus foil.
        routing: also read the routing for the region from one capture of the original.
        fill_options: ``color``, ``radius``, ``seed``, ``paste_from`` (see :class:`Fill`).
    """
    from core.images import load_image

    adapter = loaded.adapter
    img = load_image(image)
    m = check_mask(mask, img.size)
    f = as_fill(fill, **fill_options)
    edited_img = f.apply(img, m)
    logits = answer_logits(loaded, [img, edited_img], question, batch_size=2)
    answer_id, foil_id = resolve_tokens(adapter, answer, foil, logits[0])
    original = answer_numbers(adapter, logits[0], answer_id, foil_id)
    edited = answer_numbers(adapter, logits[1], answer_id, foil_id)
    audits = [
        counterfactual_audit(
            f,
            {"mask_area_px": int(m.sum()), "answer_id": answer_id, "foil_id": foil_id},
            ["original and edited run in one batch of two"],
        )
    ]
    reg = None
    if routing:
        tr = token_routing(loaded, img, question, answer_id, foil_id, rollout_alpha=rollout_alpha)
        reg = tr.for_region(m)
        audits += tr.audit
    return RegionCounterfactual(
        f, int(m.sum()), original, edited, answer_effect(original, edited), reg, audits, edited_img
    )


# ---------------------------------------------------------------- many regions: does attention predict the effect?


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 with ties averaged."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=np.float64)
    for v in np.unique(x):
        tie = x == v
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks


def pearson(x, y) -> float | None:
    """Pearson correlation; None with fewer than 3 points or a constant input."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def spearman(x, y) -> float | None:
    """Spearman rank correlation (Pearson of tie-averaged ranks)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 3:
        return None
    return pearson(_ranks(x), _ranks(y))


@dataclass
class RegionRow:
    name: str
    mask_area_px: int
    attention_mass: float  # mean over heads with visual keys
    max_head_mass: float
    rollout_mass: float | None
    dla_through_region: float
    effect: AnswerEffect
    drop: float  # original minus edited target score (positive: the edit hurt the answer)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["effect"] = self.effect.to_dict()
        return d


@dataclass
class RegionAgreement:
    """Across the regions of one image: do the routing read-outs rank the
    regions as the causal drop does?

    Attributes:
        correlations: ``{readout: {"spearman", "pearson"}}`` of each read-out
            (attention_mass, rollout_mass, dla_through_region) against ``drop``.
        disagreements: the regions whose attention rank and drop rank differ
            most (``rank_gap``: attention rank minus drop rank, as a share of n - 1).
    """

    original: AnswerNumbers
    fill: Fill
    rows: list[RegionRow]
    correlations: dict[str, dict[str, float | None]]
    disagreements: list[dict]
    audit: list[AuditRecord] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "fill": self.fill.kind,
            "fill_parameters": self.fill.parameters(),
            "original": self.original.to_dict(),
            "drop": "original minus edited logit difference (answer logit without a foil); positive = hurt",
            "regions": [r.to_dict() for r in self.rows],
            "correlations": self.correlations,
            "correlation_reading": "each read-out against drop across these regions: positive = more routing "
            "on a region goes with a larger causal drop (they agree); near 0 or negative = they disagree",
            "disagreements": self.disagreements,
            "audit": [a.to_dict() for a in self.audit],
        }


@torch.no_grad()
def region_agreement(
    loaded,
    image,
    question: str,
    regions: Mapping[str, Any] | Sequence,
    fill: Fill | str = "mean",
    *,
    answer: str | int | None = None,
    foil: str | int | None = None,
    batch_size: int = 16,
    n_disagreements: int = 3,
    rollout_alpha: float = 0.5,
    progress: Progress = None,
    cancel: Cancel = None,
    **fill_options,
) -> RegionAgreement:
    """Fill each region in turn (batched) and set each region's routing
    read-outs (one capture of the original) against its causal drop.

    Args:
        regions: ``{name: mask}`` or a list of masks (named "0", "1", ...),
            each ``(H, W)`` bool on the original image.
    """
    from core.images import load_image

    adapter = loaded.adapter
    img = load_image(image)
    named = list(regions.items()) if isinstance(regions, Mapping) else [(str(i), r) for i, r in enumerate(regions)]
    if not named:
        raise RegionError("no regions given")
    masks = [(name, check_mask(m, img.size)) for name, m in named]
    f = as_fill(fill, **fill_options)
    fill_one = f.bind(img)
    base = answer_logits(loaded, [img], question)[0]
    answer_id, foil_id = resolve_tokens(adapter, answer, foil, base)
    original = answer_numbers(adapter, base, answer_id, foil_id)
    routing = token_routing(loaded, img, question, answer_id, foil_id, rollout_alpha=rollout_alpha)
    rows: list[RegionRow] = []
    for start in range(0, len(masks), batch_size):
        if cancel is not None and cancel():
            break
        chunk = masks[start : start + batch_size]
        edited = [fill_one(m) for _, m in chunk]
        logits = answer_logits(loaded, edited, question, batch_size=batch_size)
        for (name, m), z in zip(chunk, logits):
            eff = answer_effect(original, answer_numbers(adapter, z, answer_id, foil_id))
            r = routing.for_region(m)
            rows.append(
                RegionRow(
                    name,
                    int(m.sum()),
                    r.mean_attention_mass,
                    max((x["mass"] for x in r.attention_mass), default=float("nan")),
                    r.rollout_mass,
                    r.dla_through_region,
                    eff,
                    eff.drop,
                )
            )
        if progress is not None:
            progress(len(rows), len(masks), "region counterfactuals")
    drop = np.array([r.drop for r in rows])
    corr = {}
    for key in ("attention_mass", "rollout_mass", "dla_through_region"):
        vals = [getattr(r, key) for r in rows]
        if any(v is None for v in vals):
            corr[key] = {"spearman": None, "pearson": None}
            continue
        corr[key] = {"spearman": spearman(vals, drop), "pearson": pearson(vals, drop)}
    disagreements = []
    if len(rows) >= 2:
        scale = len(rows) - 1
        gap = (_ranks(np.array([r.attention_mass for r in rows])) - _ranks(drop)) / scale
        for i in np.argsort(-np.abs(gap), kind="mergesort")[:n_disagreements]:
            disagreements.append(
                {
                    "name": rows[i].name,
                    "rank_gap": float(gap[i]),
                    "attention_mass": rows[i].attention_mass,
                    "drop": rows[i].drop,
                    "reading": "attention ranks it higher than its effect"
                    if gap[i] > 0
                    else "its effect ranks higher than its attention",
                }
            )
    audits = [
        counterfactual_audit(
            f,
            {"n_regions": len(rows), "answer_id": answer_id, "foil_id": foil_id, "batch_size": batch_size},
            [
                "correlations are across the regions of one image and one question; a high correlation here "
                "does not make attention a causal map elsewhere",
            ],
        ),
        *routing.audit,
    ]
    return RegionAgreement(original, f, rows, corr, disagreements, audits)


# ---------------------------------------------------------------- occlusion sweep


def _primary_grid(tokens) -> tuple[int, int, int, dict]:
    """``(image, rows, cols, {(row, col): token})`` of the primary image's patch grid."""
    from core.methods.patterns import primary_image

    im = primary_image(tokens)
    cells = {(t.row, t.col): t for t in tokens if t.image == im and t.col >= 0}
    rows = max(r for r, _ in cells) + 1
    cols = max(c for _, c in cells) + 1
    return im, rows, cols, cells


def sweep_cells(tokens, image_size: tuple[int, int], k: int = 1) -> list[dict]:
    """The k x k blocks of the primary image's patch grid, row-major: each
    ``{"row", "col", "patches": [(r, c)...], "mask": (H, W) bool}``; a cell's
    mask is the pixels whose centre lies in one of its patches' boxes (cells
    on the grid's far edge may hold fewer than k x k patches)."""
    if int(k) != k or k < 1:
        raise RegionError(f"the sweep block size must be a positive integer, got {k}")
    k = int(k)
    _, rows, cols, cells = _primary_grid(tokens)
    out = []
    for R in range(math.ceil(rows / k)):
        for C in range(math.ceil(cols / k)):
            patches = [(r, c) for r in range(R * k, min(rows, R * k + k)) for c in range(C * k, min(cols, C * k + k))]
            boxes = [cells[p].box for p in patches if p in cells]
            out.append({"row": R, "col": C, "patches": patches, "mask": mask_from_boxes(image_size, boxes)})
    return out


@dataclass
class InterpolatedHeatmap:
    """An upsampled map, for display only. ``interpolated`` is always
    :data:`INTERPOLATED_FLAG`: it is visual smoothing, not a causal pixel mask."""

    values: np.ndarray  # (H, W)
    image_size: tuple[int, int]
    source: str
    method: str = "bilinear"
    interpolated: str = INTERPOLATED_FLAG

    def to_dict(self) -> dict:
        return {
            "interpolated": self.interpolated,
            "source": self.source,
            "method": self.method,
            "image_size": list(self.image_size),
            "values": np.where(np.isfinite(self.values), self.values, None).tolist(),
        }


@dataclass
class OcclusionMap:
    """The answer effect of filling each k x k block of patches, on the patch
    grid of the primary image (rows x cols of ``adapter.visual_tokens``,
    grouped by k). Patch-granular: no interpolation.

    Attributes:
        logit_diff_change, logit_change, prob_change: ``(grid_rows, grid_cols)``
            edited minus original (``logit_diff_change`` is None without a foil).
        flipped: ``(grid_rows, grid_cols)`` bool, the argmax changed.
        cells: per cell ``{"row", "col", "patches", "mask_area_px", "box"}``.
    """

    k: int
    fill: Fill
    image_size: tuple[int, int]
    original: AnswerNumbers
    logit_diff_change: np.ndarray | None
    logit_change: np.ndarray
    prob_change: np.ndarray
    flipped: np.ndarray
    cells: list[dict]
    complete: bool = True
    audit: list[AuditRecord] = field(default_factory=list, repr=False)

    @property
    def effect(self) -> np.ndarray:
        """The map a user reads first: logit-difference change with a foil, else logit change."""
        return self.logit_diff_change if self.logit_diff_change is not None else self.logit_change

    def interpolated(self, image_size: tuple[int, int] | None = None) -> InterpolatedHeatmap:
        """The effect map upsampled (bilinear) to ``image_size`` (default: the
        image's). Only for display; it carries :data:`INTERPOLATED_FLAG`."""
        w, h = image_size or self.image_size
        grid = np.asarray(self.effect, dtype=np.float32)
        up = Image.fromarray(grid, mode="F").resize((int(w), int(h)), Image.BILINEAR)
        name = "logit_diff_change" if self.logit_diff_change is not None else "logit_change"
        return InterpolatedHeatmap(np.asarray(up, dtype=np.float64), (int(w), int(h)), f"occlusion sweep {name}")

    def to_dict(self, *, interpolated: bool = False) -> dict:
        d = {
            "schema_version": SCHEMA_VERSION,
            "sweep": {
                "k": self.k,
                "fill": self.fill.kind,
                "fill_parameters": self.fill.parameters(),
                "grid_shape": list(self.logit_change.shape),
                "granularity": "patch grid (k x k patches per cell), not interpolated",
                "complete": self.complete,
                "logit_diff_change": _grid(self.logit_diff_change),
                "logit_change": _grid(self.logit_change),
                "prob_change": _grid(self.prob_change),
                "flipped": self.flipped.tolist(),
                "cells": self.cells,
            },
            "original": self.original.to_dict(),
            "audit": [a.to_dict() for a in self.audit],
        }
        if interpolated:
            d["interpolated_map"] = self.interpolated().to_dict()
        return d


def _grid(a: np.ndarray | None):
    return None if a is None else np.where(np.isfinite(a), a, None).tolist()


@torch.no_grad()
def occlusion_sweep(
    loaded,
    image,
    question: str,
    *,
    k: int = 1,
    fill: Fill | str = "mean",
    answer: str | int | None = None,
    foil: str | int | None = None,
    batch_size: int = 16,
    progress: Progress = None,
    cancel: Cancel = None,
    **fill_options,
) -> OcclusionMap:
    """Fill every k x k block of patches in turn and run the edited images
    batched through ``adapter.prepare`` + the answer position's logits.

    Returns:
        An :class:`OcclusionMap`; cells not run (cancelled) are NaN and
        ``complete`` is False.
    """
    from core.images import load_image

    adapter = loaded.adapter
    img = load_image(image)
    f = as_fill(fill, **fill_options)
    arr = np.asarray(img)
    fill_cell = f.bind(arr)
    tokens = adapter.visual_tokens(img.size)  # boxes only: the grid does not need sequence positions
    cells = sweep_cells(tokens, img.size, k)
    n_rows = max(c["row"] for c in cells) + 1
    n_cols = max(c["col"] for c in cells) + 1
    maps = {key: np.full((n_rows, n_cols), np.nan) for key in ("logit_diff", "logit", "prob")}
    flipped = np.zeros((n_rows, n_cols), dtype=bool)
    done = 0
    original = answer_id = foil_id = None
    for start in range(0, len(cells), batch_size):
        if start and cancel is not None and cancel():
            break
        chunk = cells[start : start + batch_size]
        edited = [fill_cell(c["mask"]) for c in chunk]
        if original is None:  # the original image rides in the first batch
            edited.insert(0, arr)
        with oom_guard(f"running a batch of {len(edited)} occluded images"):
            inputs = adapter.prepare(edited, [question] * len(edited))
            logits = adapter.next_token_logits(inputs).detach().cpu()
        if original is None:
            answer_id, foil_id = resolve_tokens(adapter, answer, foil, logits[0])
            original = answer_numbers(adapter, logits[0], answer_id, foil_id)
            logits = logits[1:]
        z = logits.double()  # (n, vocab); the same arithmetic as answer_numbers, for the whole batch
        rr = np.array([c["row"] for c in chunk])
        cc = np.array([c["col"] for c in chunk])
        maps["logit"][rr, cc] = (z[:, answer_id] - original.logit).numpy()
        maps["prob"][rr, cc] = (z.softmax(-1)[:, answer_id] - original.prob).numpy()
        if foil_id is not None:
            maps["logit_diff"][rr, cc] = (z[:, answer_id] - z[:, foil_id] - original.logit_diff).numpy()
        flipped[rr, cc] = (z.argmax(-1) != original.predicted_id).numpy()
        done += len(chunk)
        if progress is not None:
            progress(done, len(cells), "occlusion sweep")
    cell_info = []
    for c in cells:
        ys, xs = np.nonzero(c["mask"])
        box = [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1] if len(xs) else None
        cell_info.append(
            {
                "row": c["row"],
                "col": c["col"],
                "patches": [list(p) for p in c["patches"]],
                "mask_area_px": int(c["mask"].sum()),
                "box": box,
            }
        )
    audit = counterfactual_audit(
        f,
        {
            "k": int(k),
            "grid_shape": [n_rows, n_cols],
            "batch_size": batch_size,
            "answer_id": answer_id,
            "foil_id": foil_id,
            "cells_run": done,
        },
        [
            "one cell filled at a time: interactions between cells (redundant evidence) are not seen",
            "the original image runs in the first batch with the edited ones",
            "patch-granular map; an interpolated map is visual smoothing, not a causal pixel mask",
        ],
    )
    return OcclusionMap(
        int(k),
        f,
        img.size,
        original,
        maps["logit_diff"] if foil_id is not None else None,
        maps["logit"],
        maps["prob"],
        flipped,
        cell_info,
        done == len(cells),
        [audit],
    )


# ---------------------------------------------------------------- target versus distractor (synthetic scenes)


def scenes_with_distractor(split: str, n: int, start: int = 0) -> list:
    """The first ``n`` samples of ``split`` (from index ``start``) with a target
    object and at least one distractor (:func:`core.zoo.scenes.make_sample`)."""
    from core.zoo import scenes

    out, i = [], start
    while len(out) < n:
        s = scenes.make_sample(split, i)
        if s.target is not None and s.distractors:
            out.append(s)
        i += 1
    return out


def closest_area_distractor(sample) -> int:
    """The distractor whose ground-truth mask area is closest to the target's (ties: lower index)."""
    area_t = int(sample.objects[sample.target].mask.sum())
    return min(sample.distractors, key=lambda i: (abs(int(sample.objects[i].mask.sum()) - area_t), i))


@dataclass
class ObjectFillEffects:
    """Filling the target object's ground-truth mask versus a distractor's of
    similar area, over many synthetic scenes. Drops are original minus edited
    answer-minus-foil logit difference (positive: the fill hurt the answer).

    Attributes:
        rows: per scene ``{"index", "kind", "template", "target_area", "distractor_area",
            "original", "target_filled", "distractor_filled", "target_drop", "distractor_drop"}``.
    """

    fill: Fill
    rows: list[dict]
    audit: AuditRecord = field(repr=False, default=None)

    def summary(self, rows: list[dict] | None = None) -> dict:
        rows = self.rows if rows is None else rows
        if not rows:
            return {"n": 0}
        t = np.array([r["target_drop"] for r in rows])
        d = np.array([r["distractor_drop"] for r in rows])
        med_t, med_d = float(np.median(t)), float(np.median(d))
        return {
            "n": len(rows),
            "share_target_fill_lowers_logit_diff": float((t > 0).mean()),
            "median_target_drop": med_t,
            "median_distractor_drop": med_d,
            "median_ratio": med_t / med_d if med_d > 0 else None,
            "median_target_drop_at_least_3x_distractor": bool(med_t > 0 and med_t >= 3 * med_d),
            "median_abs_target_change": float(np.median(np.abs(t))),
            "median_abs_distractor_change": float(np.median(np.abs(d))),
            "share_target_drop_exceeds_distractor_drop": float((t > d).mean()),
        }

    def by_kind(self) -> dict[str, dict]:
        kinds = sorted({r["kind"] for r in self.rows})
        return {k: self.summary([r for r in self.rows if r["kind"] == k]) for k in kinds}

    def to_dict(self) -> dict:
        return {
            "fill": self.fill.kind,
            "fill_parameters": self.fill.parameters(),
            "summary": self.summary(),
            "by_kind": self.by_kind(),
            "rows": self.rows,
            "audit": self.audit.to_dict() if self.audit else None,
        }


@torch.no_grad()
def object_fill_effects(
    loaded,
    samples: Sequence,
    fill: Fill | str = "mean",
    *,
    batch_size: int = 32,
    progress: Progress = None,
    cancel: Cancel = None,
    **fill_options,
) -> ObjectFillEffects:
    """For each synthetic sample (with a target and a distractor): the
    answer-minus-foil logit difference on the original, with the target's
    ground-truth mask filled, and with the closest-area distractor's mask
    filled (the question's own answer and foil)."""
    adapter = loaded.adapter
    f = as_fill(fill, **fill_options)
    rows: list[dict] = []
    per_batch = max(1, batch_size // 3)
    for start in range(0, len(samples), per_batch):
        if cancel is not None and cancel():
            break
        chunk = samples[start : start + per_batch]
        images, questions, meta = [], [], []
        for s in chunk:
            d = closest_area_distractor(s)
            mt, md = s.objects[s.target].mask, s.objects[d].mask
            fill_one = f.bind(s.image)
            images += [s.image, fill_one(mt), fill_one(md)]
            questions += [s.question] * 3
            meta.append((s, d, int(mt.sum()), int(md.sum())))
        with oom_guard(f"running a batch of {len(images)} scene images"):
            inputs = adapter.prepare(images, questions)
            logits = adapter.next_token_logits(inputs).detach().double().cpu()
        for j, (s, d, at, ad) in enumerate(meta):
            a, fo = adapter.token_id(s.answer), adapter.token_id(s.foil)
            ld = [float(logits[3 * j + i, a] - logits[3 * j + i, fo]) for i in range(3)]
            rows.append(
                {
                    "index": s.index,
                    "kind": s.kind,
                    "template": s.template,
                    "answer": s.answer,
                    "foil": s.foil,
                    "target": s.target,
                    "distractor": d,
                    "target_area": at,
                    "distractor_area": ad,
                    "original": ld[0],
                    "target_filled": ld[1],
                    "distractor_filled": ld[2],
                    "target_drop": ld[0] - ld[1],
                    "distractor_drop": ld[0] - ld[2],
                }
            )
        if progress is not None:
            progress(len(rows), len(samples), "target / distractor fills")
    audit = counterfactual_audit(
        f,
        {"n_samples": len(rows), "batch_size": batch_size, "control": "distractor mask of closest area"},
        [
            "ground-truth masks of synthetic scenes; answer and foil from the question's ground truth",
            "a drop says the answer depends on those pixels under this fill, not which internal route carries it",
        ],
    )
    return ObjectFillEffects(f, rows, audit)
