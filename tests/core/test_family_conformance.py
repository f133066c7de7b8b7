"""The checks every family's adapter passes, one parametrised test each over
the tiny random-weight float64 models of the family test files
(tests/core/test_<family>.py). Each family file's ``traced_case(kind)`` builds
its model and capture once per session (cached), so these tests and the
family's own share them. A test runs over the families whose files hold it
(``_case_fixture``); a family's specific expectations live in its file as plain
constants and functions these tests call through :meth:`Case.hook` (e.g.
``check_decomposition``, ``JACOBIAN_COMPONENTS``, ``BAD_QUESTIONS``,
``visual_inputs``, ``recompute_patterns``)."""

import copy
import importlib

import numpy as np
import pytest
import torch
from PIL import Image

from core import load_model
from core.errors import QuestionError, UndefinedReadoutError, UnsupportedArchitectureError
from core.forward.capture import capture, eager_attention, edited_logits
from core.forward.edits import Edit
from core.methods.contributions import source_contributions
from core.methods.flow.knockout import ALL_LAYERS, knockout_sweep
from core.methods.flow.positions import parse_edges
from core.methods.logit_lens import logit_lens
from core.methods.residual import component_edit, decompose
from core.models import registry
from tests.core.exactness import (
    assert_canonical_projections,
    assert_decomposition_is_exact,
    assert_heads_sum_to_attention_output,
    assert_jacobian_dla_is_autograd,
    assert_lens_last_row_is_the_model,
    assert_recomputed_rows_are_eager,
    assert_reconstruction_and_lens_at_last_layer,
    assert_source_contributions_sum_to_each_heads_terms,
    forwards_tol,
    invert_around_box_centre,
    module_hook_counts,
    noise_image,
    values_tol,
)
from tests.core.knockout_reference import reference_logits
from tests.tolerances import sum_tol, unit_roundoff

FAMILY_FILES = (
    "aya_vision",
    "blip",
    "gemma3",
    "gemma3n",
    "glm4v",
    "idefics2",
    "idefics3",
    "internvl",
    "janus",
    "lfm2_vl",
    "llama4",
    "llava_next",
    "llava_onevision",
    "mistral3",
    "mllama",
    "molmo2",
    "paligemma",
    "qwen2_vl",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_vl",
    "qwen3_vl_moe",
)


def _module(family: str):
    return importlib.import_module(f"tests.core.test_{family}")


CASES = [(family, kind) for family in FAMILY_FILES for kind in _module(family).CASES]


def _id(case) -> str:
    family, kind = case[:2]
    name = kind if kind.startswith(family.split("_")[0]) or family == "blip" else f"{family}-{kind}"
    return name if len(case) == 2 else f"{name}-{case[2]}"


class Case:
    """One family file's case: its module, model, trace and the question and image size it uses."""

    def __init__(self, family: str, kind: str):
        self.family, self.kind = family, kind
        self.module = _module(family)
        traced = self.module.traced_case(kind)
        self.m, self.trace = traced[:2]
        self.traced_inputs = traced[2] if len(traced) > 2 else None  # the inputs where the case built its own
        self.question = getattr(self.module, "QUESTION", None) or self.module.PREFIX
        self.image_size = self.module.IMAGE_SIZE

    def hook(self, name: str, default=None):
        """The family file's own part of a check (``default`` where it has none)."""
        return getattr(self.module, name, default)

    def n_keys(self, n_positions: int) -> int:
        """The most keys a softmax reads: the text, or the family's cross-attended keys (``CROSS_KEYS``)."""
        return max(n_positions, self.hook("CROSS_KEYS", 0))

    def inputs(self):
        """The inputs of the case's capture: its own, or the question on its noise image."""
        if self.traced_inputs is not None:
            return self.traced_inputs
        return self.m.adapter.prepare([noise_image(self.image_size)], [self.question])


def _cases(families, per_model: bool) -> list[tuple[str, str]]:
    """The cases of ``families``; with ``per_model``, one per distinct model
    (a family file's ``MODEL_CASES``: its cases that differ in the model, not only the trace)."""
    out = []
    for family in families:
        module = _module(family)
        kinds = getattr(module, "MODEL_CASES", module.CASES) if per_model else module.CASES
        out += [(family, kind) for kind in kinds]
    return out


