"""Every data-parallel rank's RNG state in the checkpoint, so dropout resumes exactly at DP > 1.

megatron saves the RNG state of DP rank 0 alone (unless ``--data-parallel-random-init``) and, on
resume, gives it to every DP rank. The DP ranks start from one seed, but each draws for its own
rows (dropout over rows of different lengths), so in a straight run their streams part after
the first step, and a resumed run with dropout departs from the straight one at the first resumed
step (7.7180 against 7.7130 at DP=2, dropout 0.1).

megatron already knows how to keep every rank's state: with ``--data-parallel-random-init`` it
gathers the states over the DP group, saves the list, and each DP rank takes its own entry on
load. That flag also changes the seeds and broadcasts the initial weights, though, so it is not
turned on; two rows of ``megatron_changes`` (group ``per-rank-rng``) only make the save read it
as set, and the load hand each rank its own:

- a save always stores the list of every DP rank's state;
- a load puts this rank's entry first, where megatron reads, when the checkpoint has one per rank
  of this DP size; otherwise every rank takes DP rank 0's, as megatron does (a resume at another
  DP size deals other rows to each rank, so it cannot repeat the straight run's draws anyway).
"""

from __future__ import annotations

import contextlib
import functools


@contextlib.contextmanager
def _reading_as_random_init(args):
    was = args.data_parallel_random_init
    args.data_parallel_random_init = True
    try:
        yield
    finally:
        args.data_parallel_random_init = was


def own_entry_first(state_dict: dict, dp_rank: int, dp_size: int) -> bool:
    """Put this DP rank's saved RNG state where megatron's load reads (entry 0) when the checkpoint
    holds one per rank of this DP size; True when it did."""
    states = state_dict.get("rng_state") if isinstance(state_dict, dict) else None
    if not isinstance(states, list) or len(states) != dp_size or dp_size == 1:
        return False
    state_dict["rng_state"] = [states[dp_rank]] + [s for i, s in enumerate(states) if i != dp_rank]
    return True


def every_rank_state(get_rng_state, run=None):
    """``get_rng_state`` read as if ``--data-parallel-random-init`` were set: the list of every DP
    rank's state (megatron_changes row)."""
    from megatron.training import get_args

    @functools.wraps(get_rng_state)
    def every_rank_state(*args, **kwargs):
        megatron_args = get_args()
        if megatron_args.data_parallel_random_init:
            return get_rng_state(*args, **kwargs)
        with _reading_as_random_init(megatron_args):  # the flag is back before the arguments are saved
            return get_rng_state(*args, **kwargs)

    return every_rank_state


def own_rank_first(load_base, run=None):
    """``_load_base_checkpoint`` that puts this DP rank's RNG state first (megatron_changes row)."""
    from megatron.core import parallel_state
    from megatron.training import get_args

    @functools.wraps(load_base)
    def own_rank_first(*args, **kwargs):
        loaded = load_base(*args, **kwargs)
        if not get_args().data_parallel_random_init and parallel_state.model_parallel_is_initialized():
            own_entry_first(
                loaded[0], parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
            )
        return loaded

    return own_rank_first
