"""Is the checkpoint a run resumes from whole? Checked before megatron reads it.

A torch_dist iteration directory is ``metadata.json`` (megatron's: which format), ``.metadata``
(torch.distributed.checkpoint's index: every tensor's file, offset and length) and the shard files
it names. A deleted or truncated shard, a deleted or garbage index, or a deleted ``metadata.json``
made megatron fail deep inside the load with a message that names neither the file nor a way out.
``check_resumable`` reads the index (restricted to checkpoint data, ``safety.py``), checks that
every shard it names exists and is long enough, that no link in the directory leads outside it and
that every file's bytes are those saved (``shard_checksums.py``), and otherwise names the damaged file
and the newest earlier iteration that is whole.
"""

from __future__ import annotations

import os
import re

from . import shard_checksums
from .files import TRACKER, checkpoint_directory, is_fsdp_dtensor, iteration_dir, latest_iteration, leads_outside


def damage(directory: str, rank: int = 0, world: int = 1) -> str | None:
    """What is wrong with one iteration directory, or None when it is whole (its recorded checksums
    checked by ``world`` ranks together: this one checks its share)."""
    from torch.distributed.checkpoint import FileSystemReader

    from ..megatron_changes import apply
    from .safety import refusal

    legacy = [n for n in os.listdir(directory) if n.startswith("mp_rank_") or n == "common.pt"]
    if legacy and not os.path.exists(os.path.join(directory, ".metadata")):
        return (
            f"{os.path.join(directory, legacy[0])} is a legacy megatron checkpoint (whole pickles), which this "
            "project does not load: a checkpoint is data, never code; convert it to torch_dist first"
        )
    # megatron's metadata.json names a torch_dist save; an fsdp_dtensor save (Megatron-FSDP) is DCP's alone
    for name in ("metadata.json", ".metadata") if not is_fsdp_dtensor(directory) else (".metadata",):
        if not os.path.isfile(os.path.join(directory, name)):
            return f"{os.path.join(directory, name)} is missing"
    if outside := leads_outside(directory):
        return outside
    apply("checkpoints-are-data")
    index = os.path.join(directory, ".metadata")
    try:
        storage = FileSystemReader(directory).read_metadata().storage_data
    except Exception as err:  # an unreadable index: garbage or truncated
        if refusal(err):
            raise  # a planted global is not damage: it is refused as code, in its own words
        return f"{index} cannot be read ({type(err).__name__}: {str(err)[:120]})"
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{path} is missing"
        if os.path.getsize(path) < length:
            return f"{path} is truncated ({os.path.getsize(path)} of {length} bytes)"
    return shard_checksums.mismatch(directory, rank, world)


def check_resumable(load_dir: str | None, flag: str = "--load") -> None:
    """ValueError naming the damaged file of the latest iteration and the newest whole one before it."""
    if not load_dir or not os.path.isfile(os.path.join(load_dir, TRACKER)):
        return
    directory = checkpoint_directory(load_dir)
    if not os.path.isdir(directory):
        return  # named by run_shape.check_checkpoint_matches
    share = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # torchrun's
    what = damage(directory, *share)
    if what is None:
        return
    latest = latest_iteration(load_dir)
    earlier = sorted(
        (int(d[5:]) for d in os.listdir(load_dir) if re.fullmatch(r"iter_\d{7}", d) and int(d[5:]) < latest),
        reverse=True,
    )
    whole = next((i for i in earlier if damage(iteration_dir(load_dir, i), *share) is None), None)
    way_out = (
        f"iteration {whole} is complete: resume from it by writing {whole} into {os.path.join(load_dir, TRACKER)}"
        if whole is not None
        else "no earlier iteration in it is complete"
    )
    raise ValueError(f"{flag} {load_dir}: the latest checkpoint (iteration {latest}) is damaged: {what}; {way_out}")