def _case_fixture(name: str, families=FAMILY_FILES, per_model: bool = False):
    """A fixture ``name`` giving a :class:`Case` of each family in ``families`` (the files holding the test)."""
    cases = _cases(families, per_model)

    @pytest.fixture(name=name, params=cases, ids=[_id(c) for c in cases])
    def _fixture(request) -> Case:
        return Case(*request.param)

    return _fixture


def _all_but(*families: str) -> list[str]:
    """The family files but ``families`` (those a check does not apply to; each family's file says why)."""
    assert set(families) <= set(FAMILY_FILES), set(families) - set(FAMILY_FILES)
    return [f for f in FAMILY_FILES if f not in families]


case = _case_fixture("case")
# Families whose tiny models answer "yes" / "no" (BLIP's captioner reads its own pair
# in tests/core/test_blip.py) and whose x_L is a sum of components (not Gemma 3n's AltUp
# streams: the decomposition, DLA and source contributions are refused, tests/core/test_gemma3n.py).
yes_no_case = _case_fixture("yes_no_case", _all_but("blip", "gemma3n"))
model_case = _case_fixture("model_case", per_model=True)
# decoder_case: x_L = x_0 + sum attn_out + sum mlp_out (not post-norm BLIP, not the sandwich norms,
# not Gemma 3n's AltUp streams)
decoder_case = _case_fixture("decoder_case", _all_but("blip", "gemma3", "gemma3n", "glm4v"))
padded_case = _case_fixture("padded_case", _all_but("llava_next"), per_model=True)
question_case = _case_fixture("question_case", _all_but("qwen2_vl"), True)
append_case = _case_fixture("append_case", per_model=True)
# The families whose patterns their own files recompute: the values alone here; the others, both.
_OWN_PATTERNS = ("gemma3", "mllama", "paligemma", "qwen2_vl", "qwen3_vl")
values_case = _case_fixture("values_case", list(_OWN_PATTERNS))
# Gemma 3n in neither: no linear value map (v_norm); its file recomputes patterns and values.
patterns_case = _case_fixture("patterns_case", _all_but(*_OWN_PATTERNS, "gemma3n"))
lens_case = _case_fixture("lens_case", _all_but("blip", "llava_next", "mllama"))

# Hybrid decoders: layers whose token mixer is not attention (Decoder.mixers).
_HYBRID = ("lfm2_vl", "qwen3_5", "qwen3_5_moe")
hybrid_case = _case_fixture("hybrid_case", list(_HYBRID))

# Families with mixture-of-experts MLPs: their files give ``expert_parts_by_hand(m, tr, block,
# position)`` (each chosen expert's and the shared expert's write at a position, computed
# independently of the adapter) and ``zeroed_expert(m, block, expert, positions)`` (a context
# patching the library's own experts module to zero one expert's output there).
_MOE = ("qwen3_5_moe", "qwen3_vl_moe")
moe_case = _case_fixture("moe_case", list(_MOE))

_PERTURBED = [
    (family, kind, size)
    for family, kind in _cases(_all_but("idefics2", "mllama"), per_model=True)
    for size in _module(family).PERTURB_SIZES
]


@pytest.fixture(params=_PERTURBED, ids=[_id(c) for c in _PERTURBED])
def perturbed_case(request) -> tuple[Case, tuple[int, int]]:
    family, kind, size = request.param
    return Case(family, kind), size


# ---- registry, weights, loading


def test_registry_and_description(model_case):
    """The registry maps each of the family's architectures to its adapter and
    names them when it refuses one it does not know; the description and head
    layout are the tiny config's."""
    c = model_case
    a = c.m.adapter
    adapters = c.hook("ADAPTERS")
    for architecture, cls in adapters.items():
        assert registry.adapter_for_hf(architecture) is cls
    with pytest.raises(UnsupportedArchitectureError) as refused:
        registry.adapter_for_hf(c.hook("UNKNOWN_ARCHITECTURE", "NoSuchVLMForConditionalGeneration"))
    assert all(architecture in str(refused.value) for architecture in adapters)
    d = a.describe()
    want = c.hook("DESCRIPTION")
    assert {key: d[key] for key in want} == want
    kv = c.hook("KV_LAYOUT")  # (n_kv_heads, d_head, kv_group(3)) of grouped-query decoders
    if kv is not None:
        assert (a.n_kv_heads, a.d_head, a.kv_group(3)) == kv
    extra = c.hook("check_registry_and_description")
    if extra is not None:
        extra(c.m, c.trace)


