"""LLaVA-OneVision (transformers' ``LlavaOnevisionForConditionalGeneration``):
LLaVA-NeXT's any-resolution images read by a SigLIP tower (no CLS: the "full"
feature strategy) and a Qwen2 decoder (q/k/v biases, no o_proj bias, grouped
K/V, RMSNorm, RoPE) over interleaved tokens.

The base image, the tiles, unpad_image and the newline tokens are LLaVA-NeXT's
(:mod:`core.models.families.llava_next`, whose conventions hold here). What is
OneVision's own is "anyres-max": ``vision_aspect_ratio = "anyres_max_<n>"``
caps the high-res view at about ``n`` tiles' worth of features. An unpadded
``rows x cols`` map with ``ratio = sqrt(rows * cols / (n * g * g)) > 1.1`` is
resampled bilinearly (align_corners False) to ``int(rows // ratio) x
int(cols // ratio)`` tokens, and the newlines follow the resampled rows.

A resampled token's box is its cell of the output grid laid over the unpadded
map (``rows / out_rows`` features high), whose centre is its bilinear sample
point; it mixes the up to 2 x 2 features around that point, which reach up to
one feature past its box and may lie in the next tile. Its ``tile`` is the tile
holding the sample point. Without resampling the boxes are LLaVA-NeXT's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from core.errors import ModelLoadError
from core.models.families.llava_next import AnyResLayout, AnyResVisualToken, LlavaNextAdapter

ANYRES_MAX = re.compile(r"anyres_max_([1-9][0-9]*)")


@dataclass
class AnyResMaxLayout(AnyResLayout):
    """An :class:`AnyResLayout` whose ``rows x cols`` are the map the decoder reads
    (resampled or not); ``unpadded`` is unpad_image's map before the resampling."""

    unpadded: tuple[int, int] = (0, 0)

    @property
    def scale(self) -> tuple[float, float]:
        """Unpadded features per token along (rows, cols): 1.0 unless resampled."""
        return self.unpadded[0] / self.rows, self.unpadded[1] / self.cols


class LlavaOnevisionAdapter(LlavaNextAdapter):
    """The canonical view of a LLaVA-OneVision model (see the module docstring)."""

    declaration = replace(
        LlavaNextAdapter.declaration,
        name="llava_onevision",
        architectures=("LlavaOnevisionForConditionalGeneration",),
        # Qwen's chat format, as the OneVision checkpoints' template renders one image then the question.
        prompt="<|im_start|>user <image>\n{question}<|im_end|><|im_start|>assistant\n",
    )

    @classmethod
    def check_config(cls, config) -> None:
        """Also ``vision_aspect_ratio`` (``anyres_max_<n>``), an integer
        ``vision_feature_layer``, and no sliding window (``allowed_keys`` is causal)."""
        super().check_config(config)
        aspect = getattr(config, "vision_aspect_ratio", None)
        if not isinstance(aspect, str) or not ANYRES_MAX.fullmatch(aspect):
            raise ModelLoadError(f"config.json vision_aspect_ratio: expected 'anyres_max_<n>', got {aspect!r}"[:300])
        layer = getattr(config, "vision_feature_layer", None)
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise ModelLoadError(f"config.json vision_feature_layer: expected one integer layer, got {layer!r}"[:300])
        if "sliding_attention" in (getattr(config.text_config, "layer_types", None) or ()):
            raise ModelLoadError("config.json text_config: sliding-window layers are not mapped (use_sliding_window)")

    @property
    def max_tiles(self) -> int:
        """The ``n`` of ``vision_aspect_ratio = "anyres_max_<n>"``."""
        return int(ANYRES_MAX.fullmatch(self.model.config.vision_aspect_ratio).group(1))

    def _check_processor(self) -> None:
        """LLaVA-NeXT's checks, and the processor's token count computed with the model's cap."""
        super()._check_processor()
        theirs, ours = getattr(self.processor, "vision_aspect_ratio", None), self.model.config.vision_aspect_ratio
        if theirs != ours:
            raise ValueError(f"processor vision_aspect_ratio {theirs!r} differs from the model's {ours!r}")

    def anyres_layout(self, image_size: tuple[int, int], pixels: bool = True) -> AnyResMaxLayout:
        """LLaVA-NeXT's layout, the high-res map then resampled as the model's
        pack_image_features does (same threshold, same integer sizes)."""
        lay = super().anyres_layout(image_size, pixels)
        rows, cols = lay.rows, lay.cols
        ratio = math.sqrt(rows * cols / (self.max_tiles * lay.grid**2))
        if ratio > 1.1:
            rows, cols = int(rows // ratio), int(cols // ratio)
        return AnyResMaxLayout(**{**vars(lay), "rows": rows, "cols": cols}, unpadded=(lay.rows, lay.cols))

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """As :meth:`LlavaNextAdapter.visual_tokens` (base tokens, high-res tokens,
        one zero-width newline per row), a high-res token's box being its cell of
        the (resampled) map: ``scale`` unpadded features per token on each axis."""
        lay = self.anyres_layout(image_size)
        if positions is not None and len(positions) != lay.n_tokens:
            raise ValueError(f"{len(positions)} visual positions for an image that makes {lay.n_tokens} tokens")
        w, h = lay.image_size
        p, sx, sy = lay.patch, w / lay.tile, h / lay.tile
        boxes = [
            (0, r, c, 0, [c * p * sx, r * p * sy, (c + 1) * p * sx, (r + 1) * p * sy])
            for r in range(lay.grid)
            for c in range(lay.grid)
        ]
        (r0, c0), (fy, fx) = lay.keep, lay.scale
        for r in range(lay.rows):
            for c in range(lay.cols):
                y0, y1, x0, x1 = r0 + r * fy, r0 + (r + 1) * fy, c0 + c * fx, c0 + (c + 1) * fx  # full-grid features
                tile = 1 + int((y0 + y1) / 2 // lay.grid) * lay.tiles[1] + int((x0 + x1) / 2 // lay.grid)
                box = [*lay.canvas_to_original(x0 * p, y0 * p), *lay.canvas_to_original(x1 * p, y1 * p)]
                boxes.append((1, r, c, tile, box))
            _, y0, x1, y1 = boxes[-1][4]
            edge = float(round(x1))  # no patch: zero width, on a whole pixel so that no pixel mask covers it
            boxes.append((1, r, -1, None, [edge, y0, edge, y1]))
        return [
            AnyResVisualToken(i, None if positions is None else int(positions[i]), image, r, c, box, tile)
            for i, (image, r, c, tile, box) in enumerate(boxes)
        ]

    def vision_features(self, pixels):
        """``(n, 3, tile, tile)`` -> ``(n, g * g, vision width)``: the tower's hidden
        state at ``vision_feature_layer`` (CLS dropped under the "default" strategy)."""
        config = self.model.config
        out = self.model.model.vision_tower(pixel_values=pixels, output_hidden_states=True)
        features = out.hidden_states[config.vision_feature_layer]
        return features[:, 1:] if config.vision_feature_select_strategy == "default" else features
