"""Every served Hugging Face family opens from a saved folder as a user's
folder is opened (``load_model`` -> ``AutoProcessor.from_pretrained``), with
the packages its processor needs installed by ``make test`` (pyproject's
dependencies), never stubbed.

The round trips themselves live in one place each:
tests/core/test_trust_weights.py::test_every_family_round_trips_with_no_error_and_no_warning
(every family: loads quietly with the same weights) and
tests/core/test_family_conformance.py::test_saved_folder_loads_with_this_adapter
(each tiny model: the same adapter, prompt and logits). This file checks that
they cover every served architecture and that the processors' own imports are
the real packages."""

import tomllib
from pathlib import Path

import pytest

from core.models import registry
from tests.core import test_trust_weights

ROOT = Path(__file__).resolve().parents[2]


def _dependencies() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {d.split(";")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower() for d in deps}


def test_every_served_architecture_has_a_folder_round_trip():
    """Adding a family means adding its tiny folder to the round trip."""
    families = test_trust_weights.test_every_family_round_trips_with_no_error_and_no_warning.pytestmark[0].args[1]
    served = {a for a in registry.supported() if not a.startswith("open_clip:")}
    covered = {type(test_trust_weights._tiny(f)[0]).__name__ for f in families}
    assert served <= covered, f"no folder round trip for {sorted(served - covered)}"


@pytest.mark.parametrize(
    "module, package",
    [
        ("transformers.models.smolvlm.processing_smolvlm", "num2words"),  # SmolVLMProcessor refuses to start without it
        ("transformers.models.smolvlm.video_processing_smolvlm", "torchvision"),
        ("transformers.models.qwen2_vl.video_processing_qwen2_vl", "torchvision"),
        ("transformers.models.qwen3_vl.video_processing_qwen3_vl", "torchvision"),
        ("transformers.models.molmo2.image_processing_molmo2", "torchvision"),  # a torchvision backend only
        ("transformers.models.glm4v.video_processing_glm4v", "torchvision"),
    ],
)
def test_processor_packages_are_dependencies_and_installed(module, package):
    import importlib

    assert package in _dependencies(), f"{package} is not in pyproject's dependencies"
    importlib.import_module(package)
    mod = importlib.import_module(module)
    if package == "num2words":
        assert mod.num2words is not None and mod.num2words.__module__.startswith("num2words")
