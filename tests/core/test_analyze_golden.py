"""The analyze JSON of every served family's tiny model and of the two shipped
models, compared with a committed copy (tests/data/analyze_golden/<case>.json.gz).

This is the check that a refactor of the adapters (issue 26: every family as a
declaration read by one generic adapter) leaves what ``core.analyze.analyze``
writes unchanged. Each case is one ``analyze`` run:

* ``shapes-llava`` and ``shapes-coca`` (``core.load_model``): the first bundled
  sample of resources/samples/pairs.jsonl with its question, answer and foil;
* ``llava`` and ``coca``: the tiny float64 models of
  tests/core/test_capture_llava.py and tests/core/test_capture_coca.py, on that
  same sample (their tokenizers are the shipped models', so they know its words);
* every other case: the tiny float64 model of a family file of
  tests/core/test_family_conformance.py (``FAMILY_FILES``), one per distinct model
  (the file's ``MODEL_CASES``, else its ``CASES``: ``traced_case(kind)``'s model), on
  ``noise_image(IMAGE_SIZE)`` with the file's ``QUESTION`` (or ``PREFIX``), answer
  "yes" and foil "no" (BLIP's captioner: "cat" and "dog"). A case is named after
  its family when the file has one model, else after the kind.

:data:`SERVED` is the fixed list of cases that must have a golden file; every
other file in the folder is checked too, so a family added later joins by
writing its file:

    .venv/bin/python -m tests.core.test_analyze_golden --write gemma3     # named cases
    .venv/bin/python -m tests.core.test_analyze_golden --write            # every case known
    .venv/bin/python -m tests.core.test_analyze_golden --list             # the cases, and which have a file

Rewrite a served case's file only for an intended change of its JSON. After
writing a new case, run this test under ``ATEN_CPU_CAPABILITY=default`` too: an
image processor that resizes uint8 pixels rounds some of them one level apart
there (torch's AVX2 uint8 antialiasing kernel against the generic one), which
moves a tiny model's read-outs by ~1e-2, far beyond rounding; such a case takes
an image already at its canvas size (:data:`_IMAGE_SIZES`: Mllama, Gemma 3).

What is compared: the whole JSON. Keys (and their order), strings, ints, bools,
nulls and list lengths exactly: nothing in the document varies between runs (run
twice under one ``ATEN_CPU_CAPABILITY`` it is bitwise the same; the shipped
models' fingerprints hash fixed files, the tiny models have none, the audit rows
hold no time or version). Floats within a tolerance, because a refactor may
reorder a sum (heads in another order, a matmul split differently), as torch's
CPU kernels do under another SIMD path (``ATEN_CPU_CAPABILITY`` default / avx2 /
avx512):

    |got - want| <= rtol * scale,    rtol = (2 n_layers + 2) * gamma_{d_model}(float32)

* ``gamma_n = n u / (1 - n u)`` (tests/tolerances.py ``gamma``; Higham, Lemma 3.1)
  is how far an ``n``-term sum in another order may move, relative to its terms'
  size; ``d_model`` terms is the width of the residual stream's reductions (q, k,
  v, out, MLP in, unembedding rows); a read-out passes one such reduction per
  sublayer (2 per block), the visual input's and the final norm and unembedding's,
  each adding its error: the first-order ``forward_tol`` estimate of
  tests/tolerances.py, ``n_steps * gamma_width``. ``n_layers`` and ``d_model``
  are the document's own ``model`` block.
* ``u`` is float32's (6.0e-8) for every case, the float64 tiny models included:
  the target and logit-lens read-outs take their softmax over float32 logits
  (core/answer.py, core/methods/logit_lens.py), and the Hugging Face families run
  their RMSNorm statistics, eager softmax and RoPE tables in float32 even in a
  float64 model (tests/tolerances.py ``FLOAT32_STEPS``). So a tiny model
  (d_model 64, 3 layers) allows 3.1e-5 of ``scale``, a shipped one (128, 4)
  7.6e-5, CoCa's (32, 2) 1.1e-5. The largest differences measured between
  ``ATEN_CPU_CAPABILITY=default``, avx2 and avx512 are at most 2e-6 of ``scale``
  (33 u), 17 to 115 times below the case's ``rtol``; a change a
  refactor would make by mistake (a bias dropped, a head's terms moved, another
  norm scale) moves a field by far more.
* ``scale`` is the largest ``|want|`` of the field across the document (the JSON
  path with every list index replaced by ``*``: all components' ``dla_frozen``,
  every entry of a ``patterns`` array), a rounding error being relative to the
  size of the terms a read-out combines, not to a result that cancels to near
  zero (tests/tolerances.py, point 3). The fields in logit units
  (:data:`_LOGIT_FIELDS`: logits, their differences, DLA terms, KL divergences, each
  a cancelling combination of the same logits) share one scale, the largest of them.
* Two fields are rounding errors themselves (:data:`_ROUNDING_ERRORS`: the
  reconstruction error of the decomposition, which moves by its own size under
  another summation order): each is checked against the bound the document
  states for it, and the verdict ``reconstruction_ok`` exactly.

The files hold the document as compact JSON, each float rounded to 10
significant digits (5e-11 of itself, far below the tolerance), gzipped; the
folder stays under :data:`SIZE_BUDGET`. A mismatch names its JSON path, e.g.
``residual_decomposition.components[3].dla_frozen: 0.1234 != 0.1236 (tol 3.1e-05)``.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import importlib
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "data" / "analyze_golden"
# The folder's largest total size, in bytes.
SIZE_BUDGET = 500_000

# The cases served before issue 26's new families: each must have its golden file.
SERVED = (
    "shapes-llava",
    "shapes-coca",
    "llava",
    "coca",
    "llava_next",
    "qwen2_vl",
    "qwen2_5_vl",
    "paligemma",
    "idefics3",
    "smolvlm",
    "mllama",
    "blip",
)

# Answer and foil of a family's cases, where not "yes" / "no".
_PAIRS = {"blip": ("cat", "dog")}
# A family's image size where not its file's IMAGE_SIZE: Mllama's (140, 50) is resized
# into its 3-tile canvas in uint8, which rounds ~10 % of the pixels one level apart
# under ATEN_CPU_CAPABILITY=default; at the canvas size (96 x 32, the same 3 tiles
# and padding tile) no resize runs and the pixels are the same under every capability.
_IMAGE_SIZES = {"mllama": (96, 32), "gemma3": (48, 48)}  # at the canvas size: no uint8 resize
# Significant digits a stored float keeps.
_DIGITS = 10
# The fields in logit units, compared at one shared scale (see the module docstring).
_LOGIT_FIELDS = frozenset(
    {
        "target.logit",
        "target.logit_diff",
        "residual_decomposition.target_logit",
        "residual_decomposition.frozen_sum_expected",
        "residual_decomposition.components[*].projection",
        "residual_decomposition.components[*].dla_frozen",
        "residual_decomposition.components[*].dla_jacobian",
        "logit_lens[*].answer_logit",
        "logit_lens[*].logit_diff",
        "logit_lens[*].kl_to_final",
    }
)
# Fields that measure a rounding error, each with the bound the document states for
# it: ``reconstruction_rel_err`` (||sum of components - x_L|| / ||x_L||) within
# ``reconstruction_bound``; ``reconstruction_max_abs_err`` (the largest entry of that
# difference) within ``reconstruction_bound * ||x_L||``, ``||x_L||`` being at most the
# sum of the components' norms.
_ROUNDING_ERRORS = {
    "residual_decomposition.reconstruction_rel_err": lambda rd: rd["reconstruction_bound"],
    "residual_decomposition.reconstruction_max_abs_err": lambda rd: (
        rd["reconstruction_bound"] * sum(c["norm"] for c in rd["components"])
    ),
}
_PAIRS_FILE = Path(__file__).resolve().parents[2] / "resources" / "samples" / "pairs.jsonl"


# ---- the cases


def _family_module(family: str):
    return importlib.import_module(f"tests.core.test_{family}")


@functools.cache
def _family_cases() -> dict[str, tuple[str, str]]:
    """``{case name: (family file, kind)}`` over the family files of the conformance
    suite, one case per distinct model (the file's ``MODEL_CASES``, else ``CASES``)."""
    from tests.core.test_family_conformance import FAMILY_FILES

    out = {}
    for family in FAMILY_FILES:
        module = _family_module(family)
        kinds = getattr(module, "MODEL_CASES", module.CASES)
        for kind in kinds:
            out[family if len(kinds) == 1 else kind] = (family, kind)
    return out


def _family_case(name: str) -> tuple[str, str]:
    """``(family file, kind)`` of case ``name``: the file named after it where it has
    that one model (importing no other family file), else the one of :func:`_family_cases`."""
    try:
        module = _family_module(name)
    except ModuleNotFoundError as e:
        if e.name != f"tests.core.test_{name}":
            raise
    else:
        kinds = getattr(module, "MODEL_CASES", getattr(module, "CASES", ()))
        if len(kinds) == 1:
            return name, kinds[0]
    return _family_cases()[name]


def case_names() -> list[str]:
    """Every case known: the shipped and capture-test models, then the family files'."""
    return list(dict.fromkeys([*SERVED[:4], *_family_cases()]))


def _case_inputs(name: str):
    """``(loaded model, image, question, answer, foil)`` of case ``name``."""
    if name in ("shapes-llava", "shapes-coca", "llava", "coca"):
        row = json.loads(_PAIRS_FILE.read_text().splitlines()[0])
        if name.startswith("shapes-"):
            from core import load_model

            m = load_model(name)
        elif name == "llava":
            from tests.core.test_capture_llava import tiny_llava_float64

            m = tiny_llava_float64()
        else:
            from tests.core.test_capture_coca import tiny_coca_float64

            m = tiny_coca_float64()
        return m, _PAIRS_FILE.parent / row["image"], row["question"], row["answer"], row["foil"]
    from tests.core.exactness import noise_image

    family, kind = _family_case(name)
    module = _family_module(family)
    m = module.traced_case(kind)[0]
    question = getattr(module, "QUESTION", None) or module.PREFIX
    answer, foil = _PAIRS.get(family, ("yes", "no"))
    return m, noise_image(_IMAGE_SIZES.get(family, module.IMAGE_SIZE)), question, answer, foil


def run_case(name: str) -> dict:
    """The analyze JSON of case ``name``, as the CLI writes it (strict JSON)."""
    import torch

    from core.analyze import analyze

    m, image, question, answer, foil = _case_inputs(name)
    with torch.no_grad():
        result = analyze(m, image, question, answer=answer, foil=foil)
    return json.loads(json.dumps(result.to_dict(), allow_nan=False))


def _rounded(x):
    if isinstance(x, float):
        return float(f"{x:.{_DIGITS}g}")
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return x


def golden_path(name: str, folder: Path | None = None) -> Path:
    return (folder or GOLDEN_DIR) / f"{name}.json.gz"


def write_golden(name: str, doc: dict, folder: Path | None = None) -> Path:
    """Write ``doc`` as case ``name``'s file: compact, rounded, gzipped reproducibly (no time stamp)."""
    text = json.dumps(_rounded(doc), separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    path = golden_path(name, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))
    return path


def read_golden(name: str, folder: Path | None = None) -> dict:
    return json.loads(gzip.decompress(golden_path(name, folder).read_bytes()).decode("utf-8"))


# ---- the comparison

_INDEX = re.compile(r"\[\d+\]")


def rtol(doc: dict) -> float:
    """``(2 n_layers + 2) gamma_{d_model}(float32)`` of the document's model (module docstring)."""
    import torch

    from tests.tolerances import gamma

    model = doc["model"]
    return (2 * model["n_layers"] + 2) * gamma(model["d_model"], torch.float32)


def _field(path: str) -> str:
    """The field of a float's JSON path: every list index as ``*``; the logit-unit fields as one."""
    field = _INDEX.sub("[*]", path)
    return "<logits>" if field in _LOGIT_FIELDS else field


def _scales(doc, path: str = "", out: dict | None = None) -> dict[str, float]:
    """``{field: largest |value|}`` over the float leaves of ``doc`` (:func:`_field`)."""
    out = {} if out is None else out
    if isinstance(doc, dict):
        for k, v in doc.items():
            _scales(v, f"{path}.{k}" if path else k, out)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            _scales(v, f"{path}[{i}]", out)
    elif isinstance(doc, float):
        field = _field(path)
        out[field] = max(out.get(field, 0.0), abs(doc))
    return out


def _kind(x) -> str:
    return "null" if x is None else type(x).__name__  # type(), not isinstance: a bool is no int here


def compare(want: dict, got: dict, tol: float | None = None) -> list[str]:
    """The differences of ``got`` from ``want``, one line each naming its JSON path.
    Floats: ``|got - want| <= tol * scale`` (``tol`` defaults to :func:`rtol` of
    ``want``; ``scale`` is the field's largest ``|want|``, :func:`_scales`); rounding
    errors within their bound (:data:`_ROUNDING_ERRORS`); all else exactly."""
    tol = rtol(want) if tol is None else tol
    scales = _scales(want)
    diffs: list[str] = []

    def walk(w, g, path: str) -> None:
        where = path or "<document>"
        if _kind(w) != _kind(g):
            diffs.append(f"{where}: {w!r} != {g!r} (type {_kind(w)} != {_kind(g)})")
        elif isinstance(w, dict):
            if list(w) != list(g):
                diffs.append(f"{where}: keys {list(w)} != {list(g)}")
            for k in w:
                if k in g:
                    walk(w[k], g[k], f"{path}.{k}" if path else k)
        elif isinstance(w, list):
            if len(w) != len(g):
                diffs.append(f"{where}: length {len(w)} != {len(g)}")
            for i, (a, b) in enumerate(zip(w, g, strict=False)):
                walk(a, b, f"{path}[{i}]")
        elif isinstance(w, float) and path in _ROUNDING_ERRORS:
            bound = _ROUNDING_ERRORS[path](want["residual_decomposition"])
            if not 0 <= g <= bound:
                diffs.append(f"{where}: {g!r} not within [0, {bound:.3g}] (a rounding error; golden {w!r})")
        elif isinstance(w, float):
            allowed = tol * scales[_field(path)]
            if not (math.isfinite(g) and abs(g - w) <= allowed):
                diffs.append(f"{where}: {w!r} != {g!r} (tol {allowed:.3g})")
        elif w != g:
            diffs.append(f"{where}: {w!r} != {g!r}")

    walk(want, got, "")
    return diffs


def largest_difference(want: dict, got: dict) -> tuple[float, str]:
    """The largest ``|got - want| / scale`` over the float leaves (rounding errors
    aside) and its path, of two documents of the same shape."""
    scales = _scales(want)
    best = (0.0, "")

    def walk(w, g, path: str) -> None:
        nonlocal best
        if isinstance(w, dict):
            for k in w:
                walk(w[k], g[k], f"{path}.{k}" if path else k)
        elif isinstance(w, list):
            for i, (a, b) in enumerate(zip(w, g, strict=True)):
                walk(a, b, f"{path}[{i}]")
        elif isinstance(w, float) and path not in _ROUNDING_ERRORS:
            scale = scales[_field(path)]
            rel = abs(g - w) / scale if scale else abs(g - w)
            if rel > best[0]:
                best = (rel, path)

    walk(want, got, "")
    return best


def _message(name: str, diffs: list[str], limit: int = 20) -> str:
    more = f"\n... and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return (
        f"the analyze JSON of {name!r} differs from {golden_path(name)} in {len(diffs)} places "
        f"(rewrite it only for an intended change: python -m tests.core.test_analyze_golden --write {name}):\n"
        + "\n".join(diffs[:limit])
        + more
    )


