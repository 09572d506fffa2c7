"""The Megatron Qwen3.5-VL model against Hugging Face ``transformers`` on the same weights (fp32).

Tolerance: max |logit diff| <= 2e-5 * max |reference logit|. Both sides are fp32 but sum in
different orders (fused in_proj/qkv GEMMs, chunked vs reference GDN kernels, SDPA per packed
segment), so bitwise equality is not expected; measured ~1.3e-6 abs at logit scale ~2.
"""

import pytest
import torch
from hf_reference import (
    HFMtpHead,
    build_hf_model,
    hf_forward,
    image_tokens,
    megatron_position_ids,
    packed_row,
    pixel_values_for,
)

from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.models.qwen35_vl.factory import build_model
from examples.multimodal_dev.models.qwen35_vl.hf_mapping import MappingError, load_hf_into_model

REL_TOL = 2e-5


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request, mcore):
    shape = get_variant("tiny", moe=request.param == "moe", mtp=True)
    hf = build_hf_model(shape)
    mtp = HFMtpHead(hf)
    mg = build_model(shape).eval()
    load_hf_into_model(mg, {**hf.state_dict(), **mtp.checkpoint_state()}, shape)  # strict: every tensor lands
    return request.param, shape, hf, mg, mtp


def _assert_close(name, ours, ref):
    diff = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    print(f"{name}: max abs diff {diff:.3e} (reference max {scale:.3f})")
    assert diff <= REL_TOL * max(scale, 1.0), f"{name}: {diff} > {REL_TOL} * {scale}"


def _batch(rows):
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = 1
    return ids, mask


def test_text_only_batch(pair):
    kind, shape, hf, mg, _ = pair
    ids, mask = _batch([[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24]])
    ref = hf_forward(hf, shape, ids, mask)
    with torch.no_grad():
        ours = mg(ids, megatron_position_ids(shape, ids, mask, None), None)
    _assert_close(f"{kind} text-only", ours[mask.bool()], ref[mask.bool()])


def test_two_nonsquare_images_batch_of_two(pair):
    kind, shape, hf, mg, _ = pair
    grids = [(1, 4, 6), (1, 6, 4), (1, 2, 8)]
    ids, mask = _batch(
        [
            [5, 6] + image_tokens(shape, 4, 6) + [7, 8, 9] + image_tokens(shape, 6, 4) + [10, 11],
            [12] + image_tokens(shape, 2, 8) + [13, 14, 15],
        ]
    )
    pixels = pixel_values_for(shape, grids, torch.Generator().manual_seed(1))
    grid_thw = torch.tensor(grids)
    ref = hf_forward(hf, shape, ids, mask, pixels, grid_thw)
    with torch.no_grad():
        ours = mg(
            ids, megatron_position_ids(shape, ids, mask, grid_thw), None, pixel_values=pixels, image_grid_thw=grid_thw
        )
    _assert_close(f"{kind} image+text", ours[mask.bool()], ref[mask.bool()])


def _three_samples(shape, second_image_hw, seed):
    """Samples of 13, 7 and 5 + image tokens (the first and last with an image), their pixels
    and the packed row (each sample padded to a multiple of 4, as the collate does for CP=2)."""
    h, w = second_image_hw
    samples = [
        ([5, 6] + image_tokens(shape, 4, 6) + [7, 8, 9], [(1, 4, 6)]),
        ([10, 11, 12, 13, 14, 15, 16], []),
        ([17] + image_tokens(shape, h, w) + [18, 19, 20, 21], [(1, h, w)]),
    ]
    gen = torch.Generator().manual_seed(seed)
    pixels = [pixel_values_for(shape, g, gen) if g else None for _, g in samples]
    return samples, pixels, packed_row(shape, samples)