def test_canonical_weights_match_the_projections(model_case):
    """W_U is the output embedding (transposed) and b_U its bias (or zero); the
    family's q/k/v/o projections are its canonical weights (grouped K/V expanded
    per query head, gates folded into W_O), as its file lists them."""
    c = model_case
    m, a = c.m, c.m.adapter
    out = c.hook("output_embeddings", type(m.model).get_output_embeddings)(m.model)  # the unembedding module
    assert a.W_U.shape == (a.d_model, out.weight.shape[0]) and torch.equal(a.W_U, out.weight.T)
    if out.bias is None:
        assert torch.all(a.b_U == 0)
    else:
        assert torch.equal(a.b_U, out.bias)
    x = torch.randn(5, a.d_model, dtype=torch.float64)
    z = torch.randn(5, a.n_heads, a.d_head, dtype=torch.float64)
    for layer, out_gain in c.hook("CANONICAL_LAYERS", {}).items():  # {layer: the gain folded into its W_O}
        assert_canonical_projections(a, a._attn(layer), layer, x, z, out_gain=out_gain)
    c.hook("check_canonical_weights")(m, x)


def test_saved_folder_loads_with_this_adapter(model_case, tmp_path):
    """load_model on a saved folder (the model in float32) picks this adapter and
    runs the same model: as the saved float32 weights do, and as the float64
    model does up to float32 arithmetic; the same prompt and visual tokens; its
    recomputed attention rows are an eager forward's of the same folder."""
    c = model_case
    m = c.m
    saved = copy.deepcopy(m.model).float()  # the session's float64 model stays as it is
    saved.save_pretrained(tmp_path, safe_serialization=True)
    m.processor.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.family == m.family == c.hook("FAMILY", c.kind) and type(loaded.adapter) is type(m.adapter)
    before = type(m.adapter)(saved, m.processor, m.tokenizer)
    image, q = noise_image(c.image_size), c.question
    with torch.no_grad():
        got_inputs = loaded.adapter.prepare([image], [q])
        got = loaded.adapter.next_token_logits(got_inputs)
        want = before.next_token_logits(before.prepare([image], [q]))
        want64 = m.adapter.next_token_logits(m.adapter.prepare([image], [q])).float()
    n_keys = c.n_keys(got_inputs.input_ids.shape[1])
    torch.testing.assert_close(got, want, atol=forwards_tol(loaded.adapter, want, n_keys), rtol=0)
    # float64 against float32 weights and arithmetic: as far as two forwards in float32 may differ
    torch.testing.assert_close(got, want64, atol=forwards_tol(loaded.adapter, want64, n_keys), rtol=0)
    assert loaded.adapter.prompt(q) == m.adapter.prompt(q)
    assert len(loaded.adapter.visual_tokens(c.image_size)) == len(m.adapter.visual_tokens(c.image_size))
    # the folder's own attention rows (the default capture's, recomputed) are an eager forward's of the same folder
    assert_recomputed_rows_are_eager(loaded, got_inputs)
    extra = c.hook("check_loaded")
    if extra is not None:
        extra(m, loaded)


# ---- inputs


def test_right_padded_batch_matches_single_runs(padded_case):
    """Two images and questions of different lengths (the family's PADDED_BATCH):
    right padding (the tokenizer's left padding restored), the answer position
    is the last real token, each row's next-token logits equal its own run."""
    c = padded_case
    m, a = c.m, c.m.adapter
    sizes, questions = c.hook("PADDED_BATCH")
    images = [noise_image(size, i + 1) for i, size in enumerate(sizes)]
    batch = a.prepare(images, questions)
    assert a.tokenizer.padding_side == "left"  # restored
    mask = batch.tensors["attention_mask"]
    assert mask[0, -1] == 0 and mask[1, -1] == 1  # row 0 is right-padded
    answer_token = c.hook("ANSWER_TOKEN")  # the prompt's last token, where the family's prompt ends in one
    with torch.no_grad():
        logits = a.next_token_logits(batch)
        for i in range(2):
            single = a.prepare([images[i]], [questions[i]])
            assert int(batch.answer_positions[i]) == int(single.answer_positions[0]) == single.input_ids.shape[1] - 1
            if answer_token is not None:
                last = int(batch.input_ids[i, batch.answer_positions[i]])
                assert a.tokenizer.convert_ids_to_tokens(last) == answer_token
            want = a.next_token_logits(single)[0]
            torch.testing.assert_close(logits[i], want, atol=forwards_tol(a, want, c.n_keys(mask.shape[1])), rtol=0)
    extra = c.hook("check_padded_batch")
    if extra is not None:
        extra(m, batch)


