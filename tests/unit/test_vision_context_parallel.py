"""The vision tower's work split over CP ranks: images and video frames dealt by FLOPs, the busiest
rank within 5% of an even share on a long video and on packed rows of the mock video data, and the gathered features of
every rank equal to one tower encoding everything, in the batch's order (two ranks simulated in
one process: the all-gather is replaced by the concatenation of both ranks' blocks). The numbers
through megatron.training (CP=2, CP=4, TP=2 x CP=2 against one process) are test_parallelism.py's."""

import pytest
import torch

from examples.multimodal_dev.models.common import vision_context_parallel as vcp
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant, vision_transformer_config
from examples.multimodal_dev.models.qwen35_vl.flops import vision_flops
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
    frames = vcp.frames_of(grids)  # the videos' temporal patches are dealt one by one
    owned = vcp.deal([vision_flops(SHAPE.vision, SHAPE.vision.out_hidden_size, [g]) for g in frames.tolist()], cp)
    assert sorted(g for gs in encoded for g in gs) == sorted(frames.tolist())  # each frame encoded once
    assert encoded[-1] == frames[owned[0]].tolist()
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
    # fewer items than ranks: every rank encodes everything, no gather
    with torch.no_grad():
        torch.testing.assert_close(vcp.encode(tower, pixels[:24], grids[:1], _Group(cp, 0)), whole[:6])


@pytest.mark.parametrize(
    "shares,videos", [(2, True), (3, False)], ids=["2 shares, images and videos", "3 shares of 2 images: one idle"]
)
def test_fan_in_shares_join_into_the_batch_order(mcore, shares, videos):
    """Vision replicas each encode a share of a micro-batch (``VisionStage``, fan-in); the bridge joins
    their outputs in replica order; the language side (``ReceivedFeatures.in_batch_order``, which sees
    only the grids) must recover one tower's features of every item, images then videos."""
    import functools
    from types import SimpleNamespace

    from examples.multimodal_dev.models.qwen35_vl.model import Qwen35VLModel
    from examples.multimodal_dev.vision_ranks.stage import ReceivedFeatures, VisionStage

    torch.manual_seed(0)
    config = vision_transformer_config(SHAPE.vision)
    tower = Qwen35VisionModel(config, SHAPE.vision).eval()
    image_grids = torch.tensor([[1, 4, 6], [1, 12, 10]])
    video_grids = torch.tensor([[2, 8, 8], [3, 6, 4]]) if videos else None
    images = torch.randn(int(image_grids.prod(-1).sum()), SHAPE.vision.patch_dim)
    clips = torch.randn(int(video_grids.prod(-1).sum()), SHAPE.vision.patch_dim) if videos else None
    stage = VisionStage(tower, groups=None, shares=shares)
    with torch.no_grad():
        expected = torch.cat([tower(images, image_grids)] + ([tower(clips, video_grids)] if videos else []))
        sent = []
        for share in range(shares):
            stage.share = share
            sent.append(stage(images, image_grids, clips, video_grids))
    assert len({s.shape[0] for s in sent}) == 1  # equal widths: the bridge splits the gradient back evenly
    item_flops = functools.partial(Qwen35VLModel.vision_item_flops, SimpleNamespace(shape=SHAPE))  # the LM's own
    language = ReceivedFeatures(item_flops, SHAPE.vision.spatial_merge_size, shares=shares)
    joined = torch.cat(sent)
    torch.testing.assert_close(
        language.in_batch_order(joined, (image_grids, video_grids)),
        expected,
        rtol=1e-5,
        atol=1e-6,
    )
    with pytest.raises(ValueError, match=f"sent {joined.shape[0] - 1} feature rows; {shares} shares of"):
        language.in_batch_order(joined[1:], (image_grids, video_grids))


def _busiest_share(grids: torch.Tensor, cp: int) -> float:
    """The busiest CP rank's fraction of the tower's FLOPs under the deal ``encode`` makes."""
    costs = [vision_flops(SHAPE.vision, SHAPE.vision.out_hidden_size, [g]) for g in vcp.frames_of(grids).tolist()]
    return max(sum(costs[i] for i in items) for items in vcp.deal(costs, cp)) / sum(costs)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_busiest_rank_is_within_five_percent_of_an_even_share(cp):
    """One 256-frame video, and rows of the mock video dataset packed as the token-budget packer fills a
    4096-token row (images and videos of several conversations)."""
    from examples.multimodal_dev.data.mock_video import build_datasets
    from examples.multimodal_dev.data.sample import VisionTokens

    long_video = torch.tensor([[256, 12, 16]])
    train = build_datasets(
        tokens=VisionTokens.from_shape(SHAPE),
        vocab_size=SHAPE.text.vocab_size,
        patch_dim=SHAPE.vision.patch_dim,
        seq_length=1024,
        num_samples=(64, 0, 0),
        seed=1234,
    )[0]
    rows, row, held = [], [], 0
    for i in range(64):
        sample = train[i]
        grids = [g for key in ("image_grid_thw", "video_grid_thw") for g in sample[key].tolist()]
        if held + len(sample["input_ids"]) > 4096 and row:
            rows.append(torch.tensor(row))
            row, held = [], 0
        row, held = row + grids, held + len(sample["input_ids"])
    shares = [_busiest_share(g, cp) for g in [long_video, *rows] if len(g)]
    print(f"CP={cp}: long video {shares[0]:.4f}, mock_video rows worst {max(shares[1:]):.4f} (even {1 / cp:.4f})")
    assert max(shares) <= 1 / cp + 0.05
