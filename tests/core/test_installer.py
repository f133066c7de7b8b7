"""The PyInstaller spec bundles every file under resources/."""

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_spec_data_list_covers_resources(monkeypatch):
    captured = {}
    hooks = types.ModuleType("PyInstaller.utils.hooks")
    hooks.collect_data_files = lambda *a, **k: []
    hooks.collect_submodules = lambda *a, **k: []
    for name in ("PyInstaller", "PyInstaller.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "PyInstaller.utils.hooks", hooks)
    namespace = {
        "SPECPATH": str(ROOT / "installer"),
        "Analysis": lambda *a, **k: (
            captured.update(k) or types.SimpleNamespace(pure=[], scripts=[], binaries=[], datas=[])
        ),
        "PYZ": lambda *a, **k: None,
        "EXE": lambda *a, **k: None,
        "COLLECT": lambda *a, **k: None,
    }
    exec(compile((ROOT / "installer" / "vlm_readout.spec").read_text(), "vlm_readout.spec", "exec"), namespace)
    bundled = {(Path(dest) / Path(src).name).as_posix() for src, dest in captured["datas"]}
    expected = {f.relative_to(ROOT).as_posix() for f in (ROOT / "resources").rglob("*") if f.is_file()}
    assert expected and expected <= bundled
    assert any(p.endswith("shapes-llava/model.safetensors") for p in bundled)
    assert any(p.endswith("shapes-coca/open_clip_model.safetensors") for p in bundled)
