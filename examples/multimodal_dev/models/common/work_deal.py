"""Dealing items of work (images, video frames) to ranks by their cost: the vision tower's split
over context-parallel ranks (``vision_context_parallel.py``) and the planner's count of the
activations it leaves on the busiest rank (``planner/activation_memory.py``) are the same deal.
Imports nothing, so the planner and the launcher's dry run stay free of megatron-core."""

from __future__ import annotations


def deal(costs: list[float], ranks: int) -> list[list[int]]:
    """Item indices per rank: largest cost first to the least-loaded rank (ties: the lower rank);
    each rank's items in their original order."""
    loads, owned = [0.0] * ranks, [[] for _ in range(ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (loads[r], r))
        loads[r] += costs[i]
        owned[r].append(i)
    return [sorted(items) for items in owned]
