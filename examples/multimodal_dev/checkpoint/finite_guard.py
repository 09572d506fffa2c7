"""A checkpoint never holds non-finite weights.

megatron checks gradients for NaN / inf before the optimizer steps (``--check-for-nan-in-loss-and-grad``,
on by default), but not the weights after the step: an infinite or NaN learning rate turns finite
gradients into NaN weights, and the next interval save would make that the latest checkpoint, the
one a resume picks. ``refuse_nonfinite`` runs before every save the training loop makes
(``save_hooks.py``: interval, exit, signal, end of training): each rank sums each of its parameters in fp32
(a NaN or inf anywhere makes the sum non-finite; one pass over the weights, cheap beside writing
them), the ranks agree by an all-reduce, and a save with any non-finite weight is refused on every
rank at once with one line naming the tensors and the checkpoint that stays the latest.
"""

from __future__ import annotations

import os

import torch

from examples.multimodal_dev.console import fail

from .files import latest_iteration


def nonfinite_parameters(model_chunks) -> list[str]:
    """Names of the parameters that hold a NaN or inf, over all (virtual pipeline) model chunks."""
    named = [(name, p) for chunk in model_chunks for name, p in chunk.named_parameters()]
    if not named:
        return []
    # Megatron-FSDP's parameters are DTensors: each rank sums its own shard (the ranks agree after)
    local = [(p.to_local() if hasattr(p, "to_local") else p).detach() for _, p in named]
    sums = torch.stack([t.sum(dtype=torch.float32).to(local[0].device) for t in local])
    return [named[i][0] for i in torch.nonzero(~torch.isfinite(sums)).flatten().tolist()]


def _any_rank(count: int, device) -> int:
    flag = torch.tensor([count], dtype=torch.float32, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return int(flag.item())


def refuse_nonfinite(iteration: int, model, args) -> None:
    """Before a save (``save_hooks.py``): stop on every rank at once when any rank holds a non-finite weight."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    bad = nonfinite_parameters(chunks)
    device = next(chunks[0].parameters()).device
    if not _any_rank(len(bad), device):
        return
    save_dir = args.save
    latest = latest_iteration(save_dir) if save_dir and os.path.isdir(save_dir) else None
    kept = (
        f"iteration {latest} stays the latest checkpoint in {save_dir}"
        if latest is not None
        else "no earlier checkpoint exists"
    )
    mine = f" ({len(bad)} tensor(s) on this rank, e.g. {bad[0]})" if bad else ""
    fail(
        f"iteration {iteration} has NaN or inf weights{mine}; not saved: "
        f"{kept} (a non-finite learning rate or a diverged step: resume from it with a lower LR)"
    )