def test_append_token_continues_the_text(append_case):
    """The appended token follows the answer position, and the text before it
    reads as it did (causal, or a prefix that does not read the suffix)."""
    c = append_case
    m, a = c.m, c.m.adapter
    inputs = a.prepare([noise_image(c.image_size)], [c.question])
    token = a.token_id(c.hook("APPENDED_WORD", "yes"))
    longer = a.append_token(inputs, token)
    assert int(longer.answer_positions[0]) == int(inputs.answer_positions[0]) + 1
    assert int(longer.input_ids[0, -1]) == token
    with torch.no_grad():
        before, after = a.forward_logits(inputs), a.forward_logits(longer)
    tol = forwards_tol(a, before, c.n_keys(longer.input_ids.shape[1]))
    torch.testing.assert_close(after[:, :-1], before, atol=tol, rtol=0)  # the prefix is unchanged
    extra = c.hook("check_appended_token")
    if extra is not None:
        extra(m, inputs, longer)


def test_question_errors(question_case, monkeypatch):
    """Blank questions, the family's BAD_QUESTIONS (``(message, question)``) and an
    empty question given to prepare are refused; the family's own limits follow."""
    c = question_case
    m, a = c.m, c.m.adapter
    for blank in ("  ", "   "):
        with pytest.raises(QuestionError, match="empty"):
            a.check_question(blank)
    for message, question in c.hook("BAD_QUESTIONS"):
        with pytest.raises(QuestionError, match=message):
            a.check_question(question)
    with pytest.raises(QuestionError):
        a.prepare([noise_image(c.image_size)], [""])
    own = c.hook("check_question_errors")
    if own is not None:
        own(m, monkeypatch)
    else:
        question_fits_as_text_not_with_the_image(c, monkeypatch)


def question_fits_as_text_not_with_the_image(c, monkeypatch) -> None:
    """The family's default limit: the image's token count follows its size, so the question
    fits as text while prepare, which sees the image's real token count, refuses the total."""
    a = c.m.adapter
    n = a.prepare([noise_image(c.image_size)], [c.question]).input_ids.shape[1]
    monkeypatch.setattr(a, "max_positions", lambda: n - 1)
    a.check_question(c.question)
    with pytest.raises(QuestionError, match=f"{n} tokens with the image"):
        a.prepare([noise_image(c.image_size)], [c.question])


# ---- capture and exactness


def test_heads_sum_to_attention_output(case):
    """sum_h W_O z + b_O equals what every block's attention wrote (attn_out)."""
    assert_heads_sum_to_attention_output(case.m.adapter, case.trace)


