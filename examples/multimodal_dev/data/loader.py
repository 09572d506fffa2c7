"""Data iterators over contract datasets: megatron's pretraining sampler (so a resumed run
continues at ``consumed_samples`` exactly) plus the THD/BSHD collate.

megatron.training's default loader stacks samples with torch's default collate, which cannot
hold variable-length conversations; the playground therefore hands megatron.training
ready-made iterators (``--dataloader-type external``) on every host.
"""

from __future__ import annotations

import itertools

import torch
from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

from .token_budget import TokenBudgetSampler


def build_iterator(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                   collate_fn, num_workers: int = 0, cyclic: bool = False, plan_fn=None):
    """Micro-batches for this data-parallel rank, starting after ``consumed_samples``.
    ``plan_fn(dataset, cyclic)``: a ``TokenBudgetPlan`` whose rows are the micro-batches
    (token-budget packing; ``consumed_samples`` then counts rows)."""
    if dataset is None or len(dataset) == 0:
        return None
    loader_options = dict(collate_fn=collate_fn, num_workers=num_workers, persistent_workers=num_workers > 0,
                          pin_memory=torch.cuda.is_available())
    if plan_fn is not None:
        sampler = TokenBudgetSampler(plan_fn(dataset, cyclic), consumed_samples, dp_rank)
        return iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler, **loader_options))
    if len(dataset) < micro_batch_size * dp_size:
        raise ValueError(f"a split of {len(dataset)} samples cannot fill one micro-batch of {micro_batch_size} "
                         f"on each of {dp_size} data-parallel ranks")

    def one_pass(consumed):
        sampler = MegatronPretrainingSampler(total_samples=len(dataset), consumed_samples=consumed,
                                             micro_batch_size=micro_batch_size, data_parallel_rank=dp_rank,
                                             data_parallel_size=dp_size)
        return iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler, **loader_options))

    if not cyclic:
        return one_pass(consumed_samples)
    # Validation: evaluation passes keep drawing, wrapping around the split.
    first = one_pass(consumed_samples % len(dataset))
    return itertools.chain(first, itertools.chain.from_iterable(one_pass(0) for _ in itertools.count()))
