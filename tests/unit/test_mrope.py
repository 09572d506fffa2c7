"""MRoPE position indices and interleaved rotary angles against transformers (exact / 1e-6)."""

import torch
from transformers import Qwen3_5Config
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model, Qwen3_5TextRotaryEmbedding

from examples.multimodal_dev.models.qwen35_vl.mrope import InterleavedMRoPE, padded_batch_position_ids

IMG, VID, START, END = 250, 251, 252, 253


def _hf_config(**text):
    text = dict(
        dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=300,
            intermediate_size=32,
            linear_num_key_heads=1,
            linear_num_value_heads=1,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        ),
        **text,
    )
    return Qwen3_5Config(
        text_config=text,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=1, out_hidden_size=32),
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )


def _hf_rope_index(input_ids, attention_mask, image_grid_thw, video_grid_thw):
    model = Qwen3_5Model.__new__(Qwen3_5Model)  # get_rope_index needs only the config
    torch.nn.Module.__init__(model)
    model.config = _hf_config()
    types = torch.zeros_like(input_ids)
    types[input_ids == IMG], types[input_ids == VID] = 1, 2
    return model.get_rope_index(
        input_ids,
        mm_token_type_ids=types,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        attention_mask=attention_mask,
    )[0]


def _run(token, n):
    return [START] + [token] * n + [END]


def test_position_ids_match_hf_images_video_and_padding():
    # sample 0: image (4x6 patches -> 6 tokens), text, a 2-frame video (4x4 -> 4 tokens/frame);
    # sample 1 (left-padded): two images of different shapes.
    s0 = [1, 2, 3] + _run(IMG, 6) + [4, 5, 7] + _run(VID, 4) + [8] + _run(VID, 4) + [9]
    s1 = [1] + _run(IMG, 12) + [2, 3] + _run(IMG, 6) + [4]
    length = max(len(s0), len(s1))
    ids = torch.zeros(2, length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0, : len(s0)], mask[0, : len(s0)] = torch.tensor(s0), 1
    ids[1, length - len(s1) :], mask[1, length - len(s1) :] = torch.tensor(s1), 1
    image_grids, video_grids = torch.tensor([[1, 4, 6], [1, 6, 8], [1, 4, 6]]), torch.tensor([[2, 4, 4]])
    ref = _hf_rope_index(ids, mask, image_grids, video_grids)
    ours = padded_batch_position_ids(ids, mask, image_grids, video_grids, IMG, VID, spatial_merge=2)
    assert torch.equal(ours[:, mask.bool()], ref[:, mask.bool()])
    # text after an image resumes at (image start + max(h, w)/2)
    assert ours[0, 0, 3 + 1 + 6 + 1].item() == 3 + 1 + 3 + 1


def test_interleaved_rotary_matches_hf_cos_sin():
    config = _hf_config()  # head_dim 256, partial 0.25, sections [11, 11, 10], theta 1e7 defaults
    hf_rope = Qwen3_5TextRotaryEmbedding(config.text_config)
    rope = config.text_config.rope_parameters
    ours = InterleavedMRoPE(256, rope["partial_rotary_factor"], rope["rope_theta"], [11, 11, 10])
    positions = torch.randint(0, 5000, (3, 2, 17))
    cos_ref, sin_ref = hf_rope(torch.zeros(1, dtype=torch.float32), positions)
    angles = ours(positions)  # [S, B, 1, 64]
    cos, sin = angles.cos()[:, :, 0].transpose(0, 1), angles.sin()[:, :, 0].transpose(0, 1)
    diff = max((cos - cos_ref).abs().max().item(), (sin - sin_ref).abs().max().item())
    print(f"rotary cos/sin vs HF: max abs diff {diff:.2e}")
    assert diff < 1e-6
    # the three axes really are used: changing only the h positions changes some channels
    moved = positions.clone()
    moved[1] += 7
    assert not torch.allclose(ours(moved), angles)


def test_sections_beyond_the_rotary_dim_follow_transformers():
    """transformers' own Qwen3.5-MoE tester config: mrope_section [16, 8, 8] with a rotary dim of 2
    (head_dim 8, partial 0.25). transformers accepts it (sections past the rotary channels are
    clipped); it used to be refused here for not summing to rotary_dim / 2."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    for section, head_dim, partial in (([16, 8, 8], 8, 0.25), ([1, 1, 1], 16, 1.0), ([11, 11, 10], 256, 0.25)):
        config = Qwen3_5MoeTextConfig(
            hidden_size=16,
            num_attention_heads=2,
            head_dim=head_dim,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=1e4,
                partial_rotary_factor=partial,
                mrope_section=section,
                mrope_interleaved=True,
            ),
        )
        cos_ref, sin_ref = Qwen3_5MoeTextRotaryEmbedding(config)(
            torch.zeros(1), positions := torch.randint(0, 500, (3, 2, 9))
        )
        angles = InterleavedMRoPE(head_dim, partial, 1e4, section)(positions)
        cos, sin = angles.cos()[:, :, 0].transpose(0, 1), angles.sin()[:, :, 0].transpose(0, 1)
        assert cos.shape == cos_ref.shape, (section, cos.shape, cos_ref.shape)
        assert (cos - cos_ref).abs().max() < 1e-6 and (sin - sin_ref).abs().max() < 1e-6, section


def test_fewer_grids_than_placeholder_runs_is_a_clear_error():
    """Two image runs in the batch, one grid: a ValueError counting both (was a raw shape mismatch)."""
    import pytest

    ids = torch.tensor([[1] + _run(IMG, 6) + [2] + _run(IMG, 6) + [3]])
    with pytest.raises(
        ValueError,
        match=r"images: rows 0..0 of the batch have 2 placeholder runs but "
        r"image_grid_thw lists 1",
    ):
        padded_batch_position_ids(ids, torch.ones_like(ids), torch.tensor([[1, 4, 6]]), None, IMG, VID, spatial_merge=2)
