"""A model family as a declaration: where its decoder's parts live, how a
block computes, how positions turn queries and keys, which keys a query may
read and which tokens frame the image.

:class:`core.models.family_adapter.FamilyAdapter` derives the canonical
weights, norms, capture hooks, edit sites, RoPE and masks from one
:class:`Family`; a family's file holds its declaration, its geometry (how its
processor cuts an image into visual tokens) and overrides only where its
computation truly differs. Plain data: nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# How a decoder block adds its sublayers to the residual stream (docs/METHODS.md §4.12.1).
BLOCK_FORMS = {
    "sequential": "pre-norm: x += attn(norm1(x)); x += mlp(norm2(x))",
    "parallel": "one norm read by both: x += attn(n) + mlp(n), n = norm(x) (Cohere)",
    "sandwich": "each write normed again: x += post1(attn(norm1(x))); x += post2(mlp(norm2(x))) (Gemma 2/3, GLM-4)",
    "post_norm": "x = norm(x + sublayer(x)) (BERT: BLIP's text decoder)",
}

# How a norm computes, exactly as the model does (core.models.norms).
NORM_FORMS = {
    "llama": "RMSNorm, statistics in float32, cast back, gain after",
    "gemma": "RMSNorm with a (1 + w) gain, all in float32, cast back",
    "cohere": "LayerNorm without bias, all in float32, cast back",
    "layernorm": "LayerNorm (weight and bias)",
}

# frozen_convention of a sandwich-norm family (stated in every audit row of its DLA).
SANDWICH_CONVENTION = "final norm scale frozen at x_L; a head's write under its block's post-attention norm scale"

POSITION_SCHEMES = ("rope", "mrope", "none", "absolute")

# Which keys a query may read besides the causal ones (always: padding keys never,
# and a sliding-window layer's window).
MASK_RULES = {
    "causal": "keys at or before the query",
    "prefix": "causal, or query and key both in the prefix (token type 0: PaliGemma)",
    "image_block": "causal, or query and key in the same image's run of typed tokens (Gemma 3)",
    "image_tokens": "causal, or query and key both image tokens (token type 1: Molmo 2)",
    "cross": "text queries read every visual key (cross-attention blocks)",
}


# Block kinds beside "self" and "cross": layers whose token mixer has no attention
# pattern (docs/METHODS.md §4.15.1). Their mixer's write is one residual component.
MIXER_KINDS = {
    "linear": "linear attention: a recurrent state, no softmax pattern over keys",
    "conv": "a short causal convolution: fixed taps over the last few positions, no pattern",
}


@dataclass(frozen=True)
class Mixer:
    """The token mixer of the decoder layers of one type (``text_config.layer_types``)
    that have no attention: its attribute at the layer and what it is. Its output
    is the layer's first write (the block form's "attn" slot)."""

    layer_type: str  # the layer_types value, e.g. "linear_attention", "conv"
    module: str  # the attribute at the layer, e.g. "linear_attn", "conv"
    kind: str  # MIXER_KINDS
    what: str  # named in every refusal, e.g. "Gated DeltaNet linear attention"

    def __post_init__(self):
        if self.kind not in MIXER_KINDS:
            raise ValueError(f"mixer kind {self.kind!r}: expected one of {', '.join(MIXER_KINDS)}")


@dataclass(frozen=True)
class Decoder:
    """Where a decoder's parts live, as attribute paths, and its block form.

    ``path`` and ``unembed`` start at the loaded model (``path`` None: the
    family maps its modules in its own code, BLIP and CoCa); ``attention``,
    ``attn_norm``, ``mlp`` and ``sandwich`` at one decoder layer (``path.layers[i]``);
    ``q`` ... ``o`` and ``qk_norms`` at the attention module; ``final_norm`` and
    ``rotary`` at the decoder."""

    path: str | None = "model.language_model"
    unembed: str = "lm_head"
    attention: str = "self_attn"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    attn_norm: str = "input_layernorm"
    mlp: str = "mlp"
    final_norm: str = "norm"
    rotary: str = "rotary_emb"
    # Per-head RMSNorms over d_head on queries and keys, before the rotation (Qwen3, Gemma 3).
    qk_norms: tuple[str, str] | None = None
    form: str = "sequential"  # BLOCK_FORMS
    # form "sandwich": the norms after the attention and after the MLP, per layer.
    sandwich: tuple[str, str] | None = None
    norm: str = "llama"  # NORM_FORMS
    # A text-config field the logits are multiplied by (Cohere's logit_scale): in W_U.
    logit_scale: str | None = None
    # A text-config field c the logits are soft-capped at, c tanh(logits / c) (Gemma 3n): cap_logits.
    logit_softcap: str | None = None
    # The embedding module multiplies by its embed_scale (Gemma: sqrt(d_model)).
    scaled_embeddings: bool = False
    # Layers whose token mixer is not attention, by layer type (hybrid decoders: Qwen3.5, LFM2).
    mixers: tuple[Mixer, ...] = ()

    def __post_init__(self):
        if self.form not in BLOCK_FORMS:
            raise ValueError(f"block form {self.form!r}: expected one of {', '.join(BLOCK_FORMS)}")
        if self.norm not in NORM_FORMS:
            raise ValueError(f"norm form {self.norm!r}: expected one of {', '.join(NORM_FORMS)}")
        if (self.form == "sandwich") != (self.sandwich is not None):
            raise ValueError("a sandwich block names its two post-norms, and only a sandwich block does")


@dataclass(frozen=True)
class Rotary:
    """How positions turn queries and keys.

    ``rotate_half``: the model's own pair convention, as an importable name
    (Llama's halves; Cohere's and GLM's interleaved pairs). ``per_layer``:
    ``"layer_type"``, the decoder's rotary module takes the layer's type
    (Gemma 3's two bases); ``"sliding_only"``, layers without a sliding window
    are not rotated (Cohere 2's NoPE layers). ``partial``: only the first
    ``cos.shape[-1]`` dims turn (GLM). ``float32``: the rotation is computed in
    float32 (Cohere). ``first``: the position id of the first token when the
    capture recorded none (PaliGemma counts from 1)."""

    scheme: str = "rope"  # POSITION_SCHEMES
    rotate_half: str = "transformers.models.llama.modeling_llama.rotate_half"
    per_layer: str | None = None
    partial: bool = False
    float32: bool = False
    first: int = 0

    def __post_init__(self):
        if self.scheme not in POSITION_SCHEMES:
            raise ValueError(f"position scheme {self.scheme!r}: expected one of {', '.join(POSITION_SCHEMES)}")
        if self.per_layer not in (None, "layer_type", "sliding_only"):
            raise ValueError(f"per-layer rotation {self.per_layer!r}: expected layer_type or sliding_only")


@dataclass(frozen=True)
class Mask:
    """Which keys a query may read. ``types``: the input tensor marking the
    image / prefix tokens the rule reads; ``recorded``: the capture keeps the
    4-D mask each layer ran with (and its position ids), and
    :meth:`~core.models.family_adapter.FamilyAdapter.allowed_keys` returns that mask."""

    rule: str = "causal"  # MASK_RULES
    types: str | None = None
    recorded: bool = False

    def __post_init__(self):
        if self.rule not in MASK_RULES:
            raise ValueError(f"mask rule {self.rule!r}: expected one of {', '.join(MASK_RULES)}")
        if self.rule in ("prefix", "image_block", "image_tokens") and self.types is None:
            raise ValueError(f"mask rule {self.rule!r} reads a token-type tensor: name it")


@dataclass(frozen=True)
class Family:
    """One family's declaration (see the module docstring).

    ``delimiters``: the tokens that frame or separate visual tokens but carry
    no patch, each ``"config.<field>"`` (an id), ``"processor.<attr>"`` (a token
    string or an id) or a literal token string. ``projector``: where the
    projector lives, from the loaded model; ``visual_sites``: its input
    (``vision_out``) and output (``projector_out``) are edit sites (the
    projector runs once per prompt, one row per visual token); else
    ``no_visual_sites`` is the one-line reason they are refused."""

    name: str
    architectures: tuple[str, ...] = ()  # config.architectures[0] names this family serves
    open_clip_classes: tuple[str, ...] = ()  # open_clip model classes it serves
    prompt: str = "{question}"  # the fallback prompt when the processor has no chat template
    decoder: Decoder = field(default_factory=Decoder)
    rotary: Rotary = field(default_factory=Rotary)
    mask: Mask = field(default_factory=Mask)
    attention: str = "self"  # "self" (visual tokens in the text sequence) or "cross"
    delimiters: tuple[str, ...] = ()
    # The edit sites core.forward.edits reaches (the visual ones follow from visual_sites).
    edit_sites: tuple[str, ...] = ("z", "mlp", "resid", "knockout")
    projector: str = "model.multi_modal_projector"
    visual_sites: bool = False
    no_visual_sites: str = ""
    # What "frozen" means in the frozen-scale DLA of this graph (None: derived from the block form).
    frozen_convention: str | None = None

    @property
    def final_norm(self) -> str:
        """``"rmsnorm"`` or ``"layernorm"``: the final norm's kind."""
        return "layernorm" if self.decoder.norm in ("cohere", "layernorm") else "rmsnorm"
