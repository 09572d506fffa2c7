"""Every save the training loop makes (interval, exit, signal, end of training), with the project's
work around it, in one visible order:

    around    a full disk is one line and leaves the last complete checkpoint   save_guard.py
    before    refuse a save of NaN / inf weights, on every rank at once         finite_guard.py
              megatron.training's save_checkpoint (every DP rank's RNG state: rng_per_rank.py)
    after     the token-budget plan's position                                  plan_state.py
              this DP rank's loader position                                    loader_state.py
              the crc32 of the files this rank wrote, and every rank's seen     shard_checksums.py
              here (many nodes: one shared folder)
              (with --async-save, in the save's finalize step: ``with_checksums_recorded``)

The after-hooks run inside the full-disk guard: a disk that fills while they write is one line too.
One row of ``megatron_changes`` (group ``save-hooks``) puts ``with_save_hooks`` in place.
"""

from __future__ import annotations

import functools
import os

from . import finite_guard, loader_state, plan_state, save_guard, shard_checksums
from .files import iteration_dir

_async_save_of: list[str] = []  # the iteration directory of an async save being scheduled


def _expect_async_save(iteration, _model, args) -> None:
    async_save = args.save and getattr(args, "async_save", False)
    _async_save_of[:] = [iteration_dir(args.save, iteration)] if async_save else []


def _record_checksums(iteration, args) -> None:
    # an async save's files are still being written: its finalize step records them
    if args.save and not getattr(args, "async_save", False):
        directory = iteration_dir(args.save, iteration)
        if os.path.isdir(directory):  # megatron's local (non-persistent) checkpoints are elsewhere
            shard_checksums.check_every_rank_saved_here(directory, _rank(), _world())


def _rank() -> int:
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world() -> int:
    import torch

    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


BEFORE = (finite_guard.refuse_nonfinite, _expect_async_save)  # hook(iteration, model, args)
AFTER = (plan_state.write_after_save, loader_state.write_after_save, _record_checksums)  # hook(iteration, args)


def with_checksums_recorded(schedule_async_save, run=None):
    """megatron.training's ``schedule_async_save`` (megatron_changes row): the save's request also
    records this rank's checksums when it is finalized, once every rank's files are complete."""

    @functools.wraps(schedule_async_save)
    def schedule(request):
        if _async_save_of:
            check = shard_checksums.check_every_rank_saved_here
            request.add_finalize_fn(functools.partial(check, _async_save_of.pop(), _rank(), _world()))
        return schedule_async_save(request)

    return schedule


def with_save_hooks(save_checkpoint, run=None, *, get_args=None):
    """megatron.training's ``save_checkpoint`` with the hooks above (megatron_changes row);
    ``get_args``: megatron's arguments at save time (megatron.training's by default)."""
    if get_args is None:
        from megatron.training import get_args
    save_guard.listen_to_the_writer()

    @functools.wraps(save_checkpoint)
    def save(iteration, model, *args, **kwargs):
        run_args = get_args()
        with save_guard.full_disk_in_one_line(run_args.save, iteration):
            for hook in BEFORE:
                hook(iteration, model, run_args)
            result = save_checkpoint(iteration, model, *args, **kwargs)
            for hook in AFTER:
                hook(iteration, run_args)
        return result

    return save
