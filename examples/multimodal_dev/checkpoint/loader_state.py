"""A streaming loader's position in checkpoints (``--dataset-provider energon``): a resumed run
continues each data-parallel rank's stream where the checkpoint left it.

A map-style provider needs nothing here: megatron's sampler restarts at ``consumed_samples``. A
stream (energon's loader, which shuffles within a buffer and deals shards to ranks and workers)
can only be continued from its own state, which differs per data-parallel rank:

    iter_XXXXXXX/loader_state/dp00001.json    DP rank 1's state, with the settings it was read
                                              with and the SHA-256 of both

Written once the save returns by the first tensor / context / pipeline rank of each DP rank
(the others of a DP rank read the same stream). JSON with a checksum, like the token-budget plan
(``plan_state.py``): an edited or damaged file, a missing one (a run killed between megatron's
save and this write), or other settings (another DP size, worker count, micro-batch size or
dataset) restart the stream from its beginning with a line saying why, instead of failing the
resume; every other part of the checkpoint still resumes exactly.
"""

from __future__ import annotations

import os

from .files import iteration_dir, read_checked_json, write_checked_json

STATE_DIR = "loader_state"

_streams: dict = {}  # "train": the split behind this process's training iterator


def tracked() -> bool:
    return "train" in _streams


def track(split) -> None:
    """The training split; with virtual pipeline stages each stage has its own, all drawn alike."""
    _streams.setdefault("train", split)


def state_path(checkpoint_dir: str, dp_rank: int) -> str:
    return os.path.join(checkpoint_dir, STATE_DIR, f"dp{dp_rank:05d}.json")


def write_state(checkpoint_dir: str, dp_rank: int, state: dict) -> bool:
    """False when the checkpoint directory is not (yet) a local directory (an asynchronous save
    still writing): that checkpoint then restarts the stream."""
    if not os.path.isdir(checkpoint_dir):
        return False
    os.makedirs(os.path.join(checkpoint_dir, STATE_DIR), exist_ok=True)
    write_checked_json(state_path(checkpoint_dir, dp_rank), state)
    return True


def read_state(checkpoint_dir: str, dp_rank: int) -> dict | None:
    """The stored state, or None without the file; ValueError when its content is not what was written."""
    return read_checked_json(state_path(checkpoint_dir, dp_rank))


def resume(split, load_dir: str | None, iteration: int, consumed_samples: int, settings: dict) -> str | None:
    """Hand ``split`` its saved state when the checkpoint holds one for these ``settings``; one
    line saying how the stream continues (None for a run that starts at step 0)."""
    if not consumed_samples or not load_dir:
        return None
    checkpoint_dir = iteration_dir(load_dir, iteration)
    path = state_path(checkpoint_dir, settings["dp_rank"])
    try:
        state = read_state(checkpoint_dir, settings["dp_rank"])
        if state is None:
            why = f"{path} does not exist"
        elif state.get("settings") != settings:
            old = state.get("settings") or {}
            changed = ", ".join(  # both sides' keys: a setting saved only when set may be on either side
                f"{k} {old.get(k)!r} -> {settings.get(k)!r}"
                for k in {**old, **settings}
                if old.get(k) != settings.get(k)
            )
            why = f"it was saved with other settings ({changed})"
        else:
            split.restore_state(state)
            return f"data loader: DP rank {settings['dp_rank']} continues from {path}"
    # a damaged or planted file (RecursionError: brackets nested past Python's JSON reader): restarting is still safe
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        why = f"{path} is not a loader state: {type(err).__name__}: {err}"
    return f"data loader: DP rank {settings['dp_rank']} restarts its stream from the beginning ({why})"


_READS_ONLY = False  # this process reads a stream that another one writes (reads_only)


def reads_only() -> None:
    """This process reads its DP rank's stream but never writes or speaks for it: a rank of the
    vision tower on ranks of its own reads the stream of the language replica it serves, whose
    first rank writes it (vision_ranks/groups.py)."""
    global _READS_ONLY
    _READS_ONLY = True


def first_of_dp_rank() -> bool:
    """The process that writes (and speaks for) its DP rank's stream."""
    from megatron.core import parallel_state as ps

    if _READS_ONLY:
        return False
    return (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
        and ps.get_pipeline_model_parallel_rank() == 0
    )


def write_after_save(iteration: int, args) -> None:
    """After a save (``save_hooks.py``): this DP rank's loader state, by the rank that speaks for it."""
    from megatron.core import parallel_state

    split = _streams.get("train")
    if split is not None and args.save and first_of_dp_rank():
        state = split.save_state()
        if state is not None:
            write_state(iteration_dir(args.save, iteration), parallel_state.get_data_parallel_rank(), state)
