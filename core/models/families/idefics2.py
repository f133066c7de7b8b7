"""Idefics2 (transformers' ``Idefics2ForConditionalGeneration``): a SigLIP-style
vision tower, a connector (an MLP projection, then a perceiver resampler) and a
Mistral decoder over interleaved tokens with plain 1-D RoPE.

The modules sit where Idefics3's do (``model.model.vision_model``,
``model.model.connector``, ``model.model.text_model``, ``model.lm_head``) and
the markup is Idefics3's without the tile markers: each frame is
``<fake_token_around_image><image>*n<fake_token_around_image>`` (the processor
merges adjacent fakes), one frame per image, or five with
``do_image_splitting`` (four crops, then the whole image).

The perceiver resampler reads every patch of a frame and writes a fixed
number ``n = perceiver_config.resampler_n_latents`` of latent tokens: learned
queries cross-attending to all patches. A latent covers no patch and no region,
so the decoder's visual tokens have no box (as BLIP-2's Q-Former tokens):
attention mass on them, DLA, the lens, ablation and patching at their
positions are read as for any token; a read-out that needs a token's patch
(a heatmap, a region, a box) is refused in one line naming the resampler.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from core.forward.geometry import VisualToken
from core.models.adapter import config_int
from core.models.canonical import NotMapped
from core.models.families.idefics3 import Idefics3Adapter


class NoPatchBox:
    """The box of a resampler latent: it has none, and reading it refuses."""

    def __init__(self, family: str):
        self.message = (
            f"{family}: the visual tokens are the perceiver resampler's latents, which read every patch "
            "and cover none: no box, region or heatmap maps onto the image"
        )

    def _refuse(self, *args):
        raise NotMapped(self.message)

    __iter__ = __getitem__ = __len__ = _refuse

    def __repr__(self) -> str:
        return "NoPatchBox()"


@dataclass
class LatentToken(VisualToken):
    """A :class:`core.forward.geometry.VisualToken` that is a resampler latent: ``image``
    its frame, ``row = col = -1`` (no patch, as the codebase marks tokens without
    one), ``box`` a :class:`NoPatchBox`; ``latent`` its index among the frame's latents."""

    latent: int = 0

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in ("index", "position", "image", "row", "col")}, "box": None}


class Idefics2Adapter(Idefics3Adapter):
    """Idefics3's modules, markup handling and delimiters (the ``<fake_token_around_image>``
    markers); what is Idefics2's own: no pixel shuffle, the resampler's latents as
    visual tokens (no geometry). Mistral's sliding window is the base's (the causal rule)."""

    declaration = replace(
        Idefics3Adapter.declaration,
        name="idefics2",
        architectures=("Idefics2ForConditionalGeneration",),
        # What Idefics2's own chat template renders (its tokenizer adds the BOS).
        prompt="User:<image>{question}<end_of_utterance>\nAssistant:",
    )

    @classmethod
    def check_config(cls, config) -> None:
        super(Idefics3Adapter, cls).check_config(config)  # LLaVA's: no pixel shuffle here
        config_int(config, "perceiver_config.resampler_n_latents", minimum=1, required=True)

    # ---- geometry: latents, no patches
    def frames(self) -> int:
        """Frames per image: 5 with ``do_image_splitting`` (four crops, the whole image), else 1."""
        return 5 if getattr(self.processor.image_processor, "do_image_splitting", False) else 1

    def latents(self) -> int:
        """Latent tokens per frame (the processor's ``image_seq_len``, the model's ``resampler_n_latents``)."""
        n = int(self.model.config.perceiver_config.resampler_n_latents)
        seq = int(getattr(self.processor, "image_seq_len", n))
        if seq != n:
            raise ValueError(f"processor ({seq} image tokens a frame) and model ({n} resampler latents) disagree")
        return n

    def tiling(self, image_size: tuple[int, int]):
        raise NotMapped(NoPatchBox(self.family).message)

    frame_grid = tiling

    def visual_tokens(self, image_size: tuple[int, int], positions: list[int] | None = None) -> list:
        """One :class:`LatentToken` per image token, in sequence order: frame
        ``f`` (crops 0..3 then the whole image with splitting, else 0), latent
        ``k`` of it; no patch, no box (``image_size`` changes nothing)."""
        frames, n = self.frames(), self.latents()
        if positions is not None and len(positions) != frames * n:
            raise ValueError(f"{len(positions)} visual positions for {frames} frames of {n} latents")
        box = NoPatchBox(self.family)
        return [
            LatentToken(i, None if positions is None else int(positions[i]), i // n, -1, -1, box, i % n)
            for i in range(frames * n)
        ]
