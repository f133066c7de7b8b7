"""The sdpa capture path (core/forward/attention_rows.py, docs/ARCHITECTURE.md "Capture on the
sdpa path"): the wrappers come and go, rows do not depend on which rows were asked for,
rollout fed block by block is the product of full patterns, and analyze asks only for
the rows its read-outs read. The per-family check against eager attention's own
weights is tests/core/exactness.py::assert_recomputed_rows_are_eager."""

import threading

import pytest
import torch
from PIL import Image

import core.readouts.pipeline as pipeline
from core import load_model
from core.analyze import analyze
from core.forward.attention_rows import ROW_CHUNK, RecomputedRows, recording
from core.forward.capture import capture
from core.methods.patterns import RolloutStream, rollout
from core.readouts import TEXT_PATTERN_LIMIT, pattern_rows
from core.zoo import scenes
from tests.core.test_capture_coca import tiny_coca_float64
from tests.core.test_capture_llava import tiny_llava_float64
from tests.tolerances import sum_tol


@pytest.fixture(scope="module")
def llava():
    return tiny_llava_float64()


@pytest.fixture(scope="module")
def sample():
    s = scenes.make_sample("heldout", 4)
    return Image.fromarray(s.image), s.question


def _attention_functions():
    from transformers.modeling_utils import AttentionInterface
    from transformers.models.llama import modeling_llama

    return dict(AttentionInterface._global_mapping), modeling_llama.eager_attention_forward


def test_wrappers_are_installed_only_while_recording_and_restored_after_an_error(llava, sample):
    before = _attention_functions()
    modules = {0: llava.adapter.attention_module(0)}
    calls = []
    with recording(modules, lambda block, call: calls.append(block)):
        assert _attention_functions() != before
        llava.adapter.forward_logits(llava.adapter.prepare([sample[0]], [sample[1]]))
    assert _attention_functions() == before
    assert calls == [0]  # the other blocks (and the vision tower) pass through unrecorded
    with pytest.raises(ZeroDivisionError), recording(modules, lambda block, call: 1 / 0):
        llava.adapter.forward_logits(llava.adapter.prepare([sample[0]], [sample[1]]))
    assert _attention_functions() == before


def test_one_model_is_recorded_by_one_capture_at_a_time(llava):
    modules = {0: llava.adapter.attention_module(0)}
    with recording(modules, lambda block, call: None):
        with pytest.raises(RuntimeError, match="already being captured"):
            with recording(modules, lambda block, call: None):
                pass
    with recording(modules, lambda block, call: None):  # released after the first ended
        pass


