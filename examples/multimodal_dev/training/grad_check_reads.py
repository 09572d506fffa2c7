"""The step's gradient checks with one host read where megatron takes several (rows of
``megatron_changes/table.py``, group ``grad-checks-in-one-read``).

- **NaN / Inf before the data-parallel reduce.** megatron's DDP takes each bucket's gradient norm
  and asks the rerun state machine twice about it (is it NaN? is it Inf?), each a read to the host:
  two syncs a bucket and bucket group every step, four at EP > 1 (the dense and the expert grads are
  two groups). Here the group's bucket norms are stacked and read once: all finite, nothing more to
  do; otherwise megatron's own check runs and names the bucket and the fault, as it always did.
  Under a rerun mode other than ``disabled`` (``--rerun-mode`` given) the state machine records every
  result, so megatron's check runs unchanged.
- **The grad norm of a chained optimizer whose parts reduce over different groups** (the dense and
  the expert optimizer at EP > 1). megatron takes each part's norm to the host (``.item()``, and a
  truth test of it) and combines them there; here each part's sum of squares is reduced over its own
  group on the device and the total is read once. The same arithmetic in fp32 up to the order of the
  final sum (``math.sqrt(a**2 + b**2)`` on the host before). Parts with DTensor gradients (Megatron-
  FSDP) keep megatron's path.
"""

from __future__ import annotations

import math

import torch


def one_read_bucket_check(original, run=None):
    """``_ParamAndGradBucketGroup.check_grads(check_for_nan_or_inf, check_for_large)``."""

    def check_grads(self, check_for_nan_or_inf, check_for_large):
        from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

        if check_for_large or not check_for_nan_or_inf or get_rerun_state_machine().mode != RerunMode.DISABLED:
            return original(self, check_for_nan_or_inf, check_for_large)
        norms = torch.stack([bucket.grad_data.norm(p=2) for bucket in self.buckets])
        if not bool(torch.isfinite(norms).all()):  # the one read; megatron's check then says which and why
            original(self, check_for_nan_or_inf, check_for_large)

    return check_grads


def one_read_chained_norm(original, run=None):
    """``ChainedOptimizer.get_grad_norm()`` -> float."""

    @torch.no_grad()
    def get_grad_norm(self):
        parts = [opt for opt in self.chained_optimizers if not getattr(opt, "is_stub_optimizer", False)]
        if len(self.chained_optimizers) == 1 or self.grads_states_parallel_group_is_shared():
            return original(self)
        grads = [opt.get_grads_for_grad_norm() for opt in parts]
        if any(_is_dtensor(g) for part in grads for g in part):
            return original(self)
        squares = [
            _reduced_sum_of_squares(part, opt.get_grad_stats_parallel_group()) for opt, part in zip(parts, grads)
        ]
        if not squares:
            return 0.0
        return math.sqrt(float(torch.stack(squares).sum()))

    return get_grad_norm


def _reduced_sum_of_squares(grads: list[torch.Tensor], group) -> torch.Tensor:
    """The squared L2 norm of ``grads`` summed over ``group`` (megatron's get_grad_norm_fp32 before its
    square root and its read), a [1] fp32 tensor on the device."""
    if grads:
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        total = torch.linalg.vector_norm(torch.stack(norms)).reshape(1) ** 2
    else:
        total = torch.zeros(1, dtype=torch.float32, device=torch.cuda.current_device())
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=group)
    return total


def _is_dtensor(tensor) -> bool:
    from megatron.core.utils import get_data_parallel_group_if_dtensor

    return get_data_parallel_group_if_dtensor(tensor) is not None
