"""Model-only checkpoints in megatron.training's torch_dist layout, for the converter and tests.

    <root>/latest_checkpointed_iteration.txt      written last, atomically
    <root>/iter_0000000/                          torch_dist: {"model": sharded model state} plus the
                                                  common items megatron.training reads (args, iteration)

megatron.training loads these with ``--finetune`` (weights only, iteration 0) at any TP/EP/PP:
dist_checkpointing reshards. Training runs write their own checkpoints (megatron.training's
``save_checkpoint``: weights, optimizer, scheduler, RNG), which the helpers below read too.
A save first writes ``iter_XXXXXXX.partial/`` and renames it, then replaces the pointer: a save
that dies midway leaves what was there before intact.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil

import torch

from . import fsdp_weights, shard_checksums, write_queue
from .safety import load_failure, refusal

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_model_checkpoint(args, iteration: int, model, fill=None) -> str:
    """The model's weights as iteration ``iteration`` under ``args.save``, in ``args.ckpt_format``
    (torch_dist unless it says fsdp_dtensor); ``args`` (megatron's names) is stored for
    ``--use-checkpoint-args`` and megatron's checkpoint checks. ``fill(name)``: parameter ``name``'s
    tensor, asked for as the writer reaches it, for a weightless ``model`` (``streamed_save.py``)."""
    from megatron.core import dist_checkpointing

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    final = iteration_dir(args.save, iteration)
    partial = final + ".partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()
    if getattr(args, "ckpt_format", "torch_dist") == "fsdp_dtensor":
        fsdp_weights.save_weights(model, args, iteration, partial, fill)
    elif fill is not None:
        from .streamed_save import write_torch_dist

        write_torch_dist(partial, model, {"args": args, "checkpoint_version": 3.0, "iteration": iteration}, fill)
    else:
        write_queue.install()  # megatron's writer reports through it (a streamed write uses torch's)
        state = {"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": iteration}
        dist_checkpointing.save(state, partial)
    _barrier()
    shard_checksums.record(partial, rank)
    _barrier()
    if rank == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(partial, final)
        write_text_atomic(os.path.join(args.save, TRACKER), str(iteration))
    _barrier()
    return final


def write_text_atomic(path: str, text: str) -> None:
    """A reader sees the whole file or none (the rename is atomic)."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write_checked_json(path: str, state: dict) -> None:
    """``state`` as JSON with the SHA-256 of its content (``read_checked_json``), written atomically."""
    write_text_atomic(path, json.dumps({**state, "sha256": _digest(state)}))


def read_checked_json(path: str) -> dict | None:
    """What ``write_checked_json`` wrote, or None without the file; ValueError when the content is not
    what was written (edited by hand or damaged on disk)."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        state = json.load(f)
    if not isinstance(state, dict) or state.pop("sha256", None) != _digest(state):
        raise ValueError("its content does not match the checksum written with it (edited or damaged)")
    return state


def _digest(state: dict) -> str:
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def latest_iteration(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    return 0 if text == "release" else int(text)


def checkpoint_directory(root: str) -> str:
    """The directory of the latest iteration under ``root`` (a --save/--load directory)."""
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"{root}: no {TRACKER}; not a checkpoint directory")
    directory = iteration_dir(root, iteration)
    if not os.path.isdir(directory) and iteration == 0:
        directory = os.path.join(root, "release")
    return directory


def leads_outside(directory: str) -> str | None:
    """A link in the iteration directory whose target is outside it: loading would read another
    file's bytes as weights (a downloaded checkpoint could point at any file of the user's)."""
    root = os.path.realpath(directory)
    for folder, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(folder, name)
            target = os.path.realpath(path)
            if os.path.islink(path) and os.path.commonpath([root, target]) != root:
                return f"{path} is a link to {target}, outside the checkpoint; a checkpoint's files are its own"
    return None


def check_own_files(directory: str) -> None:
    """Refuse a checkpoint whose links lead outside it or whose bytes changed since the save."""
    if what := leads_outside(directory) or shard_checksums.mismatch(directory):
        raise ValueError(what)


def is_fsdp_dtensor(directory: str) -> bool:
    """An iteration directory Megatron-FSDP saved (``--ckpt-format fsdp_dtensor``): DCP's index and
    shards, without megatron's ``metadata.json``, and the run's common state among its entries."""
    names = set(os.listdir(directory))
    return ".metadata" in names and "metadata.json" not in names and any(n.endswith(".distcp") for n in names)


def stored_args(directory: str):
    """The megatron args a checkpoint iteration directory was saved with (None if it has none),
    read as data only (``safety.py``)."""
    from megatron.core import dist_checkpointing

    from ..megatron_changes import apply

    apply("checkpoints-are-data")
    check_own_files(directory)
    try:
        if is_fsdp_dtensor(directory):  # the run's common state is among DCP's own entries
            from torch.distributed.checkpoint import load

            state = {"args": None}
            load(state, checkpoint_id=directory, no_dist=True)
            return state["args"]
        return dist_checkpointing.load_common_state_dict(directory).get("args")
    except Exception as err:  # garbage bytes fail the unpickler any way they like: one line, not torch's advice
        if refusal(err) is not None:
            raise
        legacy = os.path.join(directory, "common.pt")  # megatron reads it first where it exists
        raise load_failure(legacy if os.path.exists(legacy) else f"{directory} (its common state)", err) from None


@functools.lru_cache(maxsize=None)
def stored_keys(directory: str) -> frozenset[str]:
    """The keys a request may name to read what the checkpoint iteration at ``directory`` stores: its
    tensors' keys and their dotted prefixes (a tensor a factory splits, such as a ``B`` split into
    the weight's sections, is stored under sub-keys of its own)."""
    from megatron.core import dist_checkpointing

    keys = set()
    for key in dist_checkpointing.load_tensors_metadata(directory).keys():
        parts = key.split(".")
        keys.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
    return frozenset(keys)


def load_model_weights(model, directory: str, base: str | None = None) -> None:
    """Model weights from one iteration directory, resharded to this model's TP/EP layout; those it
    does not hold from ``base`` (the base of a checkpoint of LoRA adapters alone). Nothing in either
    directory is unpickled beyond checkpoint data (``safety.py``)."""
    from megatron.core import dist_checkpointing

    from ..megatron_changes import apply

    apply("checkpoints-are-data")
    check_own_files(directory)
    request, state = model.sharded_state_dict(), {}
    if base is not None:
        held = stored_keys(directory)
        from_base = {n: s for n, s in request.items() if hasattr(s, "key") and s.key not in held}
        request = {n: s for n, s in request.items() if n not in from_base}
        state = dist_checkpointing.load({"model": from_base}, base)["model"]
    state.update(dist_checkpointing.load({"model": request}, directory)["model"])
    model.load_state_dict(state)