def test_residual_reconstruction_and_lens_at_last_layer(decoder_case):
    """x_L = x_0 + sum attn + sum mlp and the lens on x_L is the captured logits,
    which are a plain forward's (no hook of ours changes the computation): the
    default capture's are the model's own (sdpa) forward's bitwise, an eager
    capture's the eager forward's bitwise, and the two differ only as far as two
    forwards may (a float64 softmax, not eager's float32). x_0 is the token
    embeddings with the family's visual inputs (``visual_inputs``) scattered into their positions."""
    c = decoder_case
    m, a, tr = c.m, c.m.adapter, c.trace
    assert tr.attention == "sdpa"
    assert_reconstruction_and_lens_at_last_layer(a, tr)
    inputs = c.inputs()
    with torch.no_grad():
        sdpa = a.forward_logits(inputs)
        with eager_attention(m.model):
            eager = a.forward_logits(inputs)
    torch.testing.assert_close(tr.logits, sdpa, atol=0, rtol=0)
    eager_trace = capture(m, None, "", inputs=inputs, attention="eager", keep_attn_out=True)
    assert_reconstruction_and_lens_at_last_layer(a, eager_trace)
    torch.testing.assert_close(eager_trace.logits, eager, atol=0, rtol=0)
    n_keys = c.n_keys(tr.input_ids.shape[1])
    torch.testing.assert_close(tr.logits, eager, atol=forwards_tol(a, eager, n_keys), rtol=0)
    vis = tr.visual_positions[0]
    text = torch.ones(tr.input_ids.shape[1], dtype=torch.bool)
    text[vis] = False
    emb = a.language_model.embed_tokens(tr.input_ids[0])
    torch.testing.assert_close(tr.resid_pre[0][0, text], emb[text], atol=0, rtol=0)
    visual_inputs = c.hook("visual_inputs")
    if visual_inputs is not None:
        with torch.no_grad():  # as in the capture: the model's own attention in the vision tower too
            projected = visual_inputs(m, noise_image(c.image_size))
        torch.testing.assert_close(tr.resid_pre[0][0, vis], projected, atol=0, rtol=0)
    extra = c.hook("check_reconstruction")
    if extra is not None:
        extra(m, tr, inputs, sdpa=sdpa, eager=eager)


def test_logit_lens_last_row_is_the_model(lens_case):
    """One row per layer plus x_L, read at the last position; the last row is the
    model's logit, logit difference and the answer's rank."""
    c = lens_case
    a, tr = c.m.adapter, c.trace
    a_id, f_id = a.token_id("yes"), a.token_id("no")
    lens = logit_lens(a, tr, a_id, f_id)
    assert [r.layer for r in lens.rows] == list(range(a.n_layers + 1))
    p = lens.position
    assert p == int(tr.answer_positions[0]) == tr.input_ids.shape[1] - 1
    assert_lens_last_row_is_the_model(a, tr, lens, a_id, f_id)  # logit_lens reports float32 numbers
    assert lens.rows[-1].answer_rank == int((tr.logits[0, p] > tr.logits[0, p, a_id]).sum())


def test_frozen_dla_sums_to_logit_difference_minus_bias(yes_no_case):
    """The frozen-scale decomposition is exact (RMSNorms that take their statistics
    in float32 even in a float64 model are allowed their float32 rounding), with the
    components the family's graph has."""
    c = yes_no_case
    a = c.m.adapter
    r = assert_decomposition_is_exact(a, c.trace, a.token_id("yes"), a.token_id("no"))
    c.hook("check_decomposition")(c.m, c.trace, r)


def test_jacobian_dla_equals_autograd_directional_derivative(yes_no_case):
    c = yes_no_case
    a = c.m.adapter
    a_id, f_id = a.token_id("yes"), a.token_id("no")
    which = c.hook("JACOBIAN_COMPONENTS")
    kwargs = {} if which is None else {"which": which}
    _, names = assert_jacobian_dla_is_autograd(a, c.trace, a_id, f_id, **kwargs)
    extra = c.hook("check_jacobian")
    if extra is not None:
        extra(c.m, c.trace, a_id, f_id, names)


def test_source_contributions_sum_to_each_heads_output(yes_no_case):
    """Summed over sources (visual keys for cross blocks), each head's contributions
    equal its residual component under every convention (u . W_O^h z^h at the
    answer position for the projection; the value path with its biases)."""
    c = yes_no_case
    a, tr = c.m.adapter, c.trace
    a_id, f_id = a.token_id("yes"), a.token_id("no")
    sc = source_contributions(a, tr, a_id, f_id)
    assert_source_contributions_sum_to_each_heads_terms(a, tr, sc, decompose(a, tr, a_id, f_id))
    extra = c.hook("check_source_contributions")
    if extra is not None:
        extra(c.m, tr, sc)


def _assert_values_recomputed(a, tr) -> None:
    """z = (recorded pattern) @ (norm(source) W_V + b_V) at every query position and
    block: the stream for self blocks, the cross-attended keys for cross blocks."""
    for block in tr.attention_blocks:
        source = tr.kv_source[block]
        src = a.kv_norm(block)(tr.resid_pre[block][0] if source is None else source[0])
        v = torch.einsum("pm,hmd->phd", src, a.W_V(block)) + a.b_V(block)
        z = torch.einsum("hqk,khd->qhd", tr.patterns[block][0], v)
        gate = a.output_gate(tr, block)  # a gated head (Qwen3.5): the query's gate scales its output
        z = z if gate is None else z * gate[tr.query_positions]
        tol = values_tol(tr.patterns[block][0], src, a.W_V(block), a.b_V(block))
        torch.testing.assert_close(z, tr.z[block][0, tr.query_positions], atol=tol, rtol=0)


