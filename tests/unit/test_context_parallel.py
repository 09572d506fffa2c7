"""The context-parallel split is megatron-core's layout, exactly once per token.

- THD: concatenating every rank's positions (rank-major, as an all-gather lays them out) and
  applying megatron-core's own THD permutation (GatedDeltaNet's CP path) gives 0..T-1;
- BSHD: megatron-core's ``_undo_attention_load_balancing`` of the same gives 0..S-1;
- ``place`` inverts ``take``; lengths that do not split into 2*cp chunks are refused;
- ``pad_row_to`` adds a segment with no real tokens that is padding everywhere.
"""

import pytest
import torch

from examples.multimodal_dev.data.batch import PackedBatch
from examples.multimodal_dev.data.collate import pad_row_to
from examples.multimodal_dev.models.common.context_parallel import ContextParallelSplit


@pytest.mark.parametrize("cp", [2, 4])
def test_thd_split_is_megatron_cores_layout(cp):
    from megatron.core.ssm.gated_delta_net.common import _build_thd_cp_a2a_perm

    cu = torch.tensor([0, 8 * cp, 14 * cp, 24 * cp], dtype=torch.int32)
    total = int(cu[-1])
    gathered = torch.cat([ContextParallelSplit(total, cp, r, cu).positions for r in range(cp)])
    to_global, _ = _build_thd_cp_a2a_perm(cu, cp, total)
    assert torch.equal(gathered[to_global], torch.arange(total))


def test_bshd_split_is_megatron_cores_layout():
    from megatron.core.ssm.mamba_context_parallel import _undo_attention_load_balancing

    gathered = torch.cat([ContextParallelSplit(36, 3, r).positions for r in range(3)])
    assert torch.equal(_undo_attention_load_balancing(gathered, 3), torch.arange(36))


def test_take_and_place_are_inverse_and_bad_lengths_are_refused():
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    split = ContextParallelSplit(20, 2, 1, cu)
    x = torch.randn(3, 1, 20)
    local = split.take(x, -1)
    assert local.shape == (3, 1, 10) and torch.equal(split.take(split.place(local, -1), -1), local)
    with pytest.raises(ValueError, match="already split"):
        split.take(local, -1)
    with pytest.raises(ValueError, match="multiples of 2\\*cp=4"):
        ContextParallelSplit(18, 2, 0, torch.tensor([0, 6, 18]))


def test_pad_row_to_adds_a_padding_segment():
    batch = PackedBatch(
        tokens=torch.ones(1, 8, dtype=torch.long),
        labels=torch.ones(1, 8, dtype=torch.long),
        loss_mask=torch.ones(1, 8),
        padding_mask=torch.zeros(1, 8, dtype=torch.bool),
        position_ids=torch.ones(3, 1, 8, dtype=torch.long),
        max_seqlen=4,
        cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32),
        cu_seqlens_padded=torch.tensor([0, 4, 8], dtype=torch.int32),
    )
    out = pad_row_to(batch, 12)
    assert out.cu_seqlens.tolist() == [0, 3, 7, 7] and out.cu_seqlens_padded.tolist() == [0, 4, 8, 12]
    assert out.padding_mask[0, 8:].all() and not out.padding_mask[0, :8].any()
    assert out.loss_mask[0, 8:].sum() == 0 and out.labels[0, 8:].eq(-100).all()
    assert out.position_ids.shape == (3, 1, 12)


def test_a_padded_row_keeps_what_the_host_reads_without_a_sync():
    """Rows padded for the expert dispatch (``pad_row_to``) keep the host copies the batch was moved to
    the device with: the layers read their segments from them, where a padded batch without them read
    every one back from the device (a sync each, every layer, on a GPU)."""
    from examples.multimodal_dev.models.common.batch_memo import on_host, to_device

    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    batch = PackedBatch(
        tokens=to_device(torch.arange(8).view(1, 8), "cpu"),
        labels=torch.ones(1, 8, dtype=torch.long),
        loss_mask=torch.ones(1, 8),
        padding_mask=torch.zeros(1, 8, dtype=torch.bool),
        position_ids=torch.ones(3, 1, 8, dtype=torch.long),
        max_seqlen=4,
        cu_seqlens=to_device(cu, "cpu"),
        cu_seqlens_padded=to_device(torch.tensor([0, 4, 8], dtype=torch.int32), "cpu"),
    )
    out = pad_row_to(batch, 12)
    for name in ("tokens", "cu_seqlens", "cu_seqlens_padded"):
        padded = getattr(out, name)
        host = padded.__dict__.get("_host_copy")
        assert host is not None and host is not padded and torch.equal(on_host(padded), padded), name