def test_captures_of_two_models_in_two_threads_record_their_own_calls(llava, sample):
    other = load_model("shapes-llava")
    image, question = sample
    before = _attention_functions()
    results, errors = {}, []

    def run(name, loaded):
        try:
            results[name] = capture(loaded, image, question, keep_qk=True)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(name, m)) for name, m in (("tiny", llava), ("shapes", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results["tiny"].q[0].shape[-1] == llava.adapter.d_head
    assert results["shapes"].q[0].shape[-1] == other.adapter.d_head
    assert _attention_functions() == before


def _recorded_call(llava, sample, block: int = 1):
    """``(the AttentionCall block ``block`` received, the sequence length)`` of one forward."""
    inputs = llava.adapter.prepare([sample[0]], [sample[1]])
    calls = {}
    with recording({block: llava.adapter.attention_module(block)}, lambda b, call: calls.setdefault(b, call)):
        llava.adapter.forward_logits(inputs)
    return calls[block], inputs.input_ids.shape[1]


def test_a_row_is_the_same_whichever_rows_are_asked_with_it(llava, sample):
    """Bitwise: row p alone, among its chunk, among every row, repeated or negative-indexed."""
    call, n = _recorded_call(llava, sample)
    rows = RecomputedRows(call)
    assert rows.causal_only  # sdpa got no mask tensor: causal by itself
    every = rows.rows(torch.arange(n))
    for p in (0, ROW_CHUNK - 1, ROW_CHUNK, n - 1):
        torch.testing.assert_close(rows.rows(torch.tensor([p]))[:, :, 0], every[:, :, p], atol=0, rtol=0)
    picked = torch.tensor([n - 1, 3, 3, -1])
    torch.testing.assert_close(rows.rows(picked), every[:, :, [n - 1, 3, 3, n - 1]], atol=0, rtol=0)
    assert torch.all(every.triu(1) == 0)  # no key after its query
    with pytest.raises(IndexError):
        rows.rows(torch.tensor([n]))


def test_the_chunks_kept_rows_computed_are_reused_by_a_stream_and_equal_bitwise(llava, sample):
    call, n = _recorded_call(llava, sample)
    plain, reusing = RecomputedRows(call), RecomputedRows(call, reuse=2)
    computed = []
    scores = reusing.scores
    reusing.scores = lambda rows, limit: computed.append(int(rows[0]) // ROW_CHUNK) or scores(rows, limit)
    ends = torch.tensor([0, n - 1])
    kept = reusing.rows(ends)  # the kept rows first (two chunks), then a stream walks them all
    walked = [reusing.rows(torch.arange(i, min(i + ROW_CHUNK, n))) for i in range(0, n, ROW_CHUNK)]
    n_chunks = -(-n // ROW_CHUNK)
    assert n_chunks >= 2 and sorted(computed) == list(range(n_chunks))  # every chunk once
    torch.testing.assert_close(kept, plain.rows(ends), atol=0, rtol=0)
    torch.testing.assert_close(torch.cat(walked, dim=2), plain.rows(torch.arange(n)), atol=0, rtol=0)


def test_kept_pattern_rows_hold_only_their_own_storage(llava, sample):
    """The answer row of a capture is one row, not a view into its padded ROW_CHUNK-row chunk
    (which would keep ROW_CHUNK times the memory alive in the trace)."""
    trace = capture(llava, *sample)
    assert trace.attention == "sdpa"
    for block, rows in trace.patterns.items():
        assert rows.shape[2] == len(trace.query_positions)
        assert rows.untyped_storage().nbytes() == rows.numel() * rows.element_size(), block


def test_capture_refuses_an_unknown_attention_mode_and_rows_out_of_range(llava, sample):
    with pytest.raises(ValueError, match="attention"):
        capture(llava, sample[0], sample[1], attention="flash")
    with pytest.raises(IndexError):
        capture(llava, sample[0], sample[1], query_positions=[10_000])


def test_an_attention_implementation_whose_rows_cannot_be_recomputed_is_refused(llava, sample):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register("test_custom", sdpa_attention_forward)
    before = llava.model.config._attn_implementation
    try:
        llava.model.set_attn_implementation("test_custom")
        with pytest.raises(NotImplementedError, match="test_custom"):
            capture(llava, sample[0], sample[1])
        eager = capture(llava, sample[0], sample[1], attention="eager")  # the explicit way out
        assert eager.attention == "eager" and len(eager.patterns) == llava.adapter.n_layers
    finally:
        llava.model.set_attn_implementation(before)
        AttentionInterface._global_mapping.pop("test_custom")


@pytest.mark.parametrize("which", ["llava", "coca"])
def test_rollout_fed_block_by_block_is_the_product_of_full_patterns(which, sample):
    """RolloutStream (self blocks; CoCa's cross blocks grow the visual nodes) against
    core.methods.patterns.rollout on the same capture's full patterns: both float32,
    one node-long sum per block in other orders."""
    loaded = tiny_llava_float64() if which == "llava" else tiny_coca_float64()
    image, question = sample
    n = loaded.adapter.prepare([image], [question]).input_ids.shape[1]
    for alpha, heads in ((0.5, "mean"), (0.8, 1)):
        stream = RolloutStream(alpha, heads)
        tr = capture(loaded, image, question, query_positions=range(n), pattern_streams=[stream])
        full = rollout(tr, alpha, heads=heads)
        assert stream.matrix.shape == (1, *full.shape)
        tol = sum_tol(1.0, tr.n_blocks * full.shape[0], torch.float32)
        torch.testing.assert_close(stream.matrix[0], full, atol=tol, rtol=0)
        assert tr.pattern_streams == []  # not kept after the run


def test_pattern_rows_are_the_text_and_answer_rows_never_the_visual_ones(llava, sample):
    inputs = llava.adapter.prepare([sample[0]], [sample[1]])
    visual = set(llava.adapter.visual_positions(inputs)[0].tolist())
    rows = pattern_rows(llava.adapter, inputs)
    answer = int(inputs.answer_positions[0])
    assert answer in rows and not visual & set(rows)
    text = [p for p in range(answer + 1) if p not in visual]
    assert rows == text[-TEXT_PATTERN_LIMIT:]


def test_analyze_asks_for_the_rows_its_readouts_read(llava, sample, monkeypatch):
    seen = {}
    real = pipeline.capture  # the one capture analyze and the dataset audit run (core.readouts.pipeline)

    def spy(*args, **kwargs):
        trace = real(*args, **kwargs)
        seen["rows"], seen["streams"] = trace.query_positions.tolist(), kwargs.get("pattern_streams")
        return trace

    monkeypatch.setattr(pipeline, "capture", spy)
    d = analyze(llava, sample[0], sample[1]).to_dict()
    inputs = llava.adapter.prepare([sample[0]], [sample[1]])
    assert seen["rows"] == pattern_rows(llava.adapter, inputs)
    assert len(seen["streams"]) == 1 and d["rollout"] is not None
    assert "attention" not in d["input"]  # the default (sdpa) is not recorded as a parameter
    eager = analyze(llava, sample[0], sample[1], attention="eager")
    assert eager.input.attention == "eager" and eager.parameters()["attention"] == "eager"
    assert eager.to_dict()["input"]["attention"] == "eager"
    monkeypatch.setattr(pipeline, "FULL_PATTERN_LIMIT", 3)
    assert analyze(llava, sample[0], sample[1]).rollout is None
