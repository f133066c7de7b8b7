"""open_clip CoCa: a ViT vision tower, a causal text tower, and a
multimodal decoder whose cross-attention layers read the image tokens."""

from __future__ import annotations

import re

import torch
from PIL import Image

from core.errors import InterventionError, QuestionError
from core.forward.attention_rows import WeightsRows
from core.forward.capture import record_pattern, wants_pattern
from core.forward.geometry import VisualToken, resize_crop_boxes
from core.models.adapter import Adapter, ModelInputs
from core.models.declaration import Decoder, Family, Rotary
from core.models.norms import Norm
from core.shell.precision import accumulating, unit_roundoff


def _media_kind(token: str) -> str | None:
    """The kind of a markup token named for an image or a video (``<image>``,
    ``<img>``: "image"; ``<|video_pad|>``: "video"), else None."""
    if not isinstance(token, str) or not token.startswith("<") or not token.endswith(">"):
        return None
    words = re.split(r"[^a-z]+", token.lower())
    if "video" in words:
        return "video"
    return "image" if {"image", "img"} & set(words) else None


class CocaAdapter(Adapter):
    """``processor`` is open_clip's image transform; ``tokenizer`` a Hugging
    Face tokenizer (the default models) or open_clip's tokenizer."""

    # open_clip's text decoder and its cross-attention blocks are replayed by this file's own code.
    declaration = Family(
        name="coca",
        open_clip_classes=("CoCa",),
        attention="cross",
        decoder=Decoder(path=None, norm="layernorm"),
        rotary=Rotary("absolute"),
        edit_sites=("z", "mlp", "resid", "knockout", "kv_source"),  # applied in the replay (run_capture)
    )

    records_qk = True  # the replay fills trace.q / trace.k itself
    replays_edits = True  # edits are applied in the replay (run_capture), no hook reaches them
    attention_functions = False  # the replay computes each pattern (open_clip's attention has no weights to hook)

    @property
    def decoder(self):
        return self.model.text_decoder

    @property
    def n_layers(self) -> int:
        return len(self.decoder.resblocks)

    @property
    def n_heads(self) -> int:
        return self.decoder.resblocks[0].attn.num_heads

    @property
    def d_model(self) -> int:
        return self.decoder.width

    @property
    def context_length(self) -> int:
        return int(self.model.text.positional_embedding.shape[0])

    def _encode(self, text: str) -> list[int]:
        if hasattr(self.tokenizer, "encode") and hasattr(self.tokenizer, "get_vocab"):
            return list(self.tokenizer.encode(text))  # Hugging Face tokenizer, <s> included
        # open_clip tokenizer: [sot, ..., eot, pad...]; continue after the text, so drop eot/pad.
        ids = self.tokenizer([text])[0].tolist()
        eot = getattr(self.tokenizer, "eot_token_id", None)
        return ids[: ids.index(eot)] if eot in ids else [i for i in ids if i != 0]

    def extra_placeholders(self) -> dict[str, str]:
        """CoCa reads its image through cross-attention, never as a text token, so
        its processor names no placeholder; a special token of its tokenizer named
        for an image or a video (the default models' shared vocabulary has
        ``<image>``) stands for one all the same, and is refused in every
        question, raw prompts too, as every family's placeholder is."""
        tok = self.tokenizer
        strings = set(getattr(tok, "all_special_tokens", None) or [])
        strings.update(str(t) for t in (getattr(tok, "added_tokens_decoder", None) or {}).values())
        decoder = getattr(tok, "decoder", None)
        if isinstance(decoder, dict):  # open_clip's SimpleTokenizer
            strings.update(decoder[i] for i in getattr(tok, "all_special_ids", []) if i in decoder)
        return {s: kind for s in strings if (kind := _media_kind(s)) is not None}

    def check_fits(self, question: str, ids: list[int]) -> None:
        # The text tower appends a CLS token, so one position is reserved.
        n = len(self._encode(self.prompt(question)))
        if n + 1 > self.context_length:
            raise QuestionError(f"the question is too long: {n} tokens, the model takes {self.context_length - 1}")

    def token_str(self, token_id: int) -> str:
        if hasattr(self.tokenizer, "decode"):
            return self.tokenizer.decode([int(token_id)]).strip()
        return str(token_id)

    def prompt_inputs(self, images: list[Image.Image], questions: list[str], raw_prompt: bool = False) -> ModelInputs:
        images, prompts = self.checked_batch(images, questions, raw_prompt)  # RGB PIL images, EXIF applied
        encoded = [self._encode(p) for p in prompts]
        longest = max(len(e) for e in encoded)
        pad = getattr(self.model, "pad_id", 0)
        ids = torch.full((len(encoded), longest), pad, dtype=torch.long)
        for i, e in enumerate(encoded):
            ids[i, : len(e)] = torch.tensor(e)
        dtype = next(self.model.parameters()).dtype
        pixels = torch.stack([self.processor(im) for im in images]).to(self.device, dtype)
        last = torch.tensor([len(e) - 1 for e in encoded], device=self.device)
        ids = ids.to(self.device)
        return ModelInputs({"image": pixels, "text": ids}, last, ids, prompts)

    def forward_logits(self, inputs: ModelInputs) -> torch.Tensor:
        """Decoder logits for every text position, ``(batch, pos, vocab)``.
        Padding sits after the last real token, so causal attention keeps it
        out of every real position."""
        out = self.run_model(inputs.tensors["image"], inputs.tensors["text"], output_labels=False)
        return out["logits"]

    def append_token(self, inputs: ModelInputs, token_id: int) -> ModelInputs:
        text = inputs.tensors["text"]
        if text.shape[1] + 1 >= self.context_length:
            raise QuestionError(f"the text reached the model's context length ({self.context_length - 1} tokens)")
        new = torch.full((text.shape[0], 1), int(token_id), device=text.device, dtype=text.dtype)
        text = torch.cat([text, new], dim=1)
        return ModelInputs({**inputs.tensors, "text": text}, inputs.answer_positions + 1, text, inputs.prompts)

    # ---- decoding with a key / value cache: open_clip keeps none, so the text path
    # runs here block by block (as run_capture's replay does), one new position per
    # step; each self-attention block keeps its keys and values, and the
    # cross-attention keys and values over the image tokens are computed once.
    def max_positions(self) -> int:
        return self.context_length - 1  # the text tower appends its CLS token after the text

    def end_token_ids(self) -> set[int]:
        """Also open_clip's end-of-text token when the tokenizer is open_clip's."""
        eot = getattr(self.tokenizer, "eot_token_id", None)
        return super().end_token_ids() | ({int(eot)} if isinstance(eot, int) else set())

    def cached_prefill(self, inputs: ModelInputs):
        """Context: ``{block: (k, v)}`` ``(batch, n_visual, heads, d_head)`` of
        every cross-attention block; cache: ``{block: (k, v)}`` ``(batch, pos,
        heads, d_head)`` of every self-attention block."""
        _, visual = self.model._encode_image(inputs.tensors["image"])  # (batch, n_visual, d_model), after ln_post
        context = {}
        for block, (_, kind) in enumerate(self.blocks):
            if kind == "cross":
                kv = self.kv_norm(block)(visual).to(visual.dtype)
                context[block] = (self._project(block, kv, 1), self._project(block, kv, 2))
        logits, cache = self._decode_positions(inputs.tensors["text"], 0, {}, context)
        return logits, cache, context

    def cached_step(self, inputs: ModelInputs, cache, context):
        text = inputs.tensors["text"]
        return self._decode_positions(text[:, -1:], text.shape[1] - 1, cache, context)

    def _project(self, block: int, x: torch.Tensor, which: int) -> torch.Tensor:
        """``(batch, pos, heads, d_head)`` queries (0), keys (1) or values (2) of ``x (batch, pos, d_model)``."""
        W, b = self._split_in(block, which)
        return torch.einsum("bpm,hmd->bphd", x, W) + b

    def _decode_positions(self, ids: torch.Tensor, start: int, cache: dict, context: dict):
        """``(logits (batch, vocab) at the last position, cache)`` after running
        the tokens ``ids (batch, n)`` at positions ``start..start + n - 1``
        through every block; each self-attention block attends to its cached
        keys and values and these positions' own (causally), and the cache
        returned holds them all."""
        import math

        tt = self.model.text
        n = ids.shape[1]
        x = tt.token_embedding(ids) + tt.positional_embedding[start : start + n].to(tt.token_embedding.weight.dtype)
        # query i (at start + i) sees keys 0 .. start + i
        future = torch.ones(n, start + n, dtype=torch.bool, device=x.device).triu(start + 1)
        cache = dict(cache)
        for block, (_, kind) in enumerate(self.blocks):
            module = self._block(block)
            q_in = self.attn_norm(block)(x).to(x.dtype)  # the library's LayerNorm rounds to the model's dtype
            q = self._project(block, q_in, 0)
            if kind == "cross":
                k, v = context[block]
                mask = None
            else:
                k, v = self._project(block, q_in, 1), self._project(block, q_in, 2)
                if block in cache:
                    k, v = torch.cat([cache[block][0], k], 1), torch.cat([cache[block][1], v], 1)
                cache[block] = (k, v)
                mask = future
            scores = torch.einsum("bqhd,bkhd->bhqk", accumulating(q), accumulating(k)) / math.sqrt(self.d_head)
            if mask is not None:
                scores = scores.masked_fill(mask, float("-inf"))
            z = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), accumulating(v)).to(x.dtype)
            x = x + torch.einsum("bqhd,hdm->bqm", z, self.W_O(block)) + self.b_O(block)
            mlp = module.mlp(module.ln_2(x))
            gamma = self._layer_scale(module.ls_2)
            x = x + (mlp * gamma if gamma is not None else mlp)
        logits = self.final_norm_layer()(x[:, -1]).to(x.dtype) @ self.W_U + self.b_U
        return logits, cache

    # ---- canonical view: the text path is a list of blocks
    # T0.. the unimodal text tower (causal self-attention); then per decoder
    # layer l a self-attention block "L{l}" and a cross-attention block
    # "L{l}.xattn" whose keys and values are the image tokens.
    @property
    def blocks(self) -> list[tuple[str, str]]:
        out = [(f"T{t}", "self") for t in range(len(self.model.text.transformer.resblocks))]
        for layer in range(self.n_layers):
            out += [(f"L{layer}", "self"), (f"L{layer}.xattn", "cross")]
        return out

    def _block(self, block: int):
        text = list(self.model.text.transformer.resblocks)
        if block < len(text):
            return text[block]
        layer, cross = divmod(block - len(text), 2)
        return self.decoder.cross_attn[layer] if cross else self.decoder.resblocks[layer]

    @staticmethod
    def _layer_scale(module) -> torch.Tensor | None:
        return getattr(module, "gamma", None)

    def _split_in(self, block: int, which: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(W (heads, d_model, d_head), b (heads, d_head)) for q (0), k (1) or v (2)
        from the packed in_proj of nn.MultiheadAttention."""
        attn = self._block(block).attn
        d, n = self.d_model, self.n_heads
        w = attn.in_proj_weight[which * d : (which + 1) * d].view(n, d // n, d).transpose(1, 2)
        b = attn.in_proj_bias[which * d : (which + 1) * d].view(n, d // n)
        return w, b

    def W_Q(self, block: int) -> torch.Tensor:
        return self._split_in(block, 0)[0]

    def b_Q(self, block: int) -> torch.Tensor:
        return self._split_in(block, 0)[1]

    def W_K(self, block: int) -> torch.Tensor:
        return self._split_in(block, 1)[0]

    def b_K(self, block: int) -> torch.Tensor:
        return self._split_in(block, 1)[1]

    def W_V(self, block: int) -> torch.Tensor:
        return self._split_in(block, 2)[0]

    def b_V(self, block: int) -> torch.Tensor:
        return self._split_in(block, 2)[1]

    def W_O(self, block: int) -> torch.Tensor:
        """``(heads, d_head, d_model)``, LayerScale folded in when the block has one."""
        module = self._block(block)
        w = module.attn.out_proj.weight.view(self.d_model, self.n_heads, self.d_head).permute(1, 2, 0)
        gamma = self._layer_scale(module.ls_1)
        return w * gamma if gamma is not None else w

    def b_O(self, block: int) -> torch.Tensor:
        module = self._block(block)
        b = module.attn.out_proj.bias
        gamma = self._layer_scale(module.ls_1)
        return b * gamma if gamma is not None else b

    @staticmethod
    def _norm(ln):

        return Norm("layernorm", ln.weight, ln.bias, ln.eps)

    def attn_norm(self, block: int):
        return self._norm(self._block(block).ln_1)

    def kv_norm(self, block: int):
        module = self._block(block)
        return self._norm(module.ln_1_kv if hasattr(module, "ln_1_kv") else module.ln_1)

    def final_norm_layer(self):
        return self._norm(self.decoder.ln_final)

    @property
    def W_U(self) -> torch.Tensor:
        return self.decoder.text_projection

    @property
    def b_U(self) -> torch.Tensor:
        p = self.decoder.text_projection
        return torch.zeros(p.shape[1], dtype=p.dtype, device=p.device)

    def input_embeddings(self) -> torch.Tensor:
        """``(vocab, d_model)`` token embeddings (the learned absolute positions are added per position)."""
        return self.model.text.token_embedding.weight

    # ---- capture: a replay of the text path from canonical weights, checked
    # against open_clip's own forward on every run (nn.MultiheadAttention
    # computes heads internally, so hooks cannot see z or the weights).
    def run_capture(self, inputs: ModelInputs, trace, keep: set[int]) -> None:
        import math

        text, image = inputs.tensors["text"], inputs.tensors["image"]
        n_pos = text.shape[1]
        edits = list(trace.edits)
        self.check_edits(edits)
        blocks = self.blocks
        for e in edits:
            if e.site == "kv_source" and e.block is not None and blocks[e.block][1] != "cross":
                raise InterventionError(f"{e.describe()}: block {blocks[e.block][0]} is not a cross-attention block")
        _, visual = self.model._encode_image(image)  # (batch, n_visual, d_model), after ln_post
        for e in edits:  # the image tokens every cross block reads
            if e.site == "kv_source" and e.block is None:
                visual = e.apply(visual)
        tt = self.model.text
        x = tt.token_embedding(text) + tt.positional_embedding[:n_pos].to(visual.dtype)
        # The CLS token open_clip appends at the end cannot reach earlier positions.
        causal = torch.full((n_pos, n_pos), float("-inf"), dtype=x.dtype).triu(1)
        # Blocks run in order; the decoder reads the text tower's tokens without its ln_final.
        for block, (_, kind) in enumerate(blocks):
            module = self._block(block)
            for e in edits:
                if e.site == "resid" and e.block == block:
                    x = e.apply(x)
            trace.resid_pre[block] = x
            q_in = self.attn_norm(block)(x).to(x.dtype)  # the library's LayerNorm rounds to the model's dtype
            if kind == "cross":
                source = visual
                for e in edits:
                    if e.site == "kv_source" and e.block == block:
                        source = e.apply(source)
                trace.kv_source[block] = source
                kv = self.kv_norm(block)(source).to(source.dtype)
            else:
                kv = q_in
            q = torch.einsum("bpm,hmd->bphd", q_in, self.W_Q(block)) + self.b_Q(block)
            k = torch.einsum("bpm,hmd->bphd", kv, self.W_K(block)) + self.b_K(block)
            v = torch.einsum("bpm,hmd->bphd", kv, self.W_V(block)) + self.b_V(block)
            trace.q[block], trace.k[block], trace.score_scale[block] = q, k, 1 / math.sqrt(self.d_head)
            # scores, softmax and the weighting of the values in float32 for a half-precision
            # model, as the library's attention kernel computes them (float32, float64: as they are)
            scores = torch.einsum("bqhd,bkhd->bhqk", accumulating(q), accumulating(k)) / math.sqrt(self.d_head)
            if kind == "self":
                scores = scores + causal
            for e in edits:  # knockout: edges removed before the softmax
                if e.site == "knockout" and e.block == block:
                    scores = e.knock(scores)
            pattern = scores.softmax(-1)
            z = torch.einsum("bhqk,bkhd->bqhd", pattern, accumulating(v)).to(x.dtype)
            for e in edits:  # ablation / patching applies to the replay itself
                if e.block == block and e.site == "z":
                    z = e.apply(z.flatten(2), self.d_head).view_as(z)
            out = torch.einsum("bqhd,hdm->bqm", z, self.W_O(block)) + self.b_O(block)
            trace.z[block] = z
            if trace.keep_attn_out:
                trace.attn_out[block] = out
            if wants_pattern(trace, block):
                record_pattern(trace, block, WeightsRows(pattern))
            x = x + out
            mlp = module.mlp(module.ln_2(x))
            gamma = self._layer_scale(module.ls_2)
            mlp = mlp * gamma if gamma is not None else mlp
            for e in edits:
                if e.block == block and e.site == "mlp":
                    mlp = e.apply(mlp)
            trace.mlp_out[block] = mlp
            x = x + mlp
        trace.final_resid = x
        trace.logits = self.final_norm_layer()(x).to(x.dtype) @ self.W_U + self.b_U
        if not trace.edits:  # open_clip's forward knows no edits: the unedited replay is the one checked
            self._check_replay(inputs, trace)

    def _check_replay(self, inputs: ModelInputs, trace) -> None:
        """The replay must equal open_clip's forward at every real position: to
        1e-4 of the logits' size, or, in half precision, to one rounding in the
        model's dtype per block (the replay and the library round each block's
        arithmetic at different places: measured on shapes-coca, 1-2 roundings
        of the logits in bfloat16 and float16 against a bound of 9)."""
        library = self.forward_logits(inputs)
        rtol = max(1e-4, len(self.blocks) * unit_roundoff(library.dtype))
        for row, last in enumerate(inputs.answer_positions.tolist()):
            ours, theirs = trace.logits[row, : last + 1], library[row, : last + 1]
            err = float((ours - theirs).abs().max())
            if err > rtol * max(1.0, float(theirs.abs().max())):
                raise RuntimeError(f"CoCa replay differs from open_clip's forward by {err:.3g}; capture refused")

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """Patch boxes of open_clip's resize-shortest + centre-crop transform; the
        tokens are cross-attention keys, so ``position`` is None."""

        visual = self.model.visual
        size = visual.image_size[0] if isinstance(visual.image_size, tuple) else visual.image_size
        patch = visual.patch_size[0] if isinstance(visual.patch_size, tuple) else visual.patch_size
        boxes = resize_crop_boxes(image_size, size, (size, size), patch)
        return [VisualToken(i, None, 0, r, c, box) for i, (r, c, box) in enumerate(boxes)]

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads
