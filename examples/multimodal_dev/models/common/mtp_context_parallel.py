"""megatron-core 0.19.2's per-token MTP loss weighting, made independent of the CP split.

With ``calculate_per_token_loss``, ``process_mtp_loss`` (``multi_token_prediction.py``) weights
each rank's MTP loss by that rank's ratio of loss tokens before and after the one-token roll,
``loss_mask.sum() / rolled_loss_mask.sum()``. Under context parallelism the roll moves tokens
between the zigzag chunks of different ranks, so the two local counts differ even where the
micro-batch's do not: the MTP gradient then depends on the split (tiny MoE + MTP, first-step grad
norm vs one process: 1.3e-4 relative at CP=2, 2.7e-4 at CP=4; without the MTP head, bitwise
equal).

A row of ``megatron_changes`` (``mtp-under-cp``, applied when a model has an MTP head) wraps the
module's ``roll_tensor`` so that, for a loss mask rolled under CP, the
count it returns makes each rank's ratio the CP group's ratio:
``local_before / returned == group_before / group_after``. Only the count changes, never the
rolled tensor. The ratio is exact for the first MTP layer, whose input mask is the unrolled one;
Qwen3.5 has one MTP layer, and the model refuses more under CP.
"""

from __future__ import annotations

import functools

import torch


def group_consistent_count(roll_tensor, run=None):
    """``roll_tensor`` with the count of a rolled float mask made consistent over the CP group
    (megatron_changes row, group mtp-under-cp)."""

    @functools.wraps(roll_tensor)
    def roll(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
        rolled, rolled_sum = roll_tensor(
            tensor, shifts=shifts, dims=dims, cp_group=cp_group, packed_seq_params=packed_seq_params
        )
        # Loss masks are float and carry no gradient; ids, positions and padding masks are integer
        # or bool and their counts are unused.
        if (
            cp_group is None
            or cp_group.size() == 1
            or tensor is None
            or not tensor.is_floating_point()
            or tensor.requires_grad
        ):
            return rolled, rolled_sum
        local = torch.stack([tensor.detach().sum(), rolled_sum.detach()]).to(torch.float64)
        group = local.clone()
        torch.distributed.all_reduce(group, group=cp_group)
        count = local[0] * group[1] / group[0].clamp(min=1.0)
        return rolled, count.to(rolled_sum.dtype)

    return roll
