"""PaliGemma (transformers' ``PaliGemmaForConditionalGeneration``): a SigLIP
vision tower, a linear projector, and a Gemma decoder over
``[image tokens] <bos> prompt \\n``, run as a prefix LM.

What differs from the Llama-style families:

* **Scaled embeddings.** Gemma multiplies its token embeddings by
  ``sqrt(d_model)`` inside the embedding module; the image features are
  scattered in *unscaled* (the projector output as is). So the residual
  entering block 0 (``trace.resid_pre[0]``, the decomposition's ``embed``
  component) holds ``sqrt(d_model) * E[token]`` at text positions and the
  projector output at image positions; :meth:`PaliGemmaAdapter.input_embeddings`
  includes the scale. The unembedding is tied to the *unscaled* table.
* **RMSNorm in the (1 + w) form, computed in float32.** Gemma normalises and
  multiplies by ``1 + w`` in float32 and casts back; :class:`GemmaNorm`
  (a :class:`core.models.norms.Norm` with ``weight_offset=1``) does the same
  operations in the same order, so the lens on ``x_L`` is the model's logits
  bit for bit even in a float64 model.
* **Prefix-LM mask.** The processor marks the image tokens, ``<bos>`` and the
  prompt (with its closing ``\\n``) as prefix (``token_type_ids == 0``) and a
  suffix (training targets, generated tokens) as 1. transformers builds the
  mask with ``create_causal_mask(..., block_sequence_ids=where(tt == 0, 0, -1))``:
  causal OR (query and key both in the prefix), AND key not padding. The
  prefix attends bidirectionally, so the answer position (the last prompt
  token) reads every real token and early prefix tokens read later ones.
  :meth:`PaliGemmaAdapter.allowed_keys` returns the mask the decoder was
  actually called with (recorded by the capture), not a causal guess.
* **1-indexed positions.** PaliGemma passes ``position_ids = arange(pos) + 1``
  to the decoder; :meth:`PaliGemmaAdapter.rope_positions` returns those.
* **Geometry.** SigLIP's processor resizes to a fixed square (no crop, no
  pad): a non-square image is stretched, so each patch box is
  ``patch * W / S`` wide and ``patch * H / S`` tall in the original image.

Not supported (refused when the adapter is built, with the reason):
PaliGemma 2 (a Gemma 2 decoder): its post-attention / post-feed-forward
"sandwich" RMSNorms put a per-position scale between ``W_O z`` and the
residual (heads no longer sum linearly to what the block writes), it
soft-caps attention scores and the final logits, scales scores by
``query_pre_attn_scalar`` and alternates sliding-window layers. A Gemma 1
config that sets ``final_logit_softcapping`` is refused too: the model's
logits are then ``c * tanh(W_U Norm(x_L) / c)``, which the linear logit lens
and the additive DLA cannot reproduce.
"""

from __future__ import annotations

import torch

from core.capture import run_with_hooks
from core.errors import QuestionError, UnsupportedArchitectureError
from core.geometry import VisualToken
from core.models.adapter import Adapter, ModelInputs, config_int, size_value
from core.models.families._decoder import LlamaStyleWeights
from core.models.norms import Norm

IMAGE_TOKEN = "<image>"


class GemmaNorm(Norm):
    """Gemma's RMSNorm exactly as the model computes it: statistics,
    normalisation *and* the ``(1 + w)`` gain in ``compute_dtype`` (float32),
    then cast back (``GemmaRMSNorm`` multiplies by the gain before the cast,
    Llama after it). ``frozen``/``jvp``/``vjp`` are the base class's (in the
    input's dtype)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., d_model) -> (..., d_model)``."""
        dt = self.compute_dtype or x.dtype
        xf = x.to(dt)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = y * (self.weight_offset + self.weight.to(dt))
        return y.to(x.dtype)


def prefix_lm_allowed(
    attention_mask: torch.Tensor | None, token_type_ids: torch.Tensor | None, n_pos: int
) -> torch.Tensor:
    """``(batch, pos, keys)`` bool: PaliGemma's prefix-LM mask, as transformers
    builds it: causal OR (query and key both prefix, ``token_type_ids == 0``),
    AND the key is not padding. Without ``token_type_ids`` the model runs
    plain causal attention (that is what PaliGemmaModel does then).

    Args:
        attention_mask: ``(batch, pos)`` 1 real, 0 padding (None: no padding).
        token_type_ids: ``(batch, pos)`` 0 prefix, 1 suffix (None: all causal).
        n_pos: sequence length.
    """
    batch = 1
    for t in (attention_mask, token_type_ids):
        if t is not None:
            batch = t.shape[0]
    allowed = torch.ones(n_pos, n_pos, dtype=torch.bool).tril().expand(batch, -1, -1)
    if token_type_ids is not None:
        prefix = token_type_ids.cpu() == 0  # (batch, pos)
        allowed = allowed | (prefix[:, :, None] & prefix[:, None, :])
    if attention_mask is not None:
        allowed = allowed & attention_mask.cpu().bool()[:, None, :]
    return allowed


