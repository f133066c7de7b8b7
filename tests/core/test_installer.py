"""The PyInstaller spec bundles every file under resources/ and every
transformers model family an adapter serves."""

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run_spec(monkeypatch) -> dict:
    """Execute the spec with PyInstaller stubbed out; returns Analysis' keyword
    arguments (``collect_submodules(name)`` stands for ``[name]``)."""
    captured = {}
    hooks = types.ModuleType("PyInstaller.utils.hooks")
    hooks.collect_data_files = lambda *a, **k: []
    hooks.collect_submodules = lambda name, *a, **k: [name]
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
    return captured


def test_spec_data_list_covers_resources(monkeypatch):
    captured = _run_spec(monkeypatch)
    bundled = {(Path(dest) / Path(src).name).as_posix() for src, dest in captured["datas"]}
    expected = {f.relative_to(ROOT).as_posix() for f in (ROOT / "resources").rglob("*") if f.is_file()}
    assert expected and expected <= bundled


def test_spec_names_every_transformers_family_an_adapter_serves(monkeypatch):
    """transformers imports model families lazily; the bundle must carry each one
    an adapter is registered for, or it cannot even read that model's config."""
    import transformers

    from core.models import registry

    captured = _run_spec(monkeypatch)
    registry.supported()  # imports every family module
    families = {getattr(transformers, arch).__module__.split(".")[2] for arch in registry._HF}
    assert families and {f"transformers.models.{f}" for f in families} <= set(captured["hiddenimports"])


def test_spec_bundles_torchvisions_compiled_ops_beside_its_sources(monkeypatch):
    """torchvision opens its compiled ops from its own folder with torch.ops.load_library;
    PyInstaller's analysis cannot see them, so the spec must list each one."""
    import torchvision

    captured = _run_spec(monkeypatch)
    package = Path(torchvision.__file__).parent
    compiled = {f.name for f in package.glob("*.so")} | {f.name for f in package.glob("*.pyd")}
    bundled = {Path(src).name for src, dest in captured["binaries"] if dest == "torchvision"}
    assert compiled and compiled <= bundled
    assert captured["module_collection_mode"]["torchvision"] == "py"
