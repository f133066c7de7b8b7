"""Mllama / Llama 3.2 Vision (transformers' ``MllamaForConditionalGeneration``):
a tiled ViT whose states the language model reads through interleaved
cross-attention layers.

Vision side. The processor resizes the image to fit the best canvas of
``n_h x n_w`` square tiles (``n_h * n_w <= max_image_tiles``, aspect ratio
kept), pads the canvas with zeros on the right and bottom, cuts it into tiles
(row-major) and zero-fills the tile axis up to ``max_image_tiles``. The vision
model prepends a class token to every tile's ``(image_size / patch_size)^2``
patches, adds gated (tile-)positional embeddings, runs a local then a global
transformer over all tiles at once, and concatenates the global output with
intermediate local layers; the multimodal projector maps that to the text
width. The result, ``cross_attention_states``, has one row per (image, tile,
patch) with ``num_patches = (image_size / patch_size)^2 + 1`` rows per tile
(the vision model pads each tile to a multiple of 8 patches internally and
slices the padding off again, so no padding patch reaches the text model).
Cross-attention key ``k`` of image 0 is tile ``k // num_patches``, patch
``k % num_patches``: patch 0 is the tile's class token, patch ``1 + r * g + c``
the patch at row ``r``, column ``c`` of the tile's ``g x g`` grid. Tiles past
the image's own tile count are *padding tiles* (all-zero pixels).

Text side. A Llama decoder (RMSNorm, RoPE, grouped-query K/V) whose layers at
``text_config.cross_attention_layers`` are ``MllamaCrossAttentionDecoderLayer``::

    x = x + tanh(g_attn) * o_proj(cross_attn(input_layernorm(x), vision states))
    x = x + tanh(g_mlp) * row_mask * mlp(post_attention_layernorm(x))

The canonical view has one block per layer: ``"L{l}"`` (kind "self") for a
self-attention layer and ``"L{l}.xattn"`` (kind "cross") for a cross-attention
layer, so the residual components are ``L{l}.H{h}``, ``L{l}.xattn.H{h}``,
``L{l}.mlp`` and ``L{l}.xattn.mlp`` (the cross layer's gated MLP).

Cross-attention specifics (all read off transformers' code and checked by
tests/core/test_mllama.py):

* **Gates folded in.** :meth:`MllamaAdapter.W_O` of a cross block is
  ``tanh(g_attn) * o_proj``, so ``sum_h z^h W_O^h`` is the block's actual
  contribution to the residual; ``trace.attn_out`` holds the gated output and
  ``trace.mlp_out`` the gated, row-masked MLP output. ``trace.z`` is the
  ungated ``o_proj`` input. With the gates at their initial 0 (a fresh model)
  the cross path contributes exactly nothing.
* **Keys and values read the projector output directly**: no norm before
  ``k_proj``/``v_proj`` (``kv_norm`` is the identity), ``trace.kv_source`` is
  ``cross_attention_states`` ``(batch, n_keys, d_model)``.
* **q_norm / k_norm.** Each head's query and key pass an RMSNorm over
  ``d_head`` (one gain shared by the heads) *after* the projection; there is
  no RoPE. The score is therefore
  ``(q^T diag(g_q * g_k) k) / (rms(q) rms(k) sqrt(d_head))``: the canonical
  bilinear form ``W_Q W_K^T`` is only the direction part; every query and
  every key also carries its own positive factor ``1 / rms``. Use
  :meth:`MllamaAdapter.queries` / :meth:`MllamaAdapter.keys` (which apply
  q_norm/k_norm on cross blocks and RoPE on self blocks) rather than
  :meth:`rotate`, which is RoPE only and must not be applied on a cross block;
  :meth:`MllamaAdapter.qk_gain` gives ``g_q * g_k``.
* **Mask.** ``cross_attention_mask`` ``(batch, pos, images, tiles)`` says which
  tiles each text row sees: rows from an image's ``<|image|>`` token on see
  that image's real tiles (never its padding tiles); rows before the first
  image token see nothing. transformers turns a fully masked row into *no
  mask at all* (the additive mask is multiplied by
  ``full_text_row_masked_out_mask``), so such rows attend to every key,
  padding tiles included, and -- unlike Meta's reference implementation --
  their attention output is NOT zeroed: only the MLP output is
  (``row_mask``; transformers issue #39379). :meth:`MllamaAdapter.allowed_keys`
  reproduces exactly that; :meth:`MllamaAdapter.text_rows_without_image` lists
  the rows concerned. Every capture checks that the recorded writes add up to
  each cross layer's output bit for bit; should transformers adopt the
  reference's masking, the check finds the masked variant and records it
  (``attn_out`` and ``z`` zeroed on those rows), and any other change is an error.
"""

