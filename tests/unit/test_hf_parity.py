"""The Megatron Qwen3.5-VL model against Hugging Face ``transformers`` on the same weights (fp32).

Tolerance: max |logit diff| <= 2e-5 * max |reference logit|. Both sides are fp32 but sum in
different orders (fused in_proj/qkv GEMMs, chunked vs reference GDN kernels, SDPA per packed
segment), so bitwise equality is not expected; measured ~1.3e-6 abs at logit scale ~2.
"""

import pytest
import torch
from hf_reference import build_hf_model, hf_forward, image_tokens, megatron_position_ids, pixel_values_for
from megatron.core.packed_seq_params import PackedSeqParams

from models.qwen35_vl.configuration import get_variant
from models.qwen35_vl.factory import build_model
from models.qwen35_vl.hf_mapping import MappingError, load_hf_into_model
from models.qwen35_vl.mrope import sample_position_ids

REL_TOL = 2e-5


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request, mcore):
    shape = get_variant("tiny", moe=request.param == "moe", mtp=False)
    hf = build_hf_model(shape)
    mg = build_model(shape).eval()
    load_hf_into_model(mg, hf.state_dict(), shape)
    return request.param, shape, hf, mg


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
    kind, shape, hf, mg = pair
    ids, mask = _batch([[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24]])
    ref = hf_forward(hf, shape, ids, mask)
    with torch.no_grad():
        ours = mg(ids, megatron_position_ids(shape, ids, mask, None), None)
    _assert_close(f"{kind} text-only", ours[mask.bool()], ref[mask.bool()])


def test_two_nonsquare_images_batch_of_two(pair):
    kind, shape, hf, mg = pair
    grids = [(1, 4, 6), (1, 6, 4), (1, 2, 8)]
    ids, mask = _batch([
        [5, 6] + image_tokens(shape, 4, 6) + [7, 8, 9] + image_tokens(shape, 6, 4) + [10, 11],
        [12] + image_tokens(shape, 2, 8) + [13, 14, 15],
    ])
    pixels = pixel_values_for(shape, grids, torch.Generator().manual_seed(1))
    grid_thw = torch.tensor(grids)
    ref = hf_forward(hf, shape, ids, mask, pixels, grid_thw)
    with torch.no_grad():
        ours = mg(ids, megatron_position_ids(shape, ids, mask, grid_thw), None,
                  pixel_values=pixels, image_grid_thw=grid_thw)
    _assert_close(f"{kind} image+text", ours[mask.bool()], ref[mask.bool()])


def test_thd_packed_equals_each_sample_alone(pair):
    """Three samples of different lengths (two with images) in one [1, T] row, each padded to
    a multiple of 4 as the collate does for CP=2, against HF run on each sample alone."""
    kind, shape, hf, mg = pair
    samples = [
        ([5, 6] + image_tokens(shape, 4, 6) + [7, 8, 9], [(1, 4, 6)]),
        ([10, 11, 12, 13, 14, 15, 16], []),
        ([17] + image_tokens(shape, 6, 4) + [18, 19, 20, 21], [(1, 6, 4)]),
    ]
    gen = torch.Generator().manual_seed(2)
    pixels = [pixel_values_for(shape, g, gen) if g else None for _, g in samples]
    vision_ids = (shape.image_token_id, shape.video_token_id)
    tokens, positions, real, cu, cu_padded = [], [], [], [0], [0]
    for (row, grids), _ in zip(samples, pixels):
        ids = torch.tensor(row)
        pos = sample_position_ids(ids, torch.tensor(grids, dtype=torch.long).reshape(-1, 3), vision_ids,
                                  shape.vision.spatial_merge_size)
        pad = (-len(row)) % 4
        tokens.append(torch.cat([ids, torch.zeros(pad, dtype=torch.long)]))
        positions.append(torch.cat([pos, torch.zeros(3, pad, dtype=torch.long)], dim=1))
        real.append(torch.cat([torch.ones(len(row)), torch.zeros(pad)]).bool())
        cu.append(cu[-1] + len(row))
        cu_padded.append(cu_padded[-1] + len(row) + pad)
    tokens_1T = torch.cat(tokens)[None]
    position_ids_31T = torch.cat(positions, dim=1)[:, None]
    cu_t, cu_padded_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(cu_padded, dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
                             cu_seqlens_q_padded=cu_padded_t, cu_seqlens_kv_padded=cu_padded_t,
                             max_seqlen_q=int((cu_padded_t[1:] - cu_padded_t[:-1]).max()),
                             max_seqlen_kv=int((cu_padded_t[1:] - cu_padded_t[:-1]).max()))
    all_grids = torch.tensor([g for _, gs in samples for g in gs])
    with torch.no_grad():
        ours = mg(tokens_1T, position_ids_31T, None, pixel_values=torch.cat([p for p in pixels if p is not None]),
                  image_grid_thw=all_grids, packed_seq_params=packed)[0]
    ours_real = ours[torch.cat(real)]
    offset = 0
    for (row, grids), pix in zip(samples, pixels):
        ids = torch.tensor([row])
        ref = hf_forward(hf, shape, ids, torch.ones_like(ids), pix, torch.tensor(grids) if grids else None)[0]
        _assert_close(f"{kind} THD sample of {len(row)} tokens", ours_real[offset: offset + len(row)], ref)
        offset += len(row)


def test_vision_tower_equals_hf(pair):
    kind, shape, hf, mg = pair
    grids = torch.tensor([[1, 4, 6], [2, 6, 4]])  # an image and a two-frame video clip
    pixels = pixel_values_for(shape, grids.tolist(), torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=grids).pooler_output
        ours = mg.vision_model(pixels, grids)
    _assert_close(f"{kind} vision tower", ours, ref)


def test_placeholder_count_mismatch_is_a_clear_error(pair):
    _, shape, _, mg = pair
    ids, mask = _batch([[5] + image_tokens(shape, 4, 6)[:-3] + [6]])
    grids = torch.tensor([[1, 4, 6]])
    pixels = pixel_values_for(shape, grids.tolist())
    with pytest.raises(ValueError, match="placeholder tokens"), torch.no_grad():
        mg.embed(ids, pixels, grids)


def test_mtp_tensors_are_reported_not_dropped(mcore):
    """Checkpoints carry mtp.* tensors; until the MTP head exists they are named, not lost."""
    shape = get_variant("tiny", moe=True, mtp=False)
    hf = build_hf_model(shape)
    state = dict(hf.state_dict())
    state["mtp.fc.weight"] = torch.zeros(4, 4)
    state["mtp.layers.0.mlp.gate.weight"] = torch.zeros(4, 4)
    mg = build_model(shape)
    with pytest.raises(MappingError, match=r"mtp\.fc\.weight"):
        load_hf_into_model(mg, state, shape)
    load_hf_into_model(mg, state, shape, strict=False)  # explicit opt-out loads the rest
