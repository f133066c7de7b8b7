"""How exactly the issue-30 families' residual splits reconstruct, on their tiny float64
models (tests/core/test_<family>.py): per family the largest ``experts_residue`` over every
position and mixture-of-experts block (the MLP's write minus its experts' and shared expert's
writes: the model's own summation order) beside the largest MoE write, and the decomposition's
relative reconstruction error at the answer position beside its bound.

    PYTHONPATH=. python bench/moe_decomposition.py

The conformance suite asserts the bounds (tests/core/test_family_conformance.py); this prints
the sizes measured. CPU, seconds."""

from __future__ import annotations

import importlib

import torch

from core.methods.residual import decompose

FAMILIES = ("qwen3_vl_moe", "qwen3_5_moe", "llama4", "qwen3_5", "lfm2_vl")


@torch.no_grad()
def measure(family: str) -> dict:
    module = importlib.import_module(f"tests.core.test_{family}")
    m, tr = module.traced_case(module.CASES[0])[:2]
    a = m.adapter
    residue = write = 0.0
    for b in range(tr.n_blocks):
        if not a.moe_experts(b):
            continue
        for p in range(tr.input_ids.shape[1]):
            residue = max(residue, float(dict(a.mlp_components(tr, b, p))[f"L{b}.experts_residue"].abs().max()))
            write = max(write, float(tr.mlp_out[b][0, p].abs().max()))
    r = decompose(a, tr, a.token_id("yes"), a.token_id("no"))
    return {
        "residue": residue if write else None,
        "write": write if write else None,
        "rel_err": r.reconstruction_rel_err,
        "bound": r.reconstruction_bound,
        "components": len(r.components),
    }


def main() -> None:
    print(f"{'family':14} {'max residue':>12} {'max |mlp|':>10} {'rel err':>9} {'bound':>9} components")
    for family in FAMILIES:
        x = measure(family)
        residue = "-" if x["residue"] is None else f"{x['residue']:.2e}"
        write = "-" if x["write"] is None else f"{x['write']:.2f}"
        print(f"{family:14} {residue:>12} {write:>10} {x['rel_err']:9.2e} {x['bound']:9.2e} {x['components']}")


if __name__ == "__main__":
    main()
