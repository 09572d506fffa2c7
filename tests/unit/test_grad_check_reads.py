"""The step's gradient checks read once (training/grad_check_reads.py): the chained optimizer's grad
norm equals megatron's combination of its parts' norms, and DDP's NaN / Inf check leaves a finite
bucket group alone and hands a non-finite one to megatron's own check, which names it."""

import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core.optimizer import optimizer as mcore_optimizer
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

from examples.multimodal_dev.training.grad_check_reads import one_read_bucket_check, one_read_chained_norm


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in ((7, 3), (5,), (2, 4, 6))]


def _part(grads):
    group = torch.distributed.group.WORLD
    return SimpleNamespace(
        get_grads_for_grad_norm=lambda: grads,
        get_grad_stats_parallel_group=lambda: group,
        get_grad_norm=lambda: get_grad_norm_fp32(grads, grad_stats_parallel_group=group),
    )


@pytest.mark.parametrize("parts", [(0, 1), (0, None), (None, None)], ids=["two parts", "one empty", "both empty"])
def test_a_chained_norm_over_two_groups_equals_megatrons(mcore, parts):
    chained = SimpleNamespace(
        chained_optimizers=[_part(_grads(p) if p is not None else []) for p in parts],
        grads_states_parallel_group_is_shared=lambda: False,  # the dense and expert optimizers at EP > 1
    )
    method = mcore_optimizer.ChainedOptimizer.get_grad_norm
    if method.__module__ == mcore_optimizer.__name__:  # megatron's own (this process has not installed ours)
        theirs = method(chained)
    else:  # its non-shared branch, as written there
        theirs = math.sqrt(sum((p.get_grad_norm() or 0.0) ** 2 for p in chained.chained_optimizers))
    ours = one_read_chained_norm(None)(chained)
    assert isinstance(ours, float) and ours == pytest.approx(theirs, rel=1e-6)


@pytest.mark.parametrize("fault", [None, float("nan"), float("inf")])
def test_the_bucket_check_hands_a_non_finite_group_to_megatrons(mcore, fault):
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    assert get_rerun_state_machine().mode == RerunMode.DISABLED
    buckets = [SimpleNamespace(grad_data=torch.ones(8)) for _ in range(3)]
    if fault is not None:
        buckets[1].grad_data[5] = fault
    handed = []
    check = one_read_bucket_check(lambda group, nan_or_inf, large: handed.append((nan_or_inf, large)))
    check(SimpleNamespace(buckets=buckets), True, False)
    assert handed == ([] if fault is None else [(True, False)])
    check(SimpleNamespace(buckets=buckets), True, True)  # the large-grads check: megatron's, as it is
    assert handed[-1] == (True, True)
