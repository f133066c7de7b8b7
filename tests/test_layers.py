"""The layers hold: import-linter checks the contracts in pyproject.toml
([tool.importlinter]): core never imports the GUI, core.methods never imports
the command lines or the zoo, core.models never imports core.zoo or
core.methods, app.components never imports Qt or the views, and no import
cycles among core's modules. Function-local imports count too; none is excepted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The `lint-imports` entry point, run with this interpreter (no script on PATH needed).
LINT = [
    sys.executable,
    "-c",
    "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
    "--no-cache",  # nothing written into the checkout
    "--no-logo",
]


def lint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*LINT, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept():
    r = lint(str(ROOT / "pyproject.toml"))
    report = r.stdout + r.stderr
    assert r.returncode == 0, f"import-linter: a layer contract is broken\n{report}"
    assert "0 broken" in report, report


def test_a_broken_contract_fails(tmp_path):
    """The check can fail: a contract the code breaks (core.cli imports
    core.errors) is reported broken, so a kept contract means something."""
    config = tmp_path / "pyproject.toml"
    config.write_text(
        "[tool.importlinter]\n"
        'root_packages = ["core", "app"]\n'
        "include_external_packages = true\n"
        "[[tool.importlinter.contracts]]\n"
        'name = "deliberately broken"\n'
        'type = "forbidden"\n'
        'source_modules = ["core.cli"]\n'
        'forbidden_modules = ["core.errors"]\n',
        encoding="utf-8",
    )
    r = lint(str(config))
    report = r.stdout + r.stderr
    assert r.returncode == 1, report
    assert "BROKEN" in report and "core.cli -> core.errors" in report, report
