"""Idefics3 and SmolVLM (transformers' ``Idefics3ForConditionalGeneration``
and ``SmolVLMForConditionalGeneration``): a SigLIP-style vision tower run on
image tiles, a connector (pixel shuffle + linear projection) and a Llama
decoder over interleaved tokens with plain 1-D RoPE.

Both families share the module paths (``model.model.vision_model``,
``model.model.connector``, ``model.model.text_model``, ``model.lm_head``),
the image processor and the token markup; :class:`SmolVLMAdapter` only
renames the family and its fallback prompt.

The processor (``Idefics3ImageProcessor`` / ``SmolVLMImageProcessor``) turns
one image of ``(w0, h0)`` px into frames of ``M x M`` px, ``M =
max_image_size["longest_edge"]``:

1. resize so the longest edge is ``size["longest_edge"]`` (aspect kept, the
   short edge rounded to an even number; capped at 4096 px);
2. resize (a stretch, not a pad) to ``(rows * M, cols * M)``: the longest
   edge up to a multiple of ``M``, the other edge from the aspect ratio, up
   to a multiple of ``M``;
3. if that is more than one ``M x M`` square, cut it into ``rows x cols``
   tiles (row-major) and append the whole image resized to ``M x M`` (the
   *global* image); otherwise the single ``M x M`` image is the only frame
   (``rows = cols = 0`` in the processor's bookkeeping).

Every frame is ``M x M``, so the batch padding never pads inside a frame;
frames that only pad a batch row (images with fewer tiles) are all zeros and
the model drops them. Both resizes map the full image onto the full target,
so a pixel ``(x, y)`` of the ``(rows * M, cols * M)`` image sits at ``(x *
w0 / (cols * M), y * h0 / (rows * M))`` in the original, and a pixel of the
global image at ``(x * w0 / M, y * h0 / M)``.

The vision tower cuts each frame into ``patch_size`` px patches; the
connector's pixel shuffle merges each ``scale x scale`` block of patches
into one token (channels concatenated), so a frame gives a ``g x g`` grid of
tokens, ``g = M / patch_size / scale``, in row-major order (token ``(r, c)``
holds patches ``r*scale .. r*scale+scale-1`` x ``c*scale ..``).

Token markup written by the processor for a tiled image::

    <fake_token_around_image><row_1_col_1><image>*g^2 <fake_token_around_image><row_1_col_2><image>*g^2 ... \\n
    ...                                                                                     (one \\n per tile row)
    \\n<fake_token_around_image><global-img><image>*g^2<fake_token_around_image>

and ``<fake_token_around_image><global-img><image>*g^2<fake_token_around_image>``
for an untiled image.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from core.forward.geometry import VisualToken
from core.models.adapter import config_int, size_value
from core.models.declaration import Decoder, Family
from core.models.families.llava import LlavaAdapter
from core.models.family_adapter import FamilyAdapter

# transformers' image_processing_idefics3.MAX_IMAGE_SIZE: no resized edge exceeds it.
MAX_IMAGE_SIZE = 4096
_ROW_COL = re.compile(r"^<row_\d+_col_\d+>$")


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """``(height, width)`` after the processor's first resize: the longest edge
    set to ``longest`` (up or down), the other edge from the aspect ratio and
    rounded up to an even number, then both capped at :data:`MAX_IMAGE_SIZE`.
    Mirrors transformers' ``get_resize_output_image_size`` for Idefics3."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        if height % 2 != 0:
            height += 1
    else:
        height = longest
        width = int(height * aspect)
        if width % 2 != 0:
            width += 1
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width = MAX_IMAGE_SIZE
        height = int(width / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height = MAX_IMAGE_SIZE
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """``(height, width)`` after ``resize_for_vision_encoder``: the longest edge
    rounded up to a multiple of ``tile``, the other edge from the aspect ratio,
    rounded up to a multiple of ``tile``."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = int(width / aspect)
        height = math.ceil(height / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = int(height * aspect)
        width = math.ceil(width / tile) * tile
    return height, width


class Idefics3Adapter(LlavaAdapter):
    """The canonical view of an Idefics3 model (see the module docstring).

    Differences from LLaVA:

    * the decoder is ``model.model.text_model`` (a ``LlamaModel``);
    * one image becomes several frames (tiles + a global image), so the
      number of visual tokens follows the image size and :meth:`visual_tokens`
      reports, per token, its frame (``image``: tiles ``0 .. rows*cols-1`` in
      row-major order, then the global image ``rows*cols``; an untiled image
      is the single frame 0), its row and column in that frame's merged
      ``g x g`` grid, and its box in the original image;
    * the markup tokens around and between the frames (``<fake_token_around_image>``,
      ``<row_r_col_c>``, ``<global-img>``, the newlines after each tile row)
      are :meth:`visual_delimiter_positions`.
    """

    # The connector runs per frame, (frames, tokens, d_model), not (batch, n_visual, width):
    # no visual-feature site (LLaVA's would name a projector this model lacks); patching
    # reaches the image-token positions through resid / z.
    declaration = Family(
        name="idefics3",
        architectures=("Idefics3ForConditionalGeneration",),
        # What Idefics3's own chat template renders for one user turn holding an
        # image then the question, with the generation prompt.
        prompt="<|begin_of_text|>User:<image>{question}<end_of_utterance>\nAssistant:",
        decoder=Decoder(path="model.text_model"),
    )

    # ---- text
    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        config_int(config, "scale_factor", minimum=1, required=True)
        config_int(config, "vision_config.patch_size", minimum=1, required=True)

    # The image's token count follows its size: the prompt's own tokens are checked
    # first, prepare() checks the real total.
    check_fits = FamilyAdapter.check_fits

    # ---- running: prepare (the base's) gives ``input_ids`` and ``attention_mask``
    # ``(batch, pos)``, ``pixel_values`` ``(batch, max_frames, 3, M, M)`` in the model's
    # dtype (all-zero frames pad rows with fewer tiles) and ``pixel_attention_mask``
    # ``(batch, max_frames, M, M)``. The images go to the processor one list per
    # prompt: SmolVLM's processor reads a flat list as one sample holding every image.
    images_per_prompt = True

    def extra_markup(self) -> list[str]:
        """The tile markers ``<row_r_col_c>`` the processor writes, whether or not
        the tokenizer marks them special."""
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        return [str(t) for t in added.values() if _ROW_COL.match(str(t))]

    def _is_blank(self, token_id: int) -> bool:
        return self.tokenizer.decode([int(token_id)]).strip() == ""

    def visual_delimiter_positions(self, trace, batch: int = 0) -> list[int]:
        """Positions of ``<fake_token_around_image>``, ``<row_r_col_c>``,
        ``<global-img>`` and the newline tokens that follow a tile's image
        tokens before the next ``<fake_token_around_image>`` (one per tile row,
        plus the one in front of the global image; ``"\\n\\n"`` may be one
        token or two depending on the tokenizer)."""
        ids = [int(i) for i in trace.input_ids[batch].tolist()]
        image_id = int(self.model.config.image_token_id)
        fake = self.vocab_id(getattr(self.processor, "fake_image_token", None))
        glob = getattr(self.processor, "global_image_token", None) or getattr(self.processor, "global_image_tag", None)
        marks = {t for t in (fake, self.vocab_id(glob)) if t is not None}
        strings = self.tokenizer.convert_ids_to_tokens(ids)
        out = set()
        for i, (t, s) in enumerate(zip(ids, strings)):
            if t in marks or (s is not None and _ROW_COL.match(s)):
                out.add(i)
            if t == image_id:
                j = i + 1
                while j < len(ids) and ids[j] not in (image_id, fake) and self._is_blank(ids[j]):
                    j += 1
                if j > i + 1 and j < len(ids) and ids[j] == fake:
                    out.update(range(i + 1, j))
        return sorted(out)

    # ---- geometry
    def tiling(self, image_size: tuple[int, int]) -> tuple[int, int, int, int]:
        """``(rows, cols, resized_height, resized_width)``: the tile grid the
        processor cuts an image of ``image_size = (width, height)`` into (0, 0
        when it is not tiled: one ``M x M`` frame) and the size of the image it
        cuts (``(rows * M, cols * M)``; ``(M, M)`` when not tiled)."""
        ip = self.processor.image_processor
        tile = int(size_value(ip.max_image_size, "longest_edge"))
        w, h = image_size
        if not getattr(ip, "do_image_splitting", True):
            return 0, 0, tile, tile
        if getattr(ip, "do_resize", True):
            h, w = longest_edge_size(h, w, int(size_value(ip.size, "longest_edge")))
        rh, rw = tile_multiple_size(h, w, tile)
        if rh > tile or rw > tile:
            return rh // tile, rw // tile, rh, rw
        return 0, 0, rh, rw

    def frame_grid(self) -> int:
        """``g``: each ``M x M`` frame gives a ``g x g`` grid of visual tokens."""
        ip = self.processor.image_processor
        tile = int(size_value(ip.max_image_size, "longest_edge"))
        patch = int(self.model.config.vision_config.patch_size)
        scale = int(self.model.config.scale_factor)
        g = tile // patch // scale
        seq = getattr(self.processor, "image_seq_len", g * g)
        if tile % (patch * scale) or seq != g * g:
            raise ValueError(
                f"processor (frames {tile} px, {seq} tokens each) and model (patch {patch}, "
                f"pixel shuffle {scale}) disagree"
            )
        return g

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """The :class:`core.forward.geometry.VisualToken` of every image token, in
        sequence order, boxes in the original image (``image_size = (width,
        height)``).

        ``image`` is the frame: tiles ``0 .. rows*cols-1`` row-major, then the
        global image (index ``rows*cols``); an untiled image has the single
        frame 0 (the whole image). ``row``/``col`` index the frame's ``g x g``
        merged-token grid. A tile token's box is its ``patch*scale`` px cell of
        the ``(rows*M, cols*M)`` image scaled back to the original; a global
        token's box is its cell of the ``M x M`` global image scaled back (it
        covers ``rows x cols`` times the area of a tile token).
        """

        rows, cols, rh, rw = self.tiling(image_size)
        g = self.frame_grid()
        tile = int(size_value(self.processor.image_processor.max_image_size, "longest_edge"))
        cell = tile / g
        w, h = image_size
        frames = []  # (x offset, y offset, x scale, y scale) of each frame in original pixels
        for r in range(rows):
            for c in range(cols):
                frames.append((c * tile, r * tile, w / rw, h / rh))
        frames.append((0, 0, w / tile, h / tile))  # global image (or the only frame)
        n = len(frames) * g * g
        if positions is not None and len(positions) != n:
            raise ValueError(f"{len(positions)} visual positions for {len(frames)} frames of {g}x{g} tokens")
        out = []
        for f, (ox, oy, sx, sy) in enumerate(frames):
            for k in range(g * g):
                r, c = divmod(k, g)
                i = len(out)
                box = [
                    (ox + c * cell) * sx,
                    (oy + r * cell) * sy,
                    (ox + (c + 1) * cell) * sx,
                    (oy + (r + 1) * cell) * sy,
                ]
                out.append(VisualToken(i, None if positions is None else int(positions[i]), f, r, c, box))
        return out


class SmolVLMAdapter(Idefics3Adapter):
    """SmolVLM / SmolVLM2: Idefics3's modules, processor and markup; only the
    chat template's BOS differs."""

    declaration = replace(
        Idefics3Adapter.declaration,
        name="smolvlm",
        architectures=("SmolVLMForConditionalGeneration",),
        prompt="<|im_start|>User:<image>{question}<end_of_utterance>\nAssistant:",
    )