def test_values_recomputed_from_canonical_weights(values_case):
    _assert_values_recomputed(values_case.m.adapter, values_case.trace)


def test_patterns_and_values_recomputed_from_canonical_weights(patterns_case):
    """Every block's pattern, recomputed from canonical weights the family's way
    (``recompute_patterns``: RoPE, masks, cross keys), is the recorded one up to the
    model's float32 softmax; the values follow from the recorded patterns."""
    c = patterns_case
    a, tr = c.m.adapter, c.trace
    recompute = c.hook("recompute_patterns")
    for block in tr.attention_blocks:
        pattern, rtol = recompute(a, tr, block)
        torch.testing.assert_close(pattern[:, tr.query_positions], tr.patterns[block][0], atol=0, rtol=rtol)
    _assert_values_recomputed(a, tr)
    extra = c.hook("check_patterns_and_values")
    if extra is not None:
        extra(c.m, tr)


def test_recomputed_rows_equal_eager_attention(case):
    """The default (sdpa) capture's pattern rows are eager attention's weights:
    on the same calls to eager's float32 rounding, across runs to two forwards' distance."""
    assert_recomputed_rows_are_eager(case.m, case.inputs())


def test_knockout_equals_the_eager_reference(model_case):
    """Attention knockout on the family's fast path (the mask each call receives, edited;
    rows batched) gives, in every single-layer window and in all layers, the answer logit
    and probability of eager attention with the cut scores set to minus infinity before
    the softmax (tests/core/knockout_reference.py), for the image's, half the image's and the
    question's edges to the answer position."""
    c = model_case
    m, image = c.m, noise_image(c.image_size)
    inputs = m.adapter.prepare([image], [c.question])
    base = capture(m, None, "", pattern_layers=[], inputs=inputs)
    pos = int(base.answer_positions[0])
    answer_id = int(base.logits[0, pos].argmax())
    edges = parse_edges("image->answer,question->answer,region->answer")
    n_visual = max(base.visual_positions.shape[1], *(kv.shape[1] for kv in base.kv_source if kv is not None), 0)
    region = list(range(n_visual // 2))  # half the image's tokens: a cross-attention row keeps the others
    result = knockout_sweep(m, inputs, image, c.question, edges, answer_id, base=base, batch_size=4, region=region)
    names = base.block_names
    moved = False
    for profile in result.profiles:
        assert [w.centre for w in profile.windows] == [*result.layers, ALL_LAYERS]
        for window in profile.windows:
            cuts = {names.index(b.block): (b.queries, b.keys) for b in window.cut}
            logits = reference_logits(m, inputs, cuts)[0, pos].double()
            tol = forwards_tol(m.adapter, logits, c.n_keys(base.logits.shape[1]))
            assert window.edited.logit == pytest.approx(float(logits[answer_id]), abs=tol), (
                profile.edge,
                window.centre,
            )
            p = float(logits.softmax(-1)[answer_id])
            assert window.edited.prob == pytest.approx(p, abs=p * np.expm1(2 * tol) + 1e-12), (
                profile.edge,
                window.centre,
            )
            # the check can fail: some cut moves the answer by more than two forwards' distance
            moved |= abs(window.edited.logit - result.original.logit) > 2 * tol
    assert moved and result.profile("image->answer").window(ALL_LAYERS).cut


def test_hooks_are_removed_and_attention_restored(case):
    """A capture leaves no hook behind (none is there before it either) and puts
    the attention implementation back, also when it fails."""
    m = case.m
    before = m.model.config._attn_implementation
    image = noise_image(case.image_size)
    capture(m, image, case.question)
    counts = module_hook_counts(m.model)
    if not case.hook("LIBRARY_HOOKS"):  # the library keeps hooks of its own on some models
        assert all(c == (0, 0) for c in counts)
    capture(m, image, case.question)
    assert m.model.config._attn_implementation == before
    assert module_hook_counts(m.model) == counts
    with pytest.raises(IndexError):
        capture(m, image, case.question, query_positions=[10_000])
    assert module_hook_counts(m.model) == counts
    assert m.model.config._attn_implementation == before
    extra = case.hook("check_attention_restored")
    if extra is not None:
        extra(m, before)


# ---- layers without attention (hybrid decoders)


def test_a_layer_without_pattern_is_refused_in_one_line_and_is_one_component(hybrid_case):
    """Every block whose mixer is not attention: its pattern, queries and keys, a head's write,
    a head or knockout edit are refused with one line naming the block and the mixer; its
    source contributions are None (not zeros); its write is one component equal to what the
    library's mixer module returned, and the blocks that attend have their rows."""
    c = hybrid_case
    m, a, tr = c.m, c.m.adapter, c.trace
    inputs = c.inputs()
    mixers = [b for b in range(tr.n_blocks) if a.mixer(b) is not None]
    assert mixers and tr.attention_blocks and sorted(tr.patterns) == tr.attention_blocks
    a_id, f_id = a.token_id("yes"), a.token_id("no")
    sc = source_contributions(a, tr, a_id, f_id)
    answer = int(tr.answer_positions[0])
    names, C = a.component_stack(tr, answer)
    for position in [0, int(tr.visual_positions[0][3]), answer]:  # exact wherever it is read
        assert decompose(a, tr, a_id, f_id, position=position).reconstruction_ok
    for b in mixers:
        name, what = tr.block_names[b], a.mixer(b).what
        for call in (
            lambda b=b: capture(m, None, "", inputs=inputs, pattern_layers=[b]),
            lambda b=b: capture(m, None, "", inputs=inputs, keep_qk=[b]),
            lambda b=b: tr.head_output(a, b, answer),
            lambda b=b: a.queries_keys(tr, b),
            lambda b=b: edited_logits(m, inputs, [Edit(b, 0, [answer])]),
            lambda b=b: edited_logits(m, inputs, [Edit(b, None, [answer], site="knockout", keys=[0])]),
        ):
            with pytest.raises(UndefinedReadoutError) as refused:
                call()
            message = str(refused.value)
            assert "\n" not in message and message.startswith(f"{name} has no attention pattern") and what in message
        assert sc.dla_frozen[b] is None and sc.norm[b] is None
        row = names.index(f"{name}.{a.mixer(b).module}")
        torch.testing.assert_close(C[row], tr.mixer_out[b][0, answer].to(C.dtype), atol=0, rtol=0)
        assert not any(n.startswith(f"{name}.H") for n in names)
    with pytest.raises(UndefinedReadoutError, match="rollout"):  # a product of every layer's pattern
        capture(m, None, "", inputs=inputs, pattern_streams=[lambda *args: None])


def test_a_mixer_ablation_equals_a_hook_on_the_librarys_module(hybrid_case):
    """component_edit of a mixer's component (edit site "mixer") at some positions equals a
    forward hook written here zeroing the library's mixer module's output there; it moves the logits."""
    c = hybrid_case
    m, a, tr = c.m, c.m.adapter, c.trace
    inputs = c.inputs()
    positions = [*tr.visual_positions[0][:3].tolist(), int(tr.answer_positions[0])]
    for b in [b for b in range(tr.n_blocks) if a.mixer(b) is not None]:
        edit = component_edit(tr, f"{tr.block_names[b]}.{a.mixer(b).module}", tuple(positions))
        assert (edit.site, edit.block) == ("mixer", b)
        got = edited_logits(m, inputs, [edit])

        def zero(module, args, out):
            written = out[0] if isinstance(out, tuple) else out
            written = written.clone()
            written[:, positions] = 0
            return (written, *out[1:]) if isinstance(out, tuple) else written

        handle = getattr(a.language_model.layers[b], a.mixer(b).module).register_forward_hook(zero)
        try:
            with torch.no_grad():
                want = a.forward_logits(inputs)
        finally:
            handle.remove()
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert float((got - tr.logits).abs().max()) > forwards_tol(a, want, c.n_keys(want.shape[1]))


# ---- mixture-of-experts MLPs


def test_expert_components_reconstruct_the_mlp_output(moe_case):
    """At every position of every MoE block the MLP's components are the experts the router
    chose there (and the shared expert), each equal to the family's write computed by hand,
    and they sum to the MoE module's output to float rounding (the residue is that rounding)."""
    c = moe_case
    a, tr = c.m.adapter, c.trace
    blocks = [b for b in range(tr.n_blocks) if a.moe_experts(b)]
    assert blocks and all(b in tr.mlp_in for b in blocks)
    for b in blocks:
        for p in range(tr.input_ids.shape[1]):
            parts = dict(a.mlp_components(tr, b, p))
            want = c.hook("expert_parts_by_hand")(c.m, tr, b, p)
            assert sorted(parts) == sorted([*want, f"L{b}.experts_residue"])
            terms = sum(v.abs() for v in want.values())
            for name, w in want.items():  # the same products as the model forms them: a few roundings each
                tol = 8 * unit_roundoff(w.dtype) * float(terms.max()) + float(torch.finfo(w.dtype).tiny)
                torch.testing.assert_close(parts[name], w, atol=tol, rtol=0)
            total = sum(want.values())
            # the model's sum of the k + 1 parts into zeros and this one, in other orders
            tol = sum_tol(float(terms.max()), 2 * (len(want) + 1), tr.mlp_out[b].dtype)
            assert float((total - tr.mlp_out[b][0, p]).abs().max()) <= tol
            assert float(parts[f"L{b}.experts_residue"].abs().max()) <= tol


def test_expert_ablation_equals_a_hand_written_hook(moe_case):
    """Edit site "expert" (component_edit of ``L{b}.E{e}``) at some positions gives the logits
    of a forward whose experts module is patched to zero that expert's output there; it moves
    the logits exactly when some of those positions chose the expert."""
    c = moe_case
    m, a, tr = c.m, c.m.adapter, c.trace
    inputs = c.inputs()
    block = next(b for b in range(tr.n_blocks) if a.moe_experts(b))
    answer = int(tr.answer_positions[0])
    positions = [*tr.visual_positions[0][:4].tolist(), answer]
    moved_any = False
    for expert in range(a.moe_experts(block)):
        edit = component_edit(tr, f"L{block}.E{expert}", tuple(positions))
        assert (edit.site, edit.block, edit.expert) == ("expert", block, expert)
        got = edited_logits(m, inputs, [edit])
        with c.hook("zeroed_expert")(m, block, expert, positions), torch.no_grad():
            want = a.forward_logits(inputs)
        tol = forwards_tol(a, want, c.n_keys(want.shape[1]))
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
        chose = any(f"L{block}.E{expert}" in c.hook("expert_parts_by_hand")(m, tr, block, p) for p in positions)
        moved = float((got - tr.logits).abs().max())
        assert (moved > 2 * tol) if chose else (moved == 0), (expert, moved)
        moved_any |= chose
    assert moved_any


# ---- geometry


def test_perturbing_a_box_centre_moves_its_own_token_most(perturbed_case):
    """Geometry by experiment on a non-square image: inverting the pixels around a
    token's box centre (in the original image) changes that token's features more
    than any of its rivals'. The family's file names the features
    (``perturbation_features``: what the decoder reads of each visual token, a
    tuple), the probed tokens (``perturbation_probes``) and each probe's rivals
    (``perturbation_rivals``, default every token), and what else must hold."""
    c, size = perturbed_case
    m, a = c.m, c.m.adapter
    base = np.asarray(noise_image(size, c.hook("PERTURB_SEED", 3))).copy()
    tokens = a.visual_tokens(size)
    features = c.hook("perturbation_features")
    ref = features(m, Image.fromarray(base))
    assert all(r.shape[0] == len(tokens) for r in ref)
    probes = c.hook("perturbation_probes", lambda m, size, tokens: tokens)(m, size, tokens)
    rivals = c.hook("perturbation_rivals", lambda tokens, t: [torch.arange(len(tokens))])
    extra = c.hook("check_perturbation")
    for t in probes:
        arr = invert_around_box_centre(base, t.box, c.hook("PERTURB_SHRINK", 5))
        changes = [(got - want).norm(dim=-1) for got, want in zip(features(m, Image.fromarray(arr)), ref)]
        for change in changes:
            for group in rivals(tokens, t):
                assert int(group[change[group].argmax()]) == t.index, (t, change[group].topk(3))
        if extra is not None:
            extra(tokens, t, changes)
