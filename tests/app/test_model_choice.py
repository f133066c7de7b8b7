"""The model picker's dtype and device (issue 25): the two pickers, a bfloat16 read-out
recorded and named as bfloat16, the model cache keyed by spec, dtype and device, views
stale on another dtype, the recent models remembering dtype and device, a restored run
picking the dtype it ran in."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QSettings

import app.jobs
import app.recent_models
from app.components import ModelChoice
from app.components.model_choice import device_choices
from app.recent_models import OLD_SPECS_KEY, recent_choices, recent_models, remember_model, remembered_choice
from core.shell.precision import DTYPE_CHOICES
from tests.app.test_session_reopen import _close, _window
from tests.app.test_window import run_until_idle

BF16 = ModelChoice("shapes-llava", "bfloat16", "cpu")


@pytest.fixture
def settings(tmp_path, monkeypatch):
    """The recent models in a settings file of this test's own (the other tests' picker stays as it was)."""
    path = str(tmp_path / "settings.ini")
    monkeypatch.setattr(app.recent_models, "_settings", lambda: QSettings(path, QSettings.Format.IniFormat))
    return path


def test_the_picker_offers_dtype_and_device(qtbot, model_cache, tmp_path, settings):
    win = _window(qtbot, model_cache, tmp_path / "s.vlmr")
    try:
        dtypes = [win.inputs.dtype_picker.itemText(i) for i in range(win.inputs.dtype_picker.count())]
        devices = [win.inputs.device_picker.itemText(i) for i in range(win.inputs.device_picker.count())]
        assert tuple(dtypes) == DTYPE_CHOICES and win.inputs.dtype_picker.currentText() == "auto"
        assert tuple(devices) == device_choices() and win.inputs.device_picker.currentText() == "cpu"
        # without CUDA the device picker shows the CPU only, disabled (with CUDA: cuda, cuda:N, auto too)
        assert win.inputs.device_picker.isEnabled() == (len(devices) > 1)
        assert "float32 on the CPU" in win.inputs.dtype_picker.toolTip()
        assert win.model_choice() == ModelChoice("shapes-llava", "auto", "cpu")
        win.inputs.dtype_picker.setCurrentText("float16")
        assert win.model_choice() == ModelChoice("shapes-llava", "float16", "cpu")
        assert win.workspace.input.model_dtype == "float16"
        assert win.inputs.set_model_choice("bfloat16", "cuda:7") == (
            [] if "cuda:7" in devices else ["device cuda:7 is not offered here (now cpu)"]
        )
        assert win.inputs.dtype_picker.currentText() == "bfloat16"
    finally:
        _close(win)


def test_the_model_cache_is_keyed_by_spec_dtype_and_device(monkeypatch):
    """A bfloat16 model is never served for a float32 request (nor a CPU one for CUDA)."""
    loads = []

    def fake_load(spec, **options):
        loads.append((spec, options))
        return object()

    monkeypatch.setattr(app.jobs.core, "load_model", fake_load)
    cache: dict = {}
    quiet = lambda *a: None  # noqa: E731
    bf16 = app.jobs._cached_model(cache, BF16, quiet)
    float32 = app.jobs._cached_model(cache, ModelChoice("shapes-llava", "float32", "cpu"), quiet)
    on_cuda = app.jobs._cached_model(cache, ModelChoice("shapes-llava", "bfloat16", "cuda"), quiet)
    assert len({id(bf16), id(float32), id(on_cuda)}) == 3
    assert app.jobs._cached_model(cache, ModelChoice("shapes-llava", "bfloat16", "cpu"), quiet) is bf16  # reused
    assert loads == [
        ("shapes-llava", {"dtype": "bfloat16", "device": "cpu"}),
        ("shapes-llava", {"dtype": "float32", "device": "cpu"}),
        ("shapes-llava", {"dtype": "bfloat16", "device": "cuda"}),
    ]
    with pytest.raises(ValueError, match="fp8"):
        ModelChoice("shapes-llava", "fp8")


def test_a_bfloat16_readout_is_recorded_and_named_bfloat16(qtbot, model_cache, tmp_path, settings):
    win = _window(qtbot, model_cache, tmp_path / "s.vlmr")
    try:
        win.inputs.dtype_picker.setCurrentText("bfloat16")
        run_until_idle(qtbot, win, win.actions.run_readout)
        assert win.inputs.error_label.text() == ""
        loaded = win.model_cache[BF16]
        assert win.loaded_model() is loaded
        assert loaded.adapter.dtype_and_device() == {"dtype": "bfloat16", "device": "cpu"}
        assert win.analysis.input.dtype == win.analysis.model.dtype == "bfloat16"
        (info,) = win.session.runs()
        run = win.session.run(info.id)
        assert run.parameters["dtype"] == "bfloat16" and run.parameters["device"] == "cpu"
        rows = [r for r in win.session.audit_table() if r["run_id"] == info.id]
        assert rows and all("dtype=bfloat16; device=cpu" in r["specification"] for r in rows)
        for name in ("attention", "dla", "lens", "answer", "canvas"):
            frame = win.run_frames[name]
            assert not frame.stale and "shapes-llava · bfloat16 · cpu" in frame.header_text(), name
        # remembered with its dtype and device
        assert remembered_choice("shapes-llava") == BF16

        # another dtype picked: the views were drawn for bfloat16 (stale, saying so); nothing of
        # the bfloat16 model is served for float32
        win.inputs.dtype_picker.setCurrentText("float32")
        assert win.loaded_model() is None or win.loaded_model() is not loaded
        shown = [win.run_frames[name] for name in ("attention", "dla", "lens", "answer", "canvas")]
        for frame in shown:
            header = frame.header_text()
            assert frame.stale and header.startswith("stale (dtype changed): drawn for "), header
            assert "shapes-llava · bfloat16 · cpu;" in header and header.endswith("shapes-llava · float32 · cpu")
        win.inputs.dtype_picker.setCurrentText("bfloat16")
        assert not any(frame.stale for frame in shown)
    finally:
        _close(win)

    # a new window on the same spec starts in the remembered dtype; a restored run picks the one it ran in
    again = _window(qtbot, model_cache, tmp_path / "s.vlmr")
    try:
        assert (
            again.inputs.dtype_picker.currentText() == "bfloat16" and again.inputs.device_picker.currentText() == "cpu"
        )
        again.inputs.dtype_picker.setCurrentText("auto")
        assert again.sessions.restore_run(info.id), again.inputs.error_label.text()
        assert (
            again.inputs.dtype_picker.currentText() == "bfloat16" and again.inputs.device_picker.currentText() == "cpu"
        )
        assert again.workspace.input.model_choice() == BF16
        frame = again.run_frames["attention"]
        assert not frame.stale and "shapes-llava · bfloat16 · cpu" in frame.header_text()
    finally:
        _close(again)


def test_recent_models_remember_dtype_and_device_and_read_old_settings(settings):
    QSettings(settings, QSettings.Format.IniFormat).setValue(OLD_SPECS_KEY, ["/models/mine", "org/repo"])
    assert recent_choices() == [ModelChoice("/models/mine"), ModelChoice("org/repo")]  # bare specs: the defaults
    remember_model(ModelChoice("org/repo", "float16", "cuda:1"))
    assert recent_choices() == [ModelChoice("org/repo", "float16", "cuda:1"), ModelChoice("/models/mine")]
    assert recent_models() == ["org/repo", "/models/mine"]
    remember_model(ModelChoice("org/repo", "bfloat16", "cpu"))  # one entry per spec, the latest choice
    assert remembered_choice("org/repo") == ModelChoice("org/repo", "bfloat16", "cpu")
    assert remembered_choice("shapes-coca") is None
    assert ModelChoice.from_stored("{not json") is None and ModelChoice.from_stored("") is None


def test_a_model_too_large_for_the_memory_is_refused_in_the_window(qtbot, model_cache, tmp_path, settings, monkeypatch):
    """The reported memory lowered (core.models.memory's override): float16 on a model not
    yet loaded is refused in the window's one error line naming both numbers, before the
    library builds anything, and the shown run is neither replaced nor recorded over."""
    import transformers

    win = _window(qtbot, model_cache, tmp_path / "s.vlmr")
    try:
        run_until_idle(qtbot, win, win.actions.run_readout)  # the float32 run the views show
        shown = win.workspace.shown
        runs = len(win.session.runs())
        monkeypatch.setenv("VLM_READOUT_MEMORY_AVAILABLE", "1MB")

        def no_allocation(*args, **kwargs):
            raise AssertionError("the model was built although it does not fit")

        monkeypatch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained", no_allocation)
        win.inputs.dtype_picker.setCurrentText("float16")
        run_until_idle(qtbot, win, win.actions.run_readout)
        message = win.inputs.error_label.text()
        assert "\n" not in message and "Traceback" not in message
        assert "float16 and 1.0 MB is available" in message, message
        assert ModelChoice("shapes-llava", "float16", "cpu") not in win.model_cache
        assert len(win.session.runs()) == runs and win.workspace.shown is shown
    finally:
        _close(win)