# ---- the tests


def _checked_cases() -> list[str]:
    """The served cases, then every other case with a golden file."""
    stored = sorted(p.name.removesuffix(".json.gz") for p in GOLDEN_DIR.glob("*.json.gz"))
    return list(dict.fromkeys([*SERVED, *stored]))


@pytest.mark.parametrize("name", _checked_cases())
def test_analyze_json_is_unchanged(name):
    assert golden_path(name).is_file(), (
        f"no golden file for {name!r}: python -m tests.core.test_analyze_golden --write {name}"
    )
    want = read_golden(name)
    diffs = compare(want, run_case(name))
    assert not diffs, _message(name, diffs)


@pytest.mark.parametrize("name", _checked_cases())
def test_the_typed_result_reads_back_every_golden_json(name):
    """``AnalyzeResult.from_dict`` holds every part of a stored analyze JSON: its
    ``to_dict`` is the document again, key order and every float as written."""
    from core.analyze import AnalyzeResult

    want = read_golden(name)
    back = AnalyzeResult.from_dict(json.loads(json.dumps(want)))
    got = back.to_dict()
    assert json.dumps(got) == json.dumps(want)  # the same keys in the same order, the same values
    assert AnalyzeResult.from_dict(got).summary() == back.summary()


def test_a_moved_number_is_found_and_named():
    """The comparison passes a number moved within the tolerance and fails one
    moved beyond it, a changed string, int, length or key, naming each path."""
    want = read_golden("blip")
    tol = rtol(want)
    got = json.loads(json.dumps(want))
    comps = got["residual_decomposition"]["components"]
    scale = _scales(want)["<logits>"]
    comps[3]["dla_frozen"] += 0.5 * tol * scale
    got["residual_decomposition"]["reconstruction_rel_err"] *= 3  # a rounding error, still within its bound
    assert compare(want, got) == []
    comps[3]["dla_frozen"] += 2 * tol * scale
    got["residual_decomposition"]["reconstruction_rel_err"] = (
        10 * want["residual_decomposition"]["reconstruction_bound"]
    )
    got["attention"][1]["argmax_source"] += 1
    got["target"]["answer"] = "dog"
    got["logit_lens"].pop()
    got["input"]["extra"] = 1
    diffs = compare(want, got)
    assert [d.split(": ")[0] for d in diffs] == [
        "input",
        "target.answer",
        "residual_decomposition.reconstruction_rel_err",
        "residual_decomposition.components[3].dla_frozen",
        "logit_lens",
        "attention[1].argmax_source",
    ], diffs
    old = want["residual_decomposition"]["components"][3]["dla_frozen"]
    assert diffs[3] == (
        f"residual_decomposition.components[3].dla_frozen: {old!r} != {comps[3]['dla_frozen']!r} "
        f"(tol {tol * scale:.3g})"
    )


