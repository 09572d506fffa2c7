"""Checkpoints of the CPU loop in megatron.training's layout.

    <save>/latest_checkpointed_iteration.txt      written last, atomically
    <save>/iter_0000008/                          torch_dist: {"model": sharded model state} plus the
                                                  common items (args, iteration, scheduler, consumed samples)
    <save>/iter_0000008/cpu_rank_00000.pt         per-rank: AdamW state, RNG states, parallel layout

A save first writes ``iter_XXXXXXX.partial/`` and renames it when every rank has finished, then
replaces the pointer; a save that dies midway leaves the previous checkpoint and pointer intact.
The model part loads at any TP/EP (dist_checkpointing reshards); the optimizer part only at
the layout it was saved with (else ``--no-load-optim``). A checkpoint written without an
optimizer (an import from Hugging Face, at iteration 0) has no per-rank files: load it with
``--finetune``.
"""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch

TRACKER = "latest_checkpointed_iteration.txt"
# Test hook: make the save of this iteration die after the shards are written, before the rename.
FAIL_SAVE_ENV = "MEGATRON_CPU_FAIL_SAVE_AT_ITERATION"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _layout(args) -> dict:
    return {k: getattr(args, k) for k in ("world_size", "tensor_model_parallel_size", "context_parallel_size",
                                           "expert_model_parallel_size")}


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_checkpoint(args, iteration: int, model, optimizer=None, scheduler=None) -> str:
    """Model (and, when given, optimizer, scheduler and RNG) state of ``iteration`` under ``args.save``."""
    from megatron.core import dist_checkpointing

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    final = iteration_dir(args.save, iteration)
    partial = final + ".partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()
    state = {
        "model": model.sharded_state_dict(),
        "args": args, "checkpoint_version": 3.0, "iteration": iteration,
        "consumed_train_samples": args.consumed_train_samples, "consumed_valid_samples": args.consumed_valid_samples,
    }
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(state, partial)
    if optimizer is not None:
        torch.save({"optimizer": optimizer.state_dict(), "rng": _rng_state(), "layout": _layout(args)},
                   os.path.join(partial, f"cpu_rank_{rank:05d}.pt"))
    if os.environ.get(FAIL_SAVE_ENV) == str(iteration):
        raise RuntimeError(f"{FAIL_SAVE_ENV}={iteration}: failing this save on purpose (test hook)")
    _barrier()
    if rank == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(partial, final)
        tmp = os.path.join(args.save, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(args.save, TRACKER))
    _barrier()
    return final


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


def load_model_weights(model, directory: str) -> None:
    """Model weights from one iteration directory, resharded to this model's TP/EP layout."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(state["model"])


def load_checkpoint(args, model, optimizer, scheduler) -> int:
    """Restore from ``--load``; returns the iteration to continue from (0 with ``--finetune``)."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(args.load)
    if iteration is None:
        resuming_in_place = args.save and os.path.abspath(args.save) == os.path.abspath(args.load)
        if not os.path.isdir(args.load) and not resuming_in_place:
            raise FileNotFoundError(f"--load {args.load}: no such directory")
        print(f"--load {args.load} has no {TRACKER} yet; training from scratch", flush=True)
        return 0
    directory = checkpoint_directory(args.load)
    load_model_weights(model, directory)
    print(f"loaded model weights from {directory} (iteration {iteration})", flush=True)
    if args.finetune:
        args.consumed_train_samples = args.consumed_valid_samples = 0
        return 0
    state = dist_checkpointing.load_common_state_dict(directory)
    args.consumed_train_samples = state.get("consumed_train_samples", 0)
    args.consumed_valid_samples = state.get("consumed_valid_samples", 0)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    rank_file = os.path.join(directory, f"cpu_rank_{rank:05d}.pt")
    local = torch.load(rank_file, weights_only=False) if os.path.exists(rank_file) else None
    if not args.no_load_optim:
        if local is None or local["layout"] != _layout(args):
            saved = local["layout"] if local else "no optimizer state"
            raise ValueError(f"--load {args.load}: optimizer state was saved with {saved}, this run is "
                             f"{_layout(args)}; pass --no-load-optim (or --finetune) to start a fresh optimizer")
        optimizer.load_state_dict(local["optimizer"])
        if "opt_param_scheduler" in state:
            scheduler.load_state_dict(state["opt_param_scheduler"])
    if not args.no_load_rng and local is not None and local["layout"] == _layout(args):
        _set_rng_state(local["rng"])
    return iteration
