"""Families as declarations (core/models/declaration.py, core/models/family_adapter.py):
every served family declares itself, a declaration that cannot be read is refused
when the family is defined, and what the generic adapter derives from a declaration
matches the model (the per-family files and the conformance suite check the numbers)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from core.errors import InterventionError
from core.models import registry
from core.models.declaration import BLOCK_FORMS, MASK_RULES, NORM_FORMS, Decoder, Family, Mask, Rotary
from core.models.family_adapter import FamilyAdapter, allowed_by_rule

FAMILIES = Path(__file__).resolve().parents[2] / "core" / "models" / "families"

# The ten families issue 26 added (docs/ARCHITECTURE.md: "Where a change goes").
NEW_FAMILIES = (
    "gemma3",
    "qwen3_vl",
    "llava_onevision",
    "internvl",
    "mistral3",
    "idefics2",
    "aya_vision",
    "glm4v",
    "janus",
    "molmo2",
)


def served() -> list[type]:
    registry._load_families()
    return sorted({*registry._HF.values(), *registry._OPEN_CLIP.values()}, key=lambda c: c.family)


def test_every_served_family_is_a_declaration():
    """Each adapter the registry serves has a declaration of its own, and the names the
    rest of the engine reads (family, architectures, norm, positions, sites) come from it."""
    classes = served()
    assert len(classes) == 26
    for cls in classes:
        d = vars(cls).get("declaration")
        assert isinstance(d, Family), cls.__name__
        assert (cls.family, cls.hf_architectures, cls.open_clip_classes) == (
            d.name,
            d.architectures,
            d.open_clip_classes,
        )
        assert (cls.attention_kind, cls.position_scheme, cls.final_norm) == (d.attention, d.rotary.scheme, d.final_norm)
        assert cls.edit_sites[: len(d.edit_sites)] == d.edit_sites
        assert ("projector_out" in cls.edit_sites) == d.visual_sites
    for name, cls in registry._HF.items():
        assert name in cls.declaration.architectures
    # BLIP and CoCa map their decoders in their own code; every other family through the generic adapter.
    generic = {cls.family for cls in classes if issubclass(cls, FamilyAdapter)}
    assert {cls.family for cls in classes} - generic == {"blip", "coca"}


def test_a_declaration_that_cannot_be_read_is_refused():
    with pytest.raises(ValueError, match="block form 'pre'"):
        Decoder(form="pre")
    with pytest.raises(ValueError, match="norm form"):
        Decoder(norm="batchnorm")
    with pytest.raises(ValueError, match="sandwich block names its two post-norms"):
        Decoder(form="sandwich")
    with pytest.raises(ValueError, match="sandwich block names its two post-norms"):
        Decoder(sandwich=("a", "b"))
    with pytest.raises(ValueError, match="position scheme 'alibi'"):
        Rotary("alibi")
    with pytest.raises(ValueError, match="per-layer rotation"):
        Rotary(per_layer="every_other")
    with pytest.raises(ValueError, match="mask rule 'window'"):
        Mask("window")
    with pytest.raises(ValueError, match="reads a token-type tensor"):
        Mask("image_block")
    assert set(BLOCK_FORMS) >= {"sequential", "parallel", "sandwich", "post_norm"}
    assert {"llama", "gemma", "cohere"} <= set(NORM_FORMS)


def test_declared_forms_cover_the_issue_list():
    """The block forms, position schemes and mask rules the served families declare."""
    decls = [cls.declaration for cls in served()]
    assert {d.decoder.form for d in decls} == {"sequential", "parallel", "sandwich", "post_norm"}
    assert {d.rotary.scheme for d in decls} == {"rope", "mrope", "absolute"}
    assert {d.mask.rule for d in decls} == set(MASK_RULES) - {"cross"}
    per_layer = {d.name: d.rotary.per_layer for d in decls if d.rotary.per_layer}
    assert per_layer == {"gemma3": "layer_type", "gemma3n": "layer_type", "aya_vision": "sliding_only"}
    # the hybrid decoders name their layers without attention (issue 30)
    mixers = {d.name: sorted(m.kind for m in d.decoder.mixers) for d in decls if d.decoder.mixers}
    assert mixers == {"lfm2_vl": ["conv"], "qwen3_5": ["linear"], "qwen3_5_moe": ["linear"]}


def _lines(family: str) -> int:
    return len((FAMILIES / f"{family}.py").read_text().splitlines())


def test_new_families_are_short_declarations():
    """Issue 26: the median new family's file (declaration, geometry, docstring) is
    under 150 lines, and the simplest served one (LLaVA) under 100."""
    lengths = {f: _lines(f) for f in NEW_FAMILIES}
    assert statistics.median(lengths.values()) < 150, lengths
    assert _lines("llava") < 100


@pytest.mark.parametrize("rule", ["prefix", "image_tokens", "image_block"])
def test_mask_rules_read_the_token_types(rule):
    """Hand-built cases: tokens 1-3 typed as image (prefix: tokens 0-3 typed 0), token 5 padding."""
    n = 7
    if rule == "prefix":
        types = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    else:
        types = torch.tensor([[0, 1, 1, 1, 0, 0, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 1]])
    allowed = allowed_by_rule(rule, mask, types, n)[0]
    causal = torch.ones(n, n, dtype=torch.bool).tril() & mask.bool()
    assert torch.equal(allowed[:, 5], torch.zeros(n, dtype=torch.bool))  # padding is never read
    extra = (allowed & ~causal).nonzero().tolist()
    if rule == "prefix":  # the prefix 0..3 reads itself both ways
        assert extra == [[i, j] for i in range(4) for j in range(4) if j > i]
    elif rule == "image_tokens":  # every typed token (1, 2, 3 and 6) reads every other
        assert extra == [[i, j] for i in (1, 2, 3) for j in (1, 2, 3, 6) if j > i]
    else:  # one image's run (1..3); the lone typed token 6 is another image
        assert extra == [[1, 2], [1, 3], [2, 3]]
    assert torch.equal(allowed_by_rule(rule, mask, None, n)[0], causal)  # no types: causal
    q, k = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)  # a window holds for every pair
    assert torch.equal(allowed_by_rule(rule, mask, types, n, sliding_window=2)[0], allowed & (k > q - 2))


def test_llava_vision_features_follow_the_feature_layer():
    """vision_features is what the projector reads under the config's
    vision_feature_layer and select strategy (LLaVA 1.5 reads layer -2, CLS dropped)."""
    from transformers import LlavaForConditionalGeneration

    from core.models.families.llava import LlavaAdapter
    from core.zoo import build

    for layer, strategy in ((-2, "default"), ([-3, -1], "full")):
        config = build.llava_config()
        config.vision_feature_layer, config.vision_feature_select_strategy = layer, strategy
        grid = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
        config.image_seq_length = grid + (strategy == "full")  # "full" keeps CLS: one more image token
        torch.manual_seed(0)
        model = LlavaForConditionalGeneration(config).eval()
        processor = build.llava_processor()
        a = LlavaAdapter(model, processor, processor.tokenizer)
        pixels = torch.randn(2, 3, config.vision_config.image_size, config.vision_config.image_size)
        with torch.no_grad():
            want = torch.cat(list(model.model.get_image_features(pixels, return_dict=True).pooler_output))
            got = a.project_visual(a.vision_features(pixels))
        torch.testing.assert_close(got.reshape(want.shape), want, atol=0, rtol=0)
        assert got.shape[1] == config.image_seq_length


def test_llava_next_refuses_projector_sites_in_one_line():
    """LLaVA-NeXT's projector runs per tile before unpadding: its sites index no visual token."""
    from core.models.families.llava_next import LlavaNextAdapter

    assert "projector_out" not in LlavaNextAdapter.edit_sites
    a = object.__new__(LlavaNextAdapter)
    with pytest.raises(InterventionError, match="llava_next: no 'vision_out' site: the projector runs per tile"):
        a.visual_site_module("vision_out")


def test_query_extras_and_the_rotation_each_block_applies():
    """Level (c) of nonunique inverts q = rotate(W_Q Norm(x) + b_Q): a family with q/k
    norms says so; Aya's full-attention layers are NoPE, so the rotation matrix there is
    the identity and on its sliding layers it is not (the block reaches rotate)."""
    from core.methods.nonunique.query_map import rotation_matrix
    from tests.core import test_aya_vision, test_gemma3

    m = test_gemma3.traced_case("gemma3")[0]
    assert m.adapter.query_extras(0) == "q/k norms"
    m, tr = test_aya_vision.traced_case("aya_vision")
    a = m.adapter
    assert [a.query_extras(b) for b in range(a.n_layers)] == [None] * a.n_layers
    eye = torch.eye(a.d_head, dtype=torch.float64)
    for block in range(a.n_layers):
        R = rotation_matrix(a, tr, block, 5, a.d_head, torch.float64, 0)
        assert torch.equal(R, eye) == (a.sliding_window(block) is None), block