from __future__ import annotations

import torch

from core.errors import ModelLoadError
from core.forward.capture import on_device_of, run_with_hooks
from core.forward.edits import Edit
from core.forward.geometry import VisualToken
from core.models.adapter import ModelInputs, config_int, config_value, size_value
from core.models.declaration import Family
from core.models.family_adapter import FamilyAdapter, pattern_hook
from core.models.norms import IdentityNorm, Norm

# What Llama 3.2 Vision Instruct's chat template renders for one user turn
# holding an image then the question, with the generation prompt (used when
# the processor has no chat template).
MLLAMA_PROMPT = (
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<|image|>{question}<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


def _canvas_functions():
    """transformers' own canvas arithmetic (the torchvision and PIL processors share it)."""
    try:
        from transformers.models.mllama.image_processing_mllama import (
            get_image_size_fit_to_canvas,
            get_optimal_tiled_canvas,
        )
    except ImportError:  # torchvision missing: the PIL backend defines the same functions
        from transformers.models.mllama.image_processing_pil_mllama import (
            get_image_size_fit_to_canvas,
            get_optimal_tiled_canvas,
        )
    return get_optimal_tiled_canvas, get_image_size_fit_to_canvas


class MllamaAdapter(FamilyAdapter):
    """The canonical view of an Mllama model (see the module docstring): a
    Llama decoder as declared; its own the gated cross-attention layers."""

    declaration = Family(
        name="mllama",
        architectures=("MllamaForConditionalGeneration",),
        prompt=MLLAMA_PROMPT,
        attention="cross",
        # The <|image|> placeholders mark where an image's cross-attention starts but carry no patch.
        delimiters=("config.image_token_id",),
        edit_sites=("z", "mlp", "knockout"),
    )

    # ---- structure
    @property
    def cross_layers(self) -> list[int]:
        return sorted(int(i) for i in self.text_config.cross_attention_layers)

    def is_cross(self, block: int) -> bool:
        return block in self.cross_layers

    @property
    def blocks(self) -> list[tuple[str, str]]:
        """One block per decoder layer: ``("L{l}", "self")`` or ``("L{l}.xattn", "cross")``."""
        return [
            (f"L{layer}.xattn", "cross") if self.is_cross(layer) else (f"L{layer}", "self")
            for layer in range(self.n_layers)
        ]

    def _attn(self, layer: int):
        block = self.language_model.layers[layer]
        return block.cross_attn if self.is_cross(layer) else block.self_attn

    @property
    def vision_model(self):
        return self.model.model.vision_model

    @property
    def num_patches(self) -> int:
        """Cross-attention keys per tile: the class token + the patch grid."""
        return int(self.vision_model.num_patches)

    # ---- text
    @classmethod
    def check_config(cls, config) -> None:
        """Also ``text_config.cross_attention_layers``: distinct layer indices of the decoder."""
        super().check_config(config)
        n = config_int(config, "text_config.num_hidden_layers", minimum=1, required=True)
        layers = config_value(config, "text_config.cross_attention_layers")
        valid = isinstance(layers, (list, tuple)) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in layers
        )
        if not valid or len(set(layers)) != len(layers):
            raise ModelLoadError(
                f"config.json text_config.cross_attention_layers: expected distinct layer indices in "
                f"0..{n - 1}, got {layers!r}"[:300]
            )

    # ---- running: prepare (the base's, FamilyAdapter's check_fits) gives one
    # right-padded batch, one image per question: ``input_ids`` and ``attention_mask``
    # ``(batch, pos)``, ``pixel_values`` ``(batch, 1, max_tiles, C, tile, tile)`` in the
    # model's dtype, ``aspect_ratio_ids`` ``(batch, 1)``, ``aspect_ratio_mask``
    # ``(batch, 1, max_tiles)`` and ``cross_attention_mask`` ``(batch, pos, 1, max_tiles)``.
    images_per_prompt = True

    def processor_options(self, prompts: list[str]) -> dict:
        """No BOS from the tokenizer when the rendered prompts already start with
        one (Llama 3's tokenizer prepends ``<|begin_of_text|>`` and so does the chat
        template)."""
        bos = getattr(self.processor.tokenizer, "bos_token", None)
        return {"add_special_tokens": not (bool(bos) and all(p.startswith(bos) for p in prompts))}

    def append_token(self, inputs: ModelInputs, token_id: int) -> ModelInputs:
        """The batch (of one) with a token appended; its cross-attention mask row
        repeats the last one, as transformers' generation does."""
        longer = super().append_token(inputs, token_id)
        cam = longer.tensors["cross_attention_mask"]
        longer.tensors["cross_attention_mask"] = torch.cat([cam, cam[:, -1:]], dim=1)
        return longer

    # ---- canonical weights: the declared ones on self or cross attention, gates folded in
    def W_O(self, layer: int) -> torch.Tensor:
        """``(heads, d_head, d_model)``; on a cross block ``tanh(cross_attn_attn_gate) * o_proj``,
        so head outputs sum to what the block adds to the residual."""
        w = super().W_O(layer)
        if self.is_cross(layer):
            w = self.language_model.layers[layer].cross_attn_attn_gate.tanh() * w
        return w

    def kv_norm(self, block: int):
        """Self blocks: ``input_layernorm``; cross blocks: the identity (``k_proj`` and
        ``v_proj`` read the projector output as it is)."""
        return IdentityNorm() if self.is_cross(block) else self.attn_norm(block)

    def q_norm(self, block: int) -> Norm | None:
        """The per-head RMSNorm over ``d_head`` applied to queries after ``q_proj``
        (cross blocks; None on self blocks)."""
        return self._norm(self._attn(block).q_norm) if self.is_cross(block) else None

    def k_norm(self, block: int) -> Norm | None:
        """The per-head RMSNorm over ``d_head`` applied to keys after ``k_proj``
        (cross blocks; None on self blocks)."""
        return self._norm(self._attn(block).k_norm) if self.is_cross(block) else None

    def queries(self, block: int, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The queries block ``block`` scores with, ``(pos, heads, d_head)``.

        Args:
            x: ``(pos, d_model)`` the normed stream, ``attn_norm(block)(resid_pre)``.
            positions: RoPE positions ``(pos,)`` (self blocks; ignored on cross blocks,
                which apply ``q_norm`` instead and have no RoPE).
        """
        q = torch.einsum("pm,hmd->phd", x, self.W_Q(block).to(x.dtype)) + self.b_Q(block).to(x.dtype)
        if self.is_cross(block):
            return self.q_norm(block)(q)
        return self.rotate(q, torch.arange(x.shape[0]) if positions is None else positions)

    def keys(self, block: int, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The keys, ``(keys, heads, d_head)`` per query head (groups expanded).

        Args:
            x: ``(keys, d_model)`` the normed key source, ``kv_norm(block)(source)``
                (the stream for self blocks, ``trace.kv_source[block][b]`` for cross).
            positions: RoPE positions ``(keys,)`` (self blocks only).
        """
        k = torch.einsum("pm,hmd->phd", x, self.W_K(block).to(x.dtype)) + self.b_K(block).to(x.dtype)
        if self.is_cross(block):
            return self.k_norm(block)(k)
        return self.rotate(k, torch.arange(x.shape[0]) if positions is None else positions)

    def queries_keys(self, trace, block: int, batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``(pos, heads, d_head)`` and keys ``(keys, heads, d_head)`` as the
        model scores them, recomputed from the capture: RoPE on self blocks;
        on cross blocks q_norm/k_norm on the projections of the normed stream
        and of the (un-normed) vision states, no RoPE."""
        x = self.attn_norm(block)(trace.resid_pre[block][batch])
        if self.is_cross(block):
            return self.queries(block, x), self.keys(block, self.kv_norm(block)(trace.kv_source[block][batch]))
        positions = self.rope_positions(trace, batch)
        return self.queries(block, x, positions), self.keys(block, x, positions)

    def edit_hooks(self, edits) -> list:
        """As :meth:`Adapter.edit_hooks`; an MLP patch of a cross block gives the
        value of the layer's *write* (``trace.mlp_out`` units: gated and row
        masked), so the hook sets the MLP output to ``value / tanh(g_mlp)``.

        Raises (during the run):
            ValueError: a nonzero patch at a text row before the image (the layer
                zeroes its MLP there whatever the MLP computes) or on a closed gate.
        """
        is_cross_mlp = [e.site == "mlp" and e.value is not None and self.is_cross(e.block) for e in edits]
        regs = super().edit_hooks([e for e, c in zip(edits, is_cross_mlp) if not c])
        for e in (e for e, c in zip(edits, is_cross_mlp) if c):
            layer = self.language_model.layers[e.block]
            state: dict = {}

            def row_mask(module, args, kwargs, state=state):
                state["row"] = kwargs.get("full_text_row_masked_out_mask")

            def mlp(module, args, out, e=e, layer=layer, state=state):

                gate = layer.cross_attn_mlp_gate.tanh()
                value = e.value.to(out.dtype).to(out.device)
                row = state.get("row")
                pos = slice(None) if e.positions is None else list(e.positions)
                open_rows = torch.ones(out.shape[1], dtype=torch.bool, device=out.device)
                if row is not None:
                    open_rows = row[:, 0, :, 0].bool().all(0)
                closed = ~open_rows[pos]  # (n_edited,)
                nonzero = (value != 0).reshape(-1, value.shape[-1]).any(-1)  # (rows of value,)
                if nonzero.numel() == closed.numel():
                    blocked = bool((nonzero & closed).any())
                else:  # a broadcast value
                    blocked = bool(nonzero.any() and closed.any())
                if (float(gate) == 0 and bool(nonzero.any())) or blocked:
                    raise ValueError(
                        f"block {e.block}: the cross layer writes no MLP output at text rows before the image "
                        "(or with its gate closed); a nonzero patch cannot be realised there"
                    )
                raw = value / gate if float(gate) != 0 else value
                return Edit(e.block, None, e.positions, raw).apply(out)

            regs += [(layer, "pre_kw", row_mask), (layer.mlp, "fwd", mlp)]
        return regs

    # ---- capture (visual_positions: the base's, none in the text sequence; rotate:
    # the declared RoPE, self-attention blocks only, see queries())
    def run_capture(self, inputs: ModelInputs, trace, keep: set[int]) -> None:
        """Hooks around transformers' forward; also records
        ``trace.cross_attention_mask`` ``(batch, pos, images, tiles)`` (what
        :meth:`allowed_keys` reads)."""

        trace.cross_attention_mask = inputs.tensors.get("cross_attention_mask")
        run_with_hooks(self, inputs, trace, keep)
        missing = [b for b in range(trace.n_blocks) if trace.resid_pre[b] is None]
        if missing:
            raise RuntimeError(f"blocks {missing} did not run (a cross layer without vision states?)")

    def capture_hooks(self, layer: int, trace, keep_pattern: bool) -> list:
        """Hooks that fill ``trace`` for block ``layer``; on a cross block the
        recorded ``attn_out`` / ``mlp_out`` carry the tanh gates (and the MLP the
        row mask) exactly as the layer adds them, and ``kv_source`` the vision states."""
        block = self.language_model.layers[layer]
        cross = self.is_cross(layer)
        attn = block.cross_attn if cross else block.self_attn
        state: dict = {}

        def resid_pre(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            trace.resid_pre[layer] = on_device_of(block, x)
            if cross:
                states = kwargs.get("cross_attention_states")
                if states is None:
                    raise RuntimeError("cross-attention layer run without vision states (cached run?)")
                trace.kv_source[layer] = states.reshape(x.shape[0], -1, states.shape[-1])
                state["row_mask"] = kwargs.get("full_text_row_masked_out_mask")

        def z_in(module, args):
            x = args[0]
            trace.z[layer] = x.view(*x.shape[:-1], self.n_heads, self.d_head)

        def attn_out(module, args, out):
            gated = block.cross_attn_attn_gate.tanh() * out if cross else out
            if cross:  # held until the layer's output is checked (layer_out)
                state["o_out"], state["attn_out"] = out, gated
            if trace.keep_attn_out:
                trace.attn_out[layer] = gated

        def mlp_out(module, args, out):
            if cross:
                state["mlp_raw"] = out  # the same operations, in the same order, as the layer
                row = state.get("row_mask")
                if row is not None:
                    out = row[:, 0] * out
                out = block.cross_attn_mlp_gate.tanh() * out
            trace.mlp_out[layer] = out

        def layer_out(module, args, out):
            """The recorded parts must add up to what the cross layer returns; if
            they do not, try the row-masked attention output that Meta's reference
            applies (transformers issue #39379) before giving up."""
            out = out[0] if isinstance(out, tuple) else out
            x = trace.resid_pre[layer]
            if torch.equal(out, (x + state.pop("attn_out")) + trace.mlp_out[layer]):
                state.clear()
                return
            row = state.get("row_mask")
            if row is not None:
                row = row[:, 0]  # (batch, pos, 1)
                gate_a, gate_m = block.cross_attn_attn_gate.tanh(), block.cross_attn_mlp_gate.tanh()
                for attn_masked, mlp_masked in ((True, True), (True, False), (False, False)):
                    a = gate_a * (row * state["o_out"]) if attn_masked else gate_a * state["o_out"]
                    m = gate_m * (row * state["mlp_raw"]) if mlp_masked else gate_m * state["mlp_raw"]
                    if torch.equal(out, (x + a) + m):
                        trace.mlp_out[layer] = m
                        if trace.keep_attn_out:
                            trace.attn_out[layer] = a
                        if attn_masked:  # so that sum_h z^h W_O^h is still the block's write
                            trace.z[layer] = row.unsqueeze(-1) * trace.z[layer]
                        state.clear()
                        return
            gated = block.cross_attn_attn_gate.tanh() * state["o_out"]
            err = float((out - (x + gated) - trace.mlp_out[layer]).abs().max())
            raise RuntimeError(
                f"cross layer {layer}: the recorded attention and MLP writes miss its output by {err:.3g}; "
                "transformers' MllamaCrossAttentionDecoderLayer changed"
            )

        regs = [
            (block, "pre_kw", resid_pre),
            (attn.o_proj, "pre", z_in),
            (attn.o_proj, "fwd", attn_out),
            (block.mlp, "fwd", mlp_out),
        ]
        if cross:
            regs.append((block, "fwd", layer_out))
        if keep_pattern:
            regs.append((attn, "fwd", pattern_hook(trace, layer)))
        return regs

    # ---- masks
    def _key_mask(self, trace, batch: int) -> torch.Tensor | None:
        """``(pos, keys)`` bool from ``cross_attention_mask`` (each tile flag
        repeated over its ``num_patches`` keys), before transformers' full-row fix."""
        cam = getattr(trace, "cross_attention_mask", None)
        if cam is None:
            return None
        cam = cam[batch].bool().cpu()  # (pos, images, tiles)
        return cam.repeat_interleave(self.num_patches, dim=-1).reshape(cam.shape[0], -1)

    def text_rows_without_image(self, trace, batch: int = 0) -> torch.Tensor:
        """``(pos,)`` bool: text rows that see no tile (before the first ``<|image|>``).
        In every cross block they attend to all keys and their MLP output is zeroed."""
        mask = self._key_mask(trace, batch)
        if mask is None:
            return torch.zeros(trace.input_ids.shape[1], dtype=torch.bool)
        return ~mask.any(-1)

    def allowed_keys(self, trace, block: int, batch: int = 0) -> torch.Tensor:
        """``(pos, keys)`` bool. Self blocks: causal, padding excluded. Cross blocks:
        the tiles ``cross_attention_mask`` allows (padding tiles never), and every
        key for rows that see no tile (transformers drops the mask on such rows)."""
        if trace.block_kinds[block] != "cross":
            return super().allowed_keys(trace, block, batch)
        n_keys = trace.kv_source[block].shape[1]
        mask = self._key_mask(trace, batch)
        if mask is None:
            return torch.ones(trace.input_ids.shape[1], n_keys, dtype=torch.bool)
        if mask.shape[1] != n_keys:
            raise ValueError(f"cross_attention_mask covers {mask.shape[1]} keys, the block read {n_keys}")
        mask[~mask.any(-1)] = True
        return mask

    # ---- geometry
    def tile_layout(self, image_size: tuple[int, int]) -> tuple[int, int, int, int, int]:
        """``(tiles_high, tiles_wide, resized_height, resized_width, tile)`` for an
        image of ``image_size = (width, height)``: the canvas transformers picks
        (get_optimal_tiled_canvas), the size the image is resized to inside it
        (top-left, aspect kept; the rest of the canvas is zero padding) and the
        tile side in pixels."""
        ip = self.processor.image_processor
        tile = int(size_value(ip.size, "height"))
        vision = self.model.config.vision_config
        size = vision.image_size if isinstance(vision.image_size, int) else vision.image_size[0]
        if tile != size:
            raise ValueError(f"processor tile {tile} px and vision tower image_size {size} disagree")
        optimal_canvas, fit_to_canvas = _canvas_functions()
        w, h = image_size
        canvas_h, canvas_w = optimal_canvas(int(h), int(w), int(ip.max_image_tiles), tile)
        new_h, new_w = fit_to_canvas(int(h), int(w), int(canvas_h), int(canvas_w), tile)
        return int(canvas_h) // tile, int(canvas_w) // tile, int(new_h), int(new_w), tile

    def _patch_size(self) -> int:
        p = self.model.config.vision_config.patch_size
        return int(p if isinstance(p, int) else p[0])

    def key_kinds(self, image_size: tuple[int, int]) -> list[str]:
        """One kind per cross-attention key of one image: "cls" (a tile's class
        token), "patch", or "pad_tile" (any key of a padding tile)."""
        rows, cols, *_ = self.tile_layout(image_size)
        n_tiles = int(self.processor.image_processor.max_image_tiles)
        out = []
        for t in range(n_tiles):
            for p in range(self.num_patches):
                out.append("pad_tile" if t >= rows * cols else "cls" if p == 0 else "patch")
        return out

    def canvas_grid(self, image_size: tuple[int, int]) -> tuple[int, int, torch.Tensor]:
        """``(rows, cols, cell)``: the patch grid of the whole canvas
        (``tiles_high * g`` by ``tiles_wide * g`` patches, ``g = tile / patch``) and,
        per cross-attention key of one image, ``(n_keys,)`` its flat cell
        ``row * cols + col`` on that grid (-1 for class tokens and padding
        tiles), so a per-key quantity can be drawn as one heatmap over the image."""
        n_th, n_tw, _, _, tile = self.tile_layout(image_size)
        g = tile // self._patch_size()
        rows, cols = n_th * g, n_tw * g
        cell = torch.full((int(self.processor.image_processor.max_image_tiles) * self.num_patches,), -1)
        for t in range(n_th * n_tw):
            tr, tc = divmod(t, n_tw)
            for p in range(1, self.num_patches):
                r, c = divmod(p - 1, g)
                cell[t * self.num_patches + p] = (tr * g + r) * cols + tc * g + c
        return rows, cols, cell

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """:class:`core.forward.geometry.VisualToken` per cross-attention key of one image
        (``max_image_tiles * num_patches``, in key order), boxes in the original
        image (``image_size = (width, height)``); ``position`` is None (keys are
        not sequence positions).

        ``image`` is the tile index (row-major over the canvas); ``row``/``col``
        the patch's row and column in its tile's grid. A class token has
        ``row = col = -1`` and the box of its whole tile. A padding tile's keys
        (see :meth:`key_kinds`) have ``row = col = -1`` and the empty box
        ``[0, 0, 0, 0]``: they cover no pixel. Patches over the canvas padding
        reach past the image's right or bottom edge.
        """

        if positions is not None and any(p is not None for p in positions):
            raise ValueError("Mllama's visual tokens are cross-attention keys: they have no sequence positions")
        rows, cols, new_h, new_w, tile = self.tile_layout(image_size)
        patch = self._patch_size()
        grid = tile // patch
        w, h = image_size
        sx, sy = w / new_w, h / new_h
        n_tiles = int(self.processor.image_processor.max_image_tiles)
        out = []
        for t in range(n_tiles):
            tr, tc = divmod(t, cols)
            for p in range(self.num_patches):
                index = t * self.num_patches + p
                if t >= rows * cols:
                    out.append(VisualToken(index, None, t, -1, -1, [0.0, 0.0, 0.0, 0.0]))
                    continue
                if p == 0:
                    x0, y0, x1, y1 = tc * tile, tr * tile, (tc + 1) * tile, (tr + 1) * tile
                    r = c = -1
                else:
                    r, c = divmod(p - 1, grid)
                    x0, y0 = tc * tile + c * patch, tr * tile + r * patch
                    x1, y1 = x0 + patch, y0 + patch
                out.append(VisualToken(index, None, t, r, c, [x0 * sx, y0 * sy, x1 * sx, y1 * sy]))
        return out
