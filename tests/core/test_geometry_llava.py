"""Geometry by experiment: perturbing the pixels at a token's box centre
changes that token's input to the language model the most."""

import numpy as np
import pytest
import torch
from PIL import Image

from core import load_model


@pytest.mark.parametrize("size", [(128, 128), (200, 150), (150, 260)])
def test_perturbing_a_box_centre_moves_its_own_token_most(size):
    m = load_model("shapes-llava")
    a = m.adapter
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    tokens = a.visual_tokens(size)
    assert len(tokens) == 64

    def lm_inputs(arr):
        """``(64, d_model)``: the visual tokens as the language model receives them."""
        inputs = a.prepare([Image.fromarray(arr)], ["is there a red circle?"])
        with torch.no_grad():
            out = m.model.model.get_image_features(
                pixel_values=inputs.tensors["pixel_values"],
                vision_feature_layer=-1,
                vision_feature_select_strategy="default",
            )
        return out.pooler_output[0]

    ref = lm_inputs(base)
    for t in tokens[::9]:
        x0, y0, x1, y1 = t.box
        cx, cy = int((x0 + x1) / 2), int((y0 + y1) / 2)
        arr = base.copy()
        arr[max(0, cy - 2) : cy + 3, max(0, cx - 2) : cx + 3] = (
            255 - arr[max(0, cy - 2) : cy + 3, max(0, cx - 2) : cx + 3]
        )
        change = (lm_inputs(arr) - ref).norm(dim=-1)
        assert int(change.argmax()) == t.index, (t, change.topk(3))
