"""Llama 4 (transformers' ``Llama4ForConditionalGeneration``): a ViT over image
tiles, a pixel shuffle + MLP adapter, a linear projector, and a Llama 4 decoder
(``model.language_model.model``; ``lm_head`` beside it, no ``model.model``).

Every layer is plain pre-norm (``x += attn(n1(x)); x += ff(n2(x))``, float32
RMSNorms), but its attention is one of two kinds (``text_config.no_rope_layers``,
1 = RoPE):

* **RoPE layers** rotate *consecutive pairs* ``(x[2j], x[2j+1])`` (a complex
  product in float32, :meth:`Llama4Adapter.rotate`), then RMS-normalise q and k
  over ``d_head`` without a gain (``use_qk_norm``; transformers' ``Llama4TextL2Norm``
  is an RMS norm, float32). Their mask is *chunked* (``layer_types``
  ``"chunked_attention"``): key ``j`` is read from query ``i`` iff ``j <= i`` and
  both lie in the same ``attention_chunk_size`` chunk counted from the row's first
  real token (:meth:`Llama4Adapter.allowed_keys`; the capture records the mask
  each layer ran with and that is what the read-outs use).
* **NoPE layers** neither rotate nor normalise; with ``attn_temperature_tuning``
  the query of row ``i`` is multiplied by ``1 + attn_scale * log1p(floor((i + 1)
  / floor_scale))`` (float32; ``i`` the index in the row, not its position id), a
  per-query factor the recorded queries hold and :meth:`Llama4Adapter.queries_keys`
  applies. Full causal mask.

Feed-forward: a dense SwiGLU, or on ``moe_layers`` a mixture of experts: the
router's top-k logits through a sigmoid (no softmax, no renormalisation) scale
each chosen expert's *input*, ``y_e = down_e((s_e x G_e).silu() * (s_e x U_e))``,
plus an ungated shared expert. The module returns its output flattened over
(batch, positions) with the router logits; the hooks here see it as ``(batch,
pos, d_model)``. Components of a MoE layer's write: ``L{l}.E{e}`` (each chosen
expert's real write ``y_e``, not ``s_e * expert_e(x)``), ``L{l}.shared_expert``
and ``L{l}.experts_residue`` (the model's own summation order: rounding), the
router's scores recomputed over every (batch, pos) row at once as the model ran
it (a logit summed in another order can round the float32 sigmoid the other
way); edit site ``expert`` takes one expert's write out.

Image: the processor fits the image without distortion into a canvas of
``rows x cols`` tiles of ``S`` px (at most ``max_patches``), top-left, padding
right and below; each tile gives a ``g x g`` grid of ``<|patch|>`` tokens
(``S / patch`` patches pixel-shuffled 2 x 2), row-major, tiles row-major, and
with more than one tile a global tile (the image stretched to ``S x S``) follows
``<|image|>`` last. ``<|image_start|>``, ``<|image|>``, ``<|image_end|>`` and the
tile separators are delimiters.

Refused: the ``vision_out`` / ``projector_out`` edit sites (the projector's rows
are tiles, not prompts); configs whose layer types are neither chunked nor full
attention.
"""

from __future__ import annotations

import torch

from core.errors import ModelLoadError, UnsupportedArchitectureError
from core.forward.geometry import VisualToken
from core.models.adapter import config_int, size_value
from core.models.declaration import Decoder, Family, Mask
from core.models.family_adapter import FamilyAdapter
from core.models.norms import Norm

LAYER_TYPES = ("chunked_attention", "full_attention")