class PaliGemmaAdapter(LlamaStyleWeights, Adapter):
    """The canonical view of a PaliGemma (Gemma 1 decoder) model; see the
    module docstring for the prefix-LM mask, the scaled embeddings and what is
    refused."""

    hf_architectures = ("PaliGemmaForConditionalGeneration",)

    family = "paligemma"
    final_norm = "rmsnorm"
    attention_kind = "self"
    position_scheme = "rope"

    # PaliGemma checkpoints ship no chat template: the processor takes
    # "<image>" + the prompt and itself inserts <bos> after the image tokens
    # and appends "\n". Task prefixes ("answer en ", "caption en") are part of
    # the question the user types.
    fallback_prompt = IMAGE_TOKEN + "{question}"

    @classmethod
    def check_config(cls, config) -> None:
        """Refuse what the read-outs cannot reproduce (called before the weights
        load and when the adapter is built)."""
        super().check_config(config)
        for field in ("vision_config.image_size", "vision_config.patch_size"):
            config_int(config, field, minimum=1, required=True)
        text = config.get_text_config()
        kind = getattr(text, "model_type", None)
        if kind != "gemma":
            raise UnsupportedArchitectureError(
                f"PaliGemma with a {kind!r} decoder is not supported (only Gemma 1, i.e. PaliGemma 1): "
                "PaliGemma 2's Gemma 2 decoder normalises each attention and MLP output again before the "
                "residual (a per-position scale between the heads and the stream, so heads no longer sum to "
                "what the block writes), soft-caps attention scores and final logits, scales scores by "
                "query_pre_attn_scalar and alternates sliding-window layers"
            )
        cap = getattr(text, "final_logit_softcapping", None)
        if cap is not None:
            raise UnsupportedArchitectureError(
                f"this PaliGemma soft-caps its logits ({cap} * tanh(logits / {cap})): the logit lens and the "
                "additive logit attribution read W_U Norm(x), which is not the model's logit then"
            )

    # ---- sizes
    @property
    def d_head(self) -> int:
        return int(self._attn(0).head_dim)

    @property
    def n_image_tokens(self) -> int:
        """Visual tokens per image (fixed: ``(image_size / patch_size) ** 2``)."""
        vision = self.model.config.vision_config
        return (vision.image_size // vision.patch_size) ** 2

    # ---- text
    def check_fits(self, question: str, ids: list[int]) -> None:
        # image tokens + <bos> + question + "\n"; positions run 1..total
        total = self.n_image_tokens + 1 + len(ids) + 1
        if total > self.max_positions():
            raise QuestionError(
                f"the question is too long: {total} tokens with the image, the model takes {self.max_positions()}"
            )

    # ---- running: prepare (the base's) gives ``input_ids``, ``attention_mask``,
    # ``token_type_ids`` (0 prefix, 1 suffix: every prompt token is prefix) ``(batch,
    # pos)`` and ``pixel_values`` ``(batch, 3, S, S)`` in the model's dtype. The
    # processor's ``labels`` (all -100 without a suffix) are dropped: they would make
    # the forward compute a loss. append_token appends a *suffix* token
    # (``token_type_ids`` 1: causal, as in generation), so the prefix's logits are
    # unchanged. visual_positions (the base's): the first ``n_image_tokens`` positions.
    dropped_tensors = ("labels",)
    appended_token_types = {"token_type_ids": 1}

    # ---- canonical weights (LlamaStyleWeights) with Gemma's norms and embeddings
    def _norm(self, module):  # GemmaRMSNorm keeps eps as .eps and scales by (1 + w) in float32
        return GemmaNorm("rmsnorm", module.weight, None, module.eps, weight_offset=1.0, compute_dtype=torch.float32)

    def input_embeddings(self) -> torch.Tensor:
        """``(vocab, d_model)`` token embeddings as block 0 receives them:
        ``E * sqrt(d_model)`` (the scale in the embedding's dtype, as Gemma applies it)."""
        emb = self.language_model.embed_tokens
        return emb.weight * emb.embed_scale.to(emb.weight.dtype)

    # ---- capture
    def run_capture(self, inputs: ModelInputs, trace, keep: set[int]) -> None:
        """The default hooked forward; also keeps ``trace.token_type_ids``
        ``(batch, pos)`` (prefix 0 / suffix 1) for :meth:`allowed_keys`."""

        trace.token_type_ids = inputs.tensors.get("token_type_ids")
        run_with_hooks(self, inputs, trace, keep)

    def capture_hooks(self, layer: int, trace, keep_pattern: bool) -> list:
        """The Llama-style hooks plus one that records what block ``layer``'s
        attention was called with: ``trace.decoder_masks[layer]``, the model's
        own 4-D mask ``(batch, 1, pos, keys)`` (a reference, no copy: every
        layer gets the same tensor; additive, 0 where allowed, or bool) and, at
        block 0, ``trace.position_ids`` ``(batch, pos)`` (1-indexed)."""
        regs = super().capture_hooks(layer, trace, keep_pattern)

        def inputs(module, args, kwargs):
            mask = kwargs.get("attention_mask")
            if isinstance(mask, dict):  # hybrid configs pass one mask per layer type
                mask = mask.get("full_attention")
            if isinstance(mask, torch.Tensor) and mask.ndim == 4:
                if not hasattr(trace, "decoder_masks"):
                    trace.decoder_masks = {}
                trace.decoder_masks[layer] = mask
            if layer == 0 and kwargs.get("position_ids") is not None:
                hidden = args[0] if args else kwargs["hidden_states"]
                trace.position_ids = kwargs["position_ids"].expand(hidden.shape[0], -1)

        regs.append((self.language_model.layers[layer], "pre_kw", inputs))
        return regs

    def rope_positions(self, trace, batch: int = 0) -> torch.Tensor:
        """``(pos,)`` the RoPE positions of one batch row: the recorded
        ``position_ids``, else ``arange(pos) + 1`` (PaliGemma is 1-indexed)."""
        p = getattr(trace, "position_ids", None)
        if p is not None:
            return p[batch] if p.ndim == 2 else p
        return torch.arange(trace.input_ids.shape[1]) + 1

    def allowed_keys(self, trace, block: int, batch: int = 0) -> torch.Tensor:
        """``(pos, keys)`` bool: the prefix-LM mask block ``block`` ran with
        (recorded by the capture); for a trace without it, rebuilt from
        ``trace.token_type_ids`` and the padding mask by :func:`prefix_lm_allowed`."""
        recorded = getattr(trace, "decoder_masks", {}).get(block)
        if recorded is not None:
            m = recorded[batch, 0]
            return (m if m.dtype == torch.bool else m == 0).cpu()
        n = trace.input_ids.shape[1]
        mask = trace.attention_mask[batch : batch + 1] if trace.attention_mask is not None else None
        tt = getattr(trace, "token_type_ids", None)
        return prefix_lm_allowed(mask, tt[batch : batch + 1] if tt is not None else None, n)[0]

    def token_roles(self, trace, batch: int = 0) -> list[str]:
        """As the base class, but the image comes first: position 0 is a
        visual token, and the ``<bos>`` after the image is the "sink"."""
        roles = super().token_roles(trace, batch)
        ids = trace.input_ids[batch].tolist()
        visual = set(trace.visual_positions[batch].tolist())
        if 0 in visual:
            roles[0] = "visual"
        bos = self.tokenizer.bos_token_id
        for i, t in enumerate(ids):
            if t == bos and roles[i] != "padding":
                roles[i] = "sink"
                break
        return roles

    # ---- geometry
    def resized_size(self) -> int:
        """``S``: the square side the processor resizes every image to (checked
        against the vision tower's ``image_size``)."""
        ip = self.processor.image_processor
        if not getattr(ip, "do_resize", True):
            raise NotImplementedError("PaliGemma geometry is mapped for resizing processors")
        h, w = size_value(ip.size, "height"), size_value(ip.size, "width")
        side = self.model.config.vision_config.image_size
        if h is None or w is None or h != w or h != side:
            raise ValueError(f"processor size {ip.size} does not match the vision tower's {side}x{side} input")
        if getattr(ip, "do_center_crop", False) or getattr(ip, "do_pad", False):
            raise NotImplementedError("PaliGemma geometry is mapped for a plain resize (no crop, no pad)")
        return int(side)

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """The :class:`core.geometry.VisualToken` of every image token, boxes in
        the original image (``image_size = (width, height)``).

        SigLIP's processor resizes the whole image to ``S x S`` (aspect not
        kept, no crop, no pad) and the tower cuts ``patch`` px squares, one
        token each, in row-major order (no CLS token, no pooling head in
        PaliGemma). Undoing the stretch scales x by ``W / S`` and y by ``H / S``.
        """

        side = self.resized_size()
        patch = int(self.model.config.vision_config.patch_size)
        grid = side // patch
        w, h = image_size
        sx, sy = w / side, h / side
        if positions is not None and len(positions) != grid * grid:
            raise ValueError(f"{len(positions)} visual positions for a {grid}x{grid} token grid")
        out = []
        for i in range(grid * grid):
            r, c = divmod(i, grid)
            box = [c * patch * sx, r * patch * sy, (c + 1) * patch * sx, (r + 1) * patch * sy]
            out.append(VisualToken(i, None if positions is None else int(positions[i]), 0, r, c, box))
        return out
