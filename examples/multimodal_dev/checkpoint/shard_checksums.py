"""Every byte a run resumes from is the byte it saved: a crc32 of each checkpoint file, recorded once
the save is complete and checked before megatron or a tool reads the checkpoint.

A torch_dist shard is raw tensor bytes at the offsets ``.metadata`` names: 4 KiB overwritten inside
one (a failing disk, a broken copy) loaded as other weights without a word. Now each rank records,
after its files are complete, the size and crc32 of the shards it wrote (torch.distributed.checkpoint
names them ``__<rank>_<n>.distcp``; rank 0 adds the index and megatron's ``metadata.json``)::

    iter_N/crc32/<rank>.json     {file name: [size, crc32]}

A synchronous save records after megatron's ``save_checkpoint`` returns (its ranks have passed a
barrier behind their writes); with ``--async-save``, in the save's finalize step, which megatron runs
once every rank's writes are done (``save_hooks.py``, and the megatron change ``save-hooks``).
Checking reads every recorded file once over all ranks: rank r checks every world-size-th file,
crc32 runs at 3.7 GB/s on one core of the CPU host. A checkpoint saved before this, or by another
program, has no record and is read unchecked.
"""

from __future__ import annotations

import json
import os
import re
import zlib

RECORD_DIR = "crc32"
_BLOCK = 16 << 20
_RANK_ZERO_FILES = (".metadata", "metadata.json")


def crc32_of(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def written_by(directory: str, rank: int) -> list[str]:
    """The files of ``directory`` this rank wrote (its shards; rank 0: also the index)."""
    own = re.compile(rf"(.*_)?__{rank}_\d+\.distcp")
    names = [n for n in sorted(os.listdir(directory)) if own.fullmatch(n)]
    extra = [n for n in _RANK_ZERO_FILES if rank == 0 and os.path.isfile(os.path.join(directory, n))]
    return names + extra


def record(directory: str, rank: int) -> None:
    """Write this rank's record of ``directory``: the files it wrote, complete."""
    paths = {name: os.path.join(directory, name) for name in written_by(directory, rank)}
    sums = {name: [os.path.getsize(path), crc32_of(path)] for name, path in paths.items()}
    folder = os.path.join(directory, RECORD_DIR)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{rank}.json")
    with open(path + ".partial", "w") as f:
        json.dump(sums, f)
    os.replace(path + ".partial", path)


def ranks_unseen(directory: str, world: int) -> list[int]:
    """The ranks whose record this process cannot see in ``directory``: on many nodes, every node must
    write one shared folder; a node that saved to a disk of its own leaves the others' view without
    its ranks' shards."""
    folder = os.path.join(directory, RECORD_DIR)
    return [r for r in range(world) if not os.path.isfile(os.path.join(folder, f"{r}.json"))]


def check_every_rank_saved_here(directory: str, rank: int, world: int) -> None:
    """This rank's record of ``directory``, then, once every rank has written its own (a barrier), the
    ranks whose files this rank's filesystem lacks: the checkpoint would not load, so the run stops now
    in one line on every rank, rather than at the next load."""
    import torch.distributed as dist

    from examples.multimodal_dev.console import fail

    record(directory, rank)
    if world > 1 and dist.is_initialized():
        dist.barrier()
    unseen = ranks_unseen(directory, world)
    if unseen:
        shown = ", ".join(map(str, unseen[:8])) + (", ..." if len(unseen) > 8 else "")
        fail(
            f"checkpoint {directory}: rank {rank} does not see the files of rank(s) {shown}: every node must save "
            "to one shared folder (a node-local disk at the same path splits the checkpoint)"
        )


def recorded(directory: str) -> dict[str, list[int]]:
    """{file name: [size, crc32]} over every rank's record (empty where none was written)."""
    folder = os.path.join(directory, RECORD_DIR)
    sums: dict = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                sums.update(json.load(f))
    return sums


def mismatch(directory: str, rank: int = 0, world: int = 1) -> str | None:
    """The first of this rank's share of the recorded files whose bytes are not those saved."""
    for i, (name, (size, crc)) in enumerate(sorted(recorded(directory).items())):
        if i % world != rank:
            continue
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{path} is missing"
        if os.path.getsize(path) != size:
            return f"{path} has {os.path.getsize(path)} bytes, {size} when it was saved"
        if (now := crc32_of(path)) != crc:
            return f"{path} is not the file that was saved (crc32 {now:08x}, saved {crc:08x}): its bytes changed since"
    return None
