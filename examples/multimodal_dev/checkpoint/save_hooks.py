"""Every save the training loop makes (interval, exit, signal, end of training), with the project's
work around it, in one visible order:

    around    a full disk is one line and leaves the last complete checkpoint   save_guard.py
    before    refuse a save of NaN / inf weights, on every rank at once         finite_guard.py
              megatron.training's save_checkpoint (every DP rank's RNG state: rng_per_rank.py)
    after     the token-budget plan's position                                  plan_state.py
              this DP rank's loader position                                    loader_state.py

The after-hooks run inside the full-disk guard: a disk that fills while they write is one line too.
One row of ``megatron_changes`` (group ``save-hooks``) puts ``with_save_hooks`` in place.
"""

from __future__ import annotations

import functools

from . import finite_guard, loader_state, plan_state, save_guard

BEFORE = (finite_guard.refuse_nonfinite,)  # hook(iteration, model, args)
AFTER = (plan_state.write_after_save, loader_state.write_after_save)  # hook(iteration, args)


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
