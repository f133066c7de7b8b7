"""PaliGemma (transformers' ``PaliGemmaForConditionalGeneration``): a SigLIP
vision tower, a linear projector, and a Gemma decoder over
``[image tokens] <bos> prompt \\n``, run as a prefix LM.

What differs from the Llama-style families:

* **Scaled embeddings.** Gemma multiplies its token embeddings by
  ``sqrt(d_model)`` inside the embedding module; the image features are
  scattered in *unscaled* (the projector output as is). So the residual
  entering block 0 (``trace.resid_pre[0]``, the decomposition's ``embed``
  component) holds ``sqrt(d_model) * E[token]`` at text positions and the
  projector output at image positions; :meth:`~core.models.family_adapter.FamilyAdapter.input_embeddings`
  includes the scale (declared: ``scaled_embeddings``). The unembedding is tied to the *unscaled* table.
* **RMSNorm in the (1 + w) form, computed in float32.** Gemma normalises and
  multiplies by ``1 + w`` in float32 and casts back; :class:`core.models.norms.GemmaNorm`
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
  :meth:`~core.models.family_adapter.FamilyAdapter.allowed_keys` returns the mask the decoder was
  actually called with (recorded by the capture), not a causal guess.
* **1-indexed positions.** PaliGemma passes ``position_ids = arange(pos) + 1``
  to the decoder; the capture records them (``rope_positions`` returns those).
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

from core.errors import QuestionError, UnsupportedArchitectureError
from core.forward.geometry import stretched_grid_tokens
from core.models.adapter import config_int, size_value
from core.models.declaration import Decoder, Family, Mask, Rotary
from core.models.family_adapter import FamilyAdapter

IMAGE_TOKEN = "<image>"


class PaliGemmaAdapter(FamilyAdapter):
    """The canonical view of a PaliGemma (Gemma 1 decoder) model; see the
    module docstring for the prefix-LM mask, the scaled embeddings and what is
    refused."""

    # PaliGemma checkpoints ship no chat template: the processor takes
    # "<image>" + the prompt and itself inserts <bos> after the image tokens
    # and appends "\n". Task prefixes ("answer en ", "caption en") are part of
    # the question the user types.
    declaration = Family(
        name="paligemma",
        architectures=("PaliGemmaForConditionalGeneration",),
        prompt=IMAGE_TOKEN + "{question}",
        decoder=Decoder(norm="gemma", scaled_embeddings=True),
        rotary=Rotary(first=1),
        mask=Mask("prefix", types="token_type_ids", recorded=True),
        edit_sites=("z", "mlp", "knockout"),
    )

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
        """The :class:`core.forward.geometry.VisualToken` of every image token, boxes in
        the original image (``image_size = (width, height)``).

        SigLIP's processor resizes the whole image to ``S x S`` (aspect not
        kept, no crop, no pad) and the tower cuts ``patch`` px squares, one
        token each, in row-major order (no CLS token, no pooling head in
        PaliGemma). Undoing the stretch scales x by ``W / S`` and y by ``H / S``.
        """
        side = self.resized_size()
        patch = int(self.model.config.vision_config.patch_size)
        return stretched_grid_tokens(image_size, (side, side), (side // patch, side // patch), patch, positions)