def test_a_moved_number_in_a_golden_file_fails_the_case(tmp_path, monkeypatch):
    """End to end on a temporary copy of a file with one number moved: the case fails, naming the path."""
    doc = read_golden("blip")
    rd = doc["residual_decomposition"]
    rd["components"][3]["dla_frozen"] += 10 * rtol(doc) * _scales(doc)["<logits>"]
    write_golden("blip", doc, tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "GOLDEN_DIR", tmp_path)
    with pytest.raises(AssertionError, match=r"residual_decomposition\.components\[3\]\.dla_frozen: "):
        test_analyze_json_is_unchanged("blip")


def test_golden_files_are_small():
    """Compact, gzipped, one file per case: the folder stays a few hundred KB."""
    sizes = {p.name: p.stat().st_size for p in GOLDEN_DIR.glob("*.json.gz")}
    assert sum(sizes.values()) <= SIZE_BUDGET, sizes


# ---- the regeneration command


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as tests/conftest.py
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(
        prog="python -m tests.core.test_analyze_golden",
        description="Write or inspect the golden analyze JSONs of tests/core/test_analyze_golden.py.",
    )
    parser.add_argument(
        "--write", nargs="*", metavar="CASE", help="(re)write these cases' files (none named: every case)"
    )
    parser.add_argument("--out", type=Path, help="write into this folder instead")
    parser.add_argument("--list", action="store_true", help="list the cases known and which have a file")
    parser.add_argument(
        "--diff",
        type=Path,
        metavar="DIR",
        help="per case, the largest difference of DIR's file (written with --out DIR) from the golden one",
    )
    args = parser.parse_args(argv)
    if args.list:
        for name in case_names():
            print(name, "(golden)" if golden_path(name).is_file() else "(no file)")
    if args.write is not None:
        for name in args.write or case_names():
            path = write_golden(name, run_case(name), args.out)
            print(f"{path}: {path.stat().st_size} bytes")
    if args.diff is not None:
        for name in _checked_cases():
            if golden_path(name).is_file() and golden_path(name, args.diff).is_file():
                want, got = read_golden(name), read_golden(name, args.diff)
                rel, where = largest_difference(want, got)
                print(f"{name}: {rel:.2g} of scale (rtol {rtol(want):.2g}) at {where}; {len(compare(want, got))} over")
    return 0


if __name__ == "__main__":
    sys.exit(main())
