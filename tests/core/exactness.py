"""Exactness checks shared by every family's tests: each compares what a
capture recorded with an independent computation."""

import numpy as np
import pytest
import torch
from PIL import Image

from core.methods.residual import component_stack, decompose, target_direction


def assert_heads_sum_to_attention_output(adapter, trace, tol):
    """sum_h W_O^h z^h + b_O equals the attention block's recorded output, every block."""
    for block in range(trace.n_blocks):
        heads = trace.head_output(adapter, block, torch.arange(trace.input_ids.shape[1]))
        torch.testing.assert_close(heads.sum(1) + adapter.b_O(block), trace.attn_out[block][0], atol=tol, rtol=0)


def assert_reconstruction_and_lens_at_last_layer(adapter, trace, tol):
    """x_L = x_0 + sum attn + sum mlp, and the lens on x_L is the model's logits."""
    recon = trace.resid_pre[0] + sum(trace.attn_out) + sum(trace.mlp_out)
    assert (recon - trace.final_resid).abs().max() <= tol * max(1.0, float(trace.final_resid.abs().max()))
    lens = adapter.final_norm_layer()(trace.final_resid[0]) @ adapter.W_U + adapter.b_U
    torch.testing.assert_close(lens, trace.logits[0], atol=tol * 10, rtol=0)


def assert_jacobian_dla_is_autograd(adapter, trace, answer_id, foil_id, abs_tol, rel_tol, which=None):
    """u^T J_Norm(x_L) c equals autograd's directional derivative for a few components."""
    r = decompose(adapter, trace, answer_id, foil_id)
    x_L = trace.final_resid[0, r.position].detach()
    u = target_direction(adapter, answer_id, foil_id).detach()
    norm_f = adapter.final_norm_layer()
    names, C = component_stack(adapter, trace, r.position)
    for i in which or (0, 3, len(names) - 1):
        _, d = torch.autograd.functional.jvp(lambda x: norm_f(x) @ u, x_L, C[i].detach())
        assert r.components[i].dla_jacobian == pytest.approx(float(d), abs=max(abs_tol, rel_tol * abs(float(d))))
    return r, names


def noise_image(size: tuple[int, int], seed: int = 0) -> Image.Image:
    """A random RGB image of ``size = (width, height)``."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def module_hook_counts(model) -> list[tuple[int, int]]:
    """(forward hooks, forward pre-hooks) of every module: equal before and after a capture."""
    return [(len(mod._forward_hooks), len(mod._forward_pre_hooks)) for mod in model.modules()]
