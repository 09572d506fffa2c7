"""The ``tiny`` variant is the CPU workhorse: every structural feature, a few million
parameters, a training step (forward + backward) well under a second per sample."""

import time

import torch
from hf_reference import image_tokens, megatron_position_ids, pixel_values_for

from examples.multimodal_dev.models.qwen35_vl.configuration import FULL, LINEAR, get_variant
from examples.multimodal_dev.models.qwen35_vl.factory import build_model


def test_tiny_trains_fast_on_cpu(mcore):
    shape = get_variant("tiny", moe=True)
    assert {LINEAR, FULL} <= set(shape.text.layer_types) and shape.text.is_moe
    model = build_model(shape)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny (MoE) parameters: {n_params / 1e6:.2f} M")
    assert 1e6 < n_params < 10e6
    grids = [(1, 8, 12)]
    row = list(range(10, 200)) + image_tokens(shape, 8, 12) + list(range(200, 400))
    ids = torch.tensor([row])
    mask = torch.ones_like(ids)
    labels = torch.roll(ids, -1, dims=1)
    pos = megatron_position_ids(shape, ids, mask, torch.tensor(grids))
    pixels = pixel_values_for(shape, grids)
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        loss = model(ids, pos, None, labels=labels, pixel_values=pixels, image_grid_thw=torch.tensor(grids)).mean()
        loss.backward()
        timings.append(time.perf_counter() - start)
    step = sorted(timings)[1]
    print(f"tiny forward+backward, one {ids.shape[1]}-token sample with an image: {step * 1e3:.0f} ms (median of 3)")
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert step < 1.0
