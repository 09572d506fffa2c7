"""The one-pass THD rotary (models/common/rope_thd.py) against megatron-core's per-sequence
original: the same tensor, with freqs per sequence or per token of the packed row, with and without
context parallelism (every rank's zigzag chunks), interleaved or not."""

import types

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from examples.multimodal_dev.models.common.rope_thd import rotary_thd


def _group(size: int, rank: int):
    """What the rotary reads of a context-parallel group."""
    return types.SimpleNamespace(size=lambda: size, rank=lambda: rank)


# megatron-core's own function, whatever the table has put in its place in this process
ORIGINAL = rope_utils.__dict__.get("_apply_rotary_pos_emb_thd")
while hasattr(ORIGINAL, "__wrapped__"):
    ORIGINAL = ORIGINAL.__wrapped__


@pytest.mark.parametrize("packed", [False, True], ids=["freqs per sequence", "freqs per token"])
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("interleaved", [False, True])
def test_one_pass_equals_per_sequence(packed, cp, interleaved):
    torch.manual_seed(0)
    lengths = [8 * cp, 24 * cp, 16 * cp, 8 * cp]  # multiples of 2 * cp, as the collate pads them
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    total, rot = int(cu[-1]), 16
    freqs = torch.randn(total if packed else max(lengths) + 5, 1, 1, rot)
    ours = rotary_thd(ORIGINAL)
    for rank in range(cp):
        t = torch.randn(total // cp, 3, rot + 8)  # 8 channels past the rotary ones pass through
        group = _group(cp, rank)
        want = ORIGINAL(t, cu, freqs, rotary_interleaved=interleaved, cp_group=group)
        got = ours(t, cu, freqs, rotary_interleaved=interleaved, cp_group=group)
        assert torch.equal(got, want), (cp, rank, (got - want).abs().max())
        # the next layer reuses what this micro-batch's segments computed; another table (another
        # tower with the same segments) gets its own rotation
        assert torch.equal(ours(t, cu, freqs, rotary_interleaved=interleaved, cp_group=group), want)
        other = freqs.flip(0).contiguous()
        want_other = ORIGINAL(t, cu, other, rotary_interleaved=interleaved, cp_group=group)
        assert torch.equal(ours(t, cu, other, rotary_interleaved=interleaved, cp_group=group), want_other)


@pytest.mark.parametrize("rot", [16, 24], ids=["rotary on every channel", "partial rotary"])
def test_gradients_equal_megatrons_bit_for_bit_in_fewer_ops(rot):
    """The backward too is megatron's arithmetic (the roll moves the same products), in under half the
    host's ops of megatron's rotation of three sequences (the loss adds the same few to both)."""
    from examples.multimodal_dev.benchmarks.op_counter import StepTally

    cu = torch.tensor([0, 8, 32, 48], dtype=torch.int32)
    freqs, weight = torch.randn(48, 1, 1, 16), torch.randn(48, 3, rot)
    ops, grads = {}, {}
    for name, rotate in (("megatron", ORIGINAL), ("ours", rotary_thd(ORIGINAL))):
        t = torch.randn(48, 3, rot, generator=torch.Generator().manual_seed(2), requires_grad=True)
        rotate(t, cu, freqs, cp_group=_group(1, 0))  # the next call is a later layer's: its table is kept
        tally = StepTally()
        with tally.counting():
            (rotate(t, cu, freqs, cp_group=_group(1, 0)) * weight).sum().backward()
        ops[name], grads[name] = sum(tally.ops.values()), t.grad
    print(f"rotary ops, forward and backward, with the loss's: {ops}")
    assert torch.equal(grads["ours"], grads["megatron"])
    assert ops["ours"] * 2 < ops["megatron"]
