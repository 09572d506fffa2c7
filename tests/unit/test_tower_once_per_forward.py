"""Under Megatron-FSDP the vision tower runs once per forward on every rank (``tower_once_per_forward``,
models/base.py): its layers' weights are gathered in collectives each data-parallel rank must join in
the same order, whatever its batch holds. Images and videos then go through one call, with the same
features as two; a batch with neither encodes a stand-in frame that leaves the output as it was and
gives every tower weight a zero gradient."""

import pytest
import torch
from hf_reference import image_tokens, megatron_position_ids, pixel_values_for

from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.models.qwen35_vl.factory import build_model
from examples.multimodal_dev.models.qwen35_vl.mrope import padded_batch_position_ids


@pytest.fixture(scope="module")
def model(mcore):
    shape = get_variant("tiny")
    torch.manual_seed(0)
    return shape, build_model(shape).eval()


def _calls(model, *args, **kwargs):
    """(output, how many times the tower ran)"""
    count = []
    hook = model.vision_model.register_forward_pre_hook(lambda *_: count.append(1))
    try:
        return model(*args, **kwargs), len(count)
    finally:
        hook.remove()


def _image_and_video_batch(shape):
    merge = shape.vision.spatial_merge_size
    video = [shape.vision_start_token_id] + [shape.video_token_id] * (4 * 4 // merge**2) + [shape.vision_end_token_id]
    ids = torch.tensor([[5, 6, *image_tokens(shape, 4, 6), 7, *video, 8, 9]])
    g = torch.Generator().manual_seed(1)
    media = dict(
        pixel_values=pixel_values_for(shape, [(1, 4, 6)], g),
        image_grid_thw=torch.tensor([[1, 4, 6]]),
        pixel_values_videos=pixel_values_for(shape, [(1, 4, 4)], g),
        video_grid_thw=torch.tensor([[1, 4, 4]]),
    )
    positions = padded_batch_position_ids(
        ids,
        torch.ones_like(ids),
        media["image_grid_thw"],
        media["video_grid_thw"],
        shape.image_token_id,
        shape.video_token_id,
        merge,
    )
    return ids, positions, media


def test_images_and_videos_in_one_call_give_the_features_of_two(model):
    shape, mg = model
    ids, positions, media = _image_and_video_batch(shape)
    with torch.no_grad():
        apart, apart_calls = _calls(mg, ids, positions, None, **media)
        mg.tower_once_per_forward = True
        try:
            together, together_calls = _calls(mg, ids, positions, None, **media)
        finally:
            mg.tower_once_per_forward = False
    assert (apart_calls, together_calls) == (2, 1)
    diff, scale = (together - apart).abs().max().item(), apart.abs().max().item()
    assert diff <= 1e-5 * scale, (diff, scale)


@pytest.mark.parametrize("grad", [False, True], ids=["evaluation", "training"])
def test_a_batch_without_media_runs_the_tower_once_and_changes_nothing(model, grad):
    shape, mg = model
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    positions = megatron_position_ids(shape, ids, torch.ones_like(ids), None)
    mg.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        plain, plain_calls = _calls(mg, ids, positions, None)
        mg.tower_once_per_forward = True
        try:
            once, once_calls = _calls(mg, ids, positions, None)
        finally:
            mg.tower_once_per_forward = False
    assert (plain_calls, once_calls) == (0, 1)
    assert torch.equal(once, plain)
    if grad:
        once.sum().backward()
        grads = [p.grad for p in mg.vision_model.parameters()]
        assert all(g is not None and not g.any() for g in grads)