def test_thd_packed_equals_each_sample_alone(pair):
    """Three samples of different lengths (two with images) in one [1, T] row, each padded to
    a multiple of 4 as the collate does for CP=2, against HF run on each sample alone."""
    kind, shape, hf, mg, _ = pair
    samples, pixels, (tokens_1T, position_ids_31T, packed, real) = _three_samples(shape, (6, 4), seed=2)
    all_grids = torch.tensor([g for _, gs in samples for g in gs])
    with torch.no_grad():
        ours = mg(
            tokens_1T,
            position_ids_31T,
            None,
            pixel_values=torch.cat([p for p in pixels if p is not None]),
            image_grid_thw=all_grids,
            packed_seq_params=packed,
        )[0]
    ours_real = ours[real]
    offset = 0
    for (row, grids), pix in zip(samples, pixels):
        ids = torch.tensor([row])
        ref = hf_forward(hf, shape, ids, torch.ones_like(ids), pix, torch.tensor(grids) if grids else None)[0]
        _assert_close(f"{kind} THD sample of {len(row)} tokens", ours_real[offset : offset + len(row)], ref)
        offset += len(row)


def test_vision_tower_equals_hf(pair):
    kind, shape, hf, mg, _ = pair
    grids = torch.tensor([[1, 4, 6], [2, 6, 4]])  # an image and a two-frame video clip
    pixels = pixel_values_for(shape, grids.tolist(), torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=grids).pooler_output
        ours = mg.vision_model(pixels, grids)
    _assert_close(f"{kind} vision tower", ours, ref)


def test_padding_masks_the_deltanet_cannot_honour_are_refused(pair):
    """A left-padded batch with an attention mask gave logits off by ~0.2 vs transformers (the
    Gated DeltaNet state ran through the padding); it is refused with the reason instead."""
    _, shape, _, mg, _ = pair
    ids, mask = _batch([[5, 6, 7, 8, 9], [20, 21, 22]])
    ids, mask = ids.flip(1), mask.flip(1)  # left padding
    with pytest.raises(ValueError, match="attention_mask: the Gated DeltaNet layers cannot honour a padding mask"):
        with torch.no_grad():
            mg(ids, megatron_position_ids(shape, ids, mask, None), mask[:, None, None, :] == 0)


def test_placeholder_count_mismatch_is_a_clear_error(pair):
    _, shape, _, mg, _ = pair
    ids, mask = _batch([[5] + image_tokens(shape, 4, 6)[:-3] + [6]])
    grids = torch.tensor([[1, 4, 6]])
    pixels = pixel_values_for(shape, grids.tolist())
    with pytest.raises(ValueError, match="placeholder tokens"), torch.no_grad():
        mg.embed(ids, pixels, grids)


def test_mtp_head_equals_reference_per_packed_sample(pair):
    """The MTP head's logits on a THD row of three samples (two with images) equal the reference
    head run on each sample alone: the next-token roll restarts at every sample boundary."""
    kind, shape, hf, mg, mtp = pair
    samples, pixels, (tokens_1T, position_ids_31T, packed, real) = _three_samples(shape, (2, 4), seed=4)
    captured = []
    hook = mg.language_model.mtp.register_forward_hook(lambda mod, args, out: captured.append(out))
    try:
        with torch.no_grad():
            mg(
                tokens_1T,
                position_ids_31T,
                None,
                pixel_values=torch.cat([p for p in pixels if p is not None]),
                image_grid_thw=torch.tensor([g for _, gs in samples for g in gs]),
                packed_seq_params=packed,
            )
    finally:
        hook.remove()
    main_and_mtp = torch.chunk(captured[0], 1 + shape.text.mtp_num_layers, dim=0)
    with torch.no_grad():
        ours = mg.language_model.output_layer(main_and_mtp[1])[0][:, 0][real]  # [T_real, V]
    offset = 0
    for (row, grids), pix in zip(samples, pixels):
        ref = mtp.logits(hf, shape, torch.tensor([row]), pix, torch.tensor(grids) if grids else None)[0]
        _assert_close(f"{kind} MTP sample of {len(row)} tokens", ours[offset : offset + len(row)], ref)
        offset += len(row)


def test_checkpoint_mtp_tensors_are_named_when_the_model_has_no_mtp_head(mcore):
    """A model built without MTP refuses a checkpoint carrying mtp.* unless told to skip them."""
    shape = get_variant("tiny", moe=True, mtp=False)
    hf = build_hf_model(shape)
    state = {**hf.state_dict(), **HFMtpHead(hf).checkpoint_state()}
    mg = build_model(shape)
    with pytest.raises(MappingError, match=r"mtp\.fc\.weight"):
        load_hf_into_model(mg, state, shape)
    load_hf_into_model(mg, state, shape, strict=False)  # explicit opt-out loads the rest