def expert_write(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s output ``(n, d_model)`` for its (score-scaled) input ``x (n, d_model)``,
    as ``Llama4TextExperts`` computes it: ``(up * act(gate)) @ down``, ``gate | up = x @ gate_up``."""
    gate, up = (x @ experts.gate_up_proj[e]).chunk(2, dim=-1)
    return (up * experts.act_fn(gate)) @ experts.down_proj[e]


class Llama4Adapter(FamilyAdapter):
    """The canonical view of a Llama 4 model (see the module docstring)."""

    declaration = Family(
        name="llama4",
        architectures=("Llama4ForConditionalGeneration",),
        prompt="<|begin_of_text|><|header_start|>user<|header_end|>\n\n<|image|>{question}<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\n",
        decoder=Decoder(path="language_model.model", unembed="language_model.lm_head", mlp="feed_forward"),
        mask=Mask(recorded=True),
        delimiters=(
            "config.boi_token_index",
            "config.eoi_token_index",
            "processor.image_token",
            "processor.tile_token",
            "processor.tile_global_token",
        ),
        edit_sites=("z", "mlp", "resid", "knockout", "expert"),
        projector="multi_modal_projector",
        no_visual_sites="the projector runs once per image tile (its rows are tiles, not prompts)",
    )
    # The processor's image token is <|image|>, which stays in the prompt as a delimiter; the model
    # scatters its features into image_token_index (<|patch|>): range checks here, the pairing in __init__.
    token_id_fields = (("image_token_index", True), ("boi_token_index", False), ("eoi_token_index", False))

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        for field in ("vision_config.image_size", "vision_config.patch_size"):
            config_int(config, field, minimum=1, required=True)
        text = config.get_text_config()
        types = list(getattr(text, "layer_types", None) or [])
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise UnsupportedArchitectureError(
                f"config.json text_config.layer_types: {unknown} not mapped for Llama 4 (only {', '.join(LAYER_TYPES)})"
            )
        if "chunked_attention" in types:
            config_int(config, "text_config.attention_chunk_size", minimum=1, required=True)
        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        ratio = float(vision.pixel_shuffle_ratio)
        g = side * ratio
        if not (0 < ratio <= 1) or g != int(g) or side % round(1 / ratio):
            raise ModelLoadError(
                f"config.json vision_config.pixel_shuffle_ratio {ratio}: does not shuffle the {side}x{side} patch grid"
            )

    def __init__(self, model, processor, tokenizer, config=None):
        super().__init__(model, processor, tokenizer, config)
        patch_id = self.vocab_id(getattr(processor, "img_patch_token", None))
        if patch_id != int(model.config.image_token_id):
            raise ModelLoadError(
                f"the processor's patch token {getattr(processor, 'img_patch_token', None)!r} is not config.json "
                f"image_token_index {model.config.image_token_id}: the model would not find the image"
            )
        vision = model.config.vision_config
        if int(processor.patch_size) != int(vision.patch_size):
            raise ModelLoadError(
                f"processor patch_size {processor.patch_size} is not vision_config.patch_size {vision.patch_size}"
            )
        if int(processor.downsample_ratio) != round(1 / float(vision.pixel_shuffle_ratio) ** 2):
            raise ModelLoadError(
                f"processor pixel_shuffle_ratio (downsample {processor.downsample_ratio}) is not "
                f"vision_config.pixel_shuffle_ratio {vision.pixel_shuffle_ratio}"
            )
        self.tile_side()

    # ---- attention: RoPE / NoPE layers, chunks, temperature
    def attention_chunk(self, block: int) -> int | None:
        """The chunk a chunked layer's queries read within (None: full causal attention)."""
        types = self.text_config.layer_types
        return int(self.text_config.attention_chunk_size) if types[block] == "chunked_attention" else None

    def temperature(self, block: int, n_pos: int) -> torch.Tensor | None:
        """``(n_pos,)`` float32: what a NoPE layer multiplies the query of row ``i`` by,
        ``1 + attn_scale * log1p(floor((i + 1) / floor_scale))`` (None: RoPE layers, or no tuning)."""
        attn = self._attn(block)
        if attn.use_rope or not attn.attn_temperature_tuning:
            return None
        rows = torch.arange(n_pos, device=self.device).float()
        return torch.log1p(torch.floor((rows + 1.0) / attn.floor_scale)) * attn.attn_scale + 1.0

    def q_norm(self, block: int) -> Norm | None:
        """RoPE layers with ``use_qk_norm``: the gainless float32 RMS norm over ``d_head``, after the rotation."""
        attn = self._attn(block)
        norm = getattr(attn, "qk_norm", None)
        return None if norm is None else Norm("rmsnorm", None, None, norm.variance_epsilon, compute_dtype=torch.float32)

    k_norm = q_norm

    def qk_gain(self, block: int) -> torch.Tensor | None:
        """Ones where q and k are RMS-normalised (no gain), else None."""
        if self.q_norm(block) is None:
            return None
        return torch.ones(self.d_head, dtype=self.parameters_dtype, device=self.device)

    def query_extras(self, block: int) -> str | None:
        if self.q_norm(block) is not None:
            return "q/k norms (gainless RMS, after the rotation)"
        if self.temperature(block, 1) is not None:
            return "attention temperature (a per-row factor on the query)"
        return None

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, block: int | None = None) -> torch.Tensor:
        """Llama 4's rotation of ``(..., pos, heads, d_head)`` at ``positions (pos,)``: each
        consecutive pair a complex number times ``polar(1, p * inv_freq)`` (times the rope's
        ``attention_scaling``), in float32, cast back; NoPE layers (``block`` given) unrotated."""
        if block is not None and not self._attn(block).use_rope:
            return x
        freqs = self.language_model.rotary_emb(x, positions.to(x.device).view(1, -1))[0]  # (pos, d_head / 2)
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs[:, None, :]).flatten(-2).type_as(x)

    def queries_keys(self, trace, block: int, batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """As the model scores them: norm, W_Q / W_K (+ bias); RoPE layers rotated and
        RMS-normalised; NoPE layers' queries times the temperature of their row."""
        x = self.attn_norm(block)(trace.resid_pre[block][batch])
        q = torch.einsum("pm,hmd->phd", x, self.W_Q(block).to(x.dtype)) + self.b_Q(block).to(x.dtype)
        k = torch.einsum("pm,hmd->phd", x, self.W_K(block).to(x.dtype)) + self.b_K(block).to(x.dtype)
        positions = self.rope_positions(trace, batch)
        q, k = self.rotate(q, positions, block), self.rotate(k, positions, block)
        norm = self.q_norm(block)
        if norm is not None:
            q, k = norm(q), norm(k)
        temperature = self.temperature(block, q.shape[0])
        if temperature is not None:
            q = (q * temperature.to(q.device).view(-1, 1, 1)).to(q.dtype)
        return q, k

    def allowed_keys(self, trace, block: int, batch: int = 0) -> torch.Tensor:
        """The mask the layer ran with where recorded; else causal (and padding), cut into
        chunks from the row's first real token on a chunked layer."""
        allowed = super().allowed_keys(trace, block, batch)
        chunk = self.attention_chunk(block)
        if getattr(trace, "decoder_masks", {}).get(block) is not None or chunk is None:
            return allowed
        mask = trace.attention_mask
        left = 0 if mask is None else int((mask[batch].cumsum(-1) == 0).sum())
        i = torch.arange(allowed.shape[0]).view(-1, 1)
        return allowed & ((i - left) // chunk == (i.view(1, -1) - left) // chunk)

    # ---- mixture of experts
    def moe_experts(self, block: int) -> int:
        layer = self._layer(block)
        return int(layer.feed_forward.num_experts) if layer.is_moe_layer else 0

    def expert_writes(self, block: int, x: torch.Tensor, expert: int | None = None) -> list:
        """``L{l}.E{e}``: expert ``e`` on its router score times ``x`` (zero rows where not
        chosen: its input is 0 and it has no bias); ``L{l}.shared_expert`` (all experts only).
        ``x`` is every row the model routed at once (the router's float32 sigmoid of a logit
        summed in another order may round the other way)."""
        return self._expert_parts(block, x, self._layer(block).feed_forward.router(x)[0], expert)

    def _expert_parts(self, block: int, x: torch.Tensor, scores: torch.Tensor, expert: int | None) -> list:
        moe = self._layer(block).feed_forward
        out = []
        for e in range(moe.num_experts) if expert is None else [expert]:
            rows = torch.nonzero(scores[:, e]).flatten()
            write = torch.zeros_like(x)
            if len(rows):
                write[rows] = expert_write(moe.experts, e, x[rows] * scores[rows, e, None])
            out.append((f"L{block}.E{e}", write))
        if expert is None:
            out.append((f"L{block}.shared_expert", moe.shared_expert(x)))
        return out

    def expert_parts_at(self, trace, block: int, position: int, batch: int = 0) -> list:
        """The parts at ``position`` with the router's scores taken as the model took them:
        over every (batch, pos) row at once."""
        x = trace.mlp_in[block]
        scores = self._layer(block).feed_forward.router(x.reshape(-1, x.shape[-1]))[0]
        scores = scores.view(*x.shape[:-1], -1)[batch, position][None]
        return [(n, v[0]) for n, v in self._expert_parts(block, x[batch, position][None], scores, None)]

    def _moe_output_shaped(self, regs: list) -> list:
        """Forward hooks on a MoE module see its output ``(batch * pos, d_model)`` as
        ``(batch, pos, d_model)`` (its input's shape) without the router logits, and
        what they return goes back flattened beside them."""
        moe = {id(self._layer(b).feed_forward) for b in range(self.n_layers) if self.moe_experts(b)}

        def shaped(fn):
            def hook(module, args, *rest):
                *kwargs, (flat, logits) = rest
                x = args[0] if args else kwargs[0]["hidden_states"]
                got = fn(module, args, *kwargs, flat.view(x.shape))
                return None if got is None else (got.reshape(flat.shape), logits)

            return hook

        return [
            (m, kind, shaped(fn)) if id(m) in moe and kind in ("fwd", "fwd_kw") else (m, kind, fn)
            for m, kind, fn in regs
        ]

    def edit_hooks(self, edits) -> list:
        return self._moe_output_shaped(super().edit_hooks(edits))

    def capture_hooks(self, layer: int, trace, keep_pattern: bool) -> list:
        return self._moe_output_shaped(super().capture_hooks(layer, trace, keep_pattern))

    # ---- geometry
    def tile_side(self) -> int:
        """``S``: the square tile the processor cuts (checked against the vision tower's input)."""
        ip = self.processor.image_processor
        h, w = size_value(ip.size, "height"), size_value(ip.size, "width")
        side = int(self.model.config.vision_config.image_size)
        if h != side or w != side:
            raise ModelLoadError(f"processor size {ip.size} is not the vision tower's {side}x{side} tile")
        return side

    def tile_layout(self, image_size: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((rows, cols) of tiles, (width, height) the image is resized to)`` for an image of
        ``image_size = (width, height)``, by transformers' own canvas choice and resize."""
        from transformers.image_utils import SizeDict
        from transformers.models.llama4.image_processing_llama4 import (
            find_supported_resolutions,
            get_best_fit,
            get_max_res_without_distortion,
        )

        ip = self.processor.image_processor
        side = self.tile_side()
        w, h = image_size
        options = torch.tensor(find_supported_resolutions(int(ip.max_patches), SizeDict(height=side, width=side)))
        th, tw = (int(v) for v in get_best_fit((h, w), options, resize_to_max_canvas=bool(ip.resize_to_max_canvas)))
        target = (th, tw) if ip.resize_to_max_canvas else (min(max(h, side), th), min(max(w, side), tw))
        nh, nw = get_max_res_without_distortion((h, w), target)
        return (th // side, tw // side), (max(nw, 1), max(nh, 1))

    def resized_pixels(self, image_size: tuple[int, int]) -> tuple[int, str]:
        (rows, cols), _ = self.tile_layout(image_size)
        n = rows * cols + (rows * cols > 1)
        side = self.tile_side()
        return n * side * side, f"max_patches = {self.processor.image_processor.max_patches} tiles of {side} px"

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """Every ``<|patch|>`` token in sequence order, boxes in the original image: tile
        ``t = row * cols + col`` (``image`` t) token ``(r, c)`` covers canvas pixels
        ``[col * S + c * S / g, row * S + r * S / g, ...]``, scaled back by the resize
        (tokens over the padding reach past the image); the global tile (``image`` =
        the tile count, only with several tiles) is the whole image stretched to ``S x S``."""
        (rows, cols), (nw, nh) = self.tile_layout(image_size)
        side = self.tile_side()
        vision = self.model.config.vision_config
        g = round(side // vision.patch_size * float(vision.pixel_shuffle_ratio))
        cell = side / g
        w, h = image_size
        frames = [(t, (t // cols) * side, (t % cols) * side, w / nw, h / nh) for t in range(rows * cols)]
        if rows * cols > 1:
            frames.append((rows * cols, 0, 0, w / side, h / side))
        n = len(frames) * g * g
        if positions is not None and len(positions) != n:
            raise ValueError(f"{len(positions)} visual positions for an image that makes {n} tokens")
        out = []
        for image, y0, x0, sx, sy in frames:
            for r in range(g):
                for c in range(g):
                    box = [
                        (x0 + c * cell) * sx,
                        (y0 + r * cell) * sy,
                        (x0 + (c + 1) * cell) * sx,
                        (y0 + (r + 1) * cell) * sy,
                    ]
                    i = len(out)
                    out.append(VisualToken(i, None if positions is None else int(positions[i]), image, r, c, box))
        return out
