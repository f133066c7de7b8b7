"""The image canvas: the picture, its visual-token patch grid, patch-granular
heatmaps with hover read-outs, and the brush / eraser / box region mask."""

from app.canvas.brush import MaskPainter, box_slices, stroke_footprint
from app.canvas.image_canvas import (
    INTERPOLATED_TEXT,
    CanvasToken,
    ImageCanvas,
    as_canvas_tokens,
    describe_token_layout,
    read_token,
)

__all__ = [
    "INTERPOLATED_TEXT",
    "CanvasToken",
    "ImageCanvas",
    "MaskPainter",
    "as_canvas_tokens",
    "box_slices",
    "describe_token_layout",
    "read_token",
    "stroke_footprint",
]
