"""The vision tower's work split over CP ranks: items dealt by FLOPs, and the gathered features of
every rank equal to one tower encoding everything, in the batch's order (two ranks simulated in
one process: the all-gather is replaced by the concatenation of both ranks' blocks). The numbers
through megatron.training (CP=2, CP=4, TP=2 x CP=2 against one process) are test_parallelism.py's."""

import pytest
import torch

from examples.multimodal_dev.models.qwen35_vl.flops import vision_flops
from examples.multimodal_dev.models.common import vision_context_parallel as vcp
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant, vision_transformer_config
from examples.multimodal_dev.models.qwen35_vl.vision_encoder import Qwen35VisionModel

SHAPE = get_variant("tiny", moe=False, mtp=False)


def test_deal_balances_by_cost_and_keeps_order():
    assert vcp.deal([5.0, 1.0, 4.0, 2.0, 2.0], 2) == [[0, 4], [1, 2, 3]]  # loads 7 and 7
    assert vcp.deal([1.0, 1.0, 1.0], 3) == [[0], [1], [2]]
    assert all(items for items in vcp.deal([9.0, 1.0, 1.0, 1.0], 4))  # every rank gets one


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("cp", [2, 3])
def test_each_item_encoded_once_and_gathered_in_order(mcore, monkeypatch, cp):
    torch.manual_seed(0)
    tower = Qwen35VisionModel(vision_transformer_config(SHAPE.vision), SHAPE.vision).eval()
    grids = torch.tensor([[1, 4, 6], [2, 8, 8], [1, 12, 10], [1, 4, 4], [3, 6, 4]])  # images and videos
    pixels = torch.randn(int(grids.prod(-1).sum()), SHAPE.vision.patch_dim)
    with torch.no_grad():
        whole = tower(pixels, grids)
    blocks, encoded = {}, []

    def gather(t, tensor_parallel_output_grad, group):
        assert tensor_parallel_output_grad  # backward: the feature grads of every rank summed on the owner
        blocks[group.rank()] = t
        if len(blocks) < cp:
            return torch.zeros(cp * t.shape[0], t.shape[1])  # ranks before the last: not checked
        return torch.cat([blocks[r] for r in range(cp)])

    monkeypatch.setattr(vcp, "gather_from_sequence_parallel_region", gather)
    real_forward = tower.forward
    monkeypatch.setattr(tower, "forward", lambda p, g: encoded.append(g.tolist()) or real_forward(p, g))
    for rank in reversed(range(cp)):  # rank 0 last: it sees every block
        with torch.no_grad():
            out = vcp.encode(tower, pixels, grids, _Group(cp, rank))
    owned = vcp.deal([vision_flops(SHAPE.vision, SHAPE.vision.out_hidden_size, [g]) for g in grids.tolist()], cp)
    assert sorted(g for gs in encoded for g in gs) == sorted(grids.tolist())  # each item encoded once
    assert encoded[-1] == grids[owned[0]].tolist()
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
    # fewer items than ranks: every rank encodes everything, no gather
    with torch.no_grad():
        torch.testing.assert_close(vcp.encode(tower, pixels[:24], grids[:1], _Group(cp, 0)), whole[:6])
