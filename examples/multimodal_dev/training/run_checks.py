"""Settings refused before training starts, and failures during it told in one line.

megatron.training asserts on some settings deep inside its set-up (a bare ``AssertionError``), takes
others that cannot work (an infinite learning rate trains a NaN step), and reports a NaN gradient
as a traceback. Each check here names the flag and the value; ``one_line(err, args)`` turns the
failures a user can act on into one line.
"""

from __future__ import annotations

import math
import os
import re

from examples.multimodal_dev.checkpoint.files import TRACKER, checkpoint_directory, latest_iteration, stored_args
from examples.multimodal_dev.models.setting_names import FSDP_REFUSALS


def check_finite_flags(args, given: dict[str, str]) -> None:
    """Every number typed on the command line is finite (``--lr 1e999`` parses as inf)."""
    bad = [
        f"{option} {getattr(args, dest)}"
        for dest, option in given.items()
        if isinstance(getattr(args, dest, None), float) and not math.isfinite(getattr(args, dest))
    ]
    if bad:
        raise ValueError(f"{', '.join(bad)}: not a finite number")


def device_memory_bytes() -> tuple[int, str]:
    """What one process may use: the GPU's memory, or on a CPU host its share of the RAM."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory, "this GPU"
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // processes, f"this host's RAM{f' over {processes} processes' if processes > 1 else ''}"


def micro_batch_floor(args, hidden_size: int, num_layers: int, vocab_size: int) -> dict[str, int]:
    """Bytes one rank cannot do without for the largest micro-batch the settings admit: the logits
    of its tokens, and one saved input per decoder layer of the smallest pipeline stage (every
    layer keeps at least its input for the backward, recompute or not). Weights, optimizer state
    and everything else come on top, so a run refused here could never have fit; planning the rest
    is the layout planner's job."""
    tokens = (
        args.packed_seq_length or args.seq_length
        if args.packing == "tokens"
        else args.seq_length * args.micro_batch_size
    )
    tokens //= args.context_parallel_size
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    width = 2 if args.bf16 or args.fp16 else 4
    logits = tokens * -(-vocab_size // tp) * width
    saved = tokens // (tp if args.sequence_parallel else 1) * hidden_size * width * (num_layers // pp)
    return {"logits": logits, "saved layer inputs": saved} if pp == 1 else {"stage floor": max(logits, saved)}


def check_memory_floor(args, hidden_size: int, num_layers: int, vocab_size: int, available=None) -> None:
    """megatron allocates a (seq-length x micro-batch) tensor before the first step, so a length
    that cannot fit took ~200 GB before dying in the allocator; refuse it from the floor instead."""
    have, where = available or device_memory_bytes()
    parts = micro_batch_floor(args, hidden_size, num_layers, vocab_size)
    need = sum(parts.values())
    if need > have:
        gib = 1 << 30
        what = " + ".join(f"{name} {size / gib:.1f}" for name, size in parts.items())
        length = (
            f"--packed-seq-length {args.packed_seq_length or args.seq_length}"
            if args.packing == "tokens"
            else f"--seq-length {args.seq_length} x --micro-batch-size {args.micro_batch_size}"
        )
        raise ValueError(
            f"{length}: one micro-batch needs at least {need / gib:.1f} GiB per rank ({what}), more "
            f"than the {have / gib:.1f} GiB of {where}; shorten it, or raise TP / CP / PP"
        )


def vision_defaults(given, world: int) -> dict:
    """``args_defaults`` for megatron's parse: VISION_TP unset under ``--vision-nproc`` is its default
    (``vision_ranks.layout.default_vision_tp``) before megatron prints the arguments, not after."""
    from ..vision_ranks.layout import default_vision_tp

    if given.vision_nproc and not 0 < given.vision_nproc < world:
        raise ValueError(
            f"--vision-nproc {given.vision_nproc}: of the {world} ranks it must leave at least one to the "
            "language model (run_qwen35_vl.sh: set VISION_NPROC, which sizes NPROC too)"
        )
    if not given.vision_nproc or given.vision_tensor_parallel_size is not None:
        return {}
    return {
        "vision_tensor_parallel_size": default_vision_tp(
            world,
            given.tensor_model_parallel_size,
            given.context_parallel_size,
            given.pipeline_model_parallel_size,
            given.vision_nproc,
        )
    }


def check_vision_layout(args, vision_heads: int, world: int | None = None) -> None:
    """The vision tower's own layout (``vision_ranks/layout.py``), refused by flag before any
    process group exists. ``world``: every rank, the vision tower's own included (megatron's
    ``args.world_size`` counts the language model's). Under ``--vision-nproc`` an unset
    ``--vision-tensor-parallel-size`` takes its default here (``vision_ranks.layout.default_vision_tp``)."""
    from ..vision_ranks.layout import plan

    world, tp, cp, pp = (
        world or args.world_size,
        args.tensor_model_parallel_size,
        args.context_parallel_size,
        args.pipeline_model_parallel_size,
    )
    vars(args).update(vision_defaults(args, world))  # every later reader sees the default
    vtp = args.vision_tensor_parallel_size or tp
    plan(world, tp, cp, pp, vtp, args.vision_nproc, vision_heads, vp=args.virtual_pipeline_model_parallel_size or 1)
    if args.vision_nproc:
        _check_separate_ranks(args)
    if (vtp != tp or args.vision_nproc) and args.use_distributed_optimizer and args.dist_ckpt_optim_dp_reshardable:
        own = f"--vision-nproc {args.vision_nproc}" if args.vision_nproc else f"--vision-tensor-parallel-size {vtp}"
        raise ValueError(
            f"--dist-ckpt-optim-dp-reshardable with {own}: that format numbers optimizer shards by "
            "data-parallel group only, and the vision tower's would claim the language model's; keep "
            "the default (fully reshardable)"
        )


def _check_separate_ranks(args) -> None:
    """What this build runs of the tower on ranks of its own (vision_ranks/groups.py)."""
    k = f"--vision-nproc {args.vision_nproc}"
    if not args.use_distributed_optimizer:
        raise ValueError(
            f"{k} needs --use-distributed-optimizer: its gradient norm is summed over the world's "
            "shards, one module's on each rank"
        )
    if (args.save or args.load) and args.ckpt_format != "torch_dist":
        raise ValueError(
            f"--ckpt-format {args.ckpt_format} with {k}: only torch_dist checkpoints hold the two "
            "modules' shards apart (the other formats name their files by TP and PP rank, which "
            "a vision rank and a language rank share); keep the default torch_dist"
        )
    if not args.calculate_per_token_loss:
        raise ValueError(
            f"{k} needs --calculate-per-token-loss (the run script's default): the tower's gradients "
            "are scaled by the language model's token count"
        )


def check_fsdp(args) -> None:
    """What Megatron-FSDP (``--use-megatron-fsdp``) does not run with here, among the training script's own
    flags, in one line naming the flag (the run script's settings are ``launcher/checks.fsdp``'s)."""
    if not getattr(args, "use_megatron_fsdp", False):
        return
    refused = (
        (args.ckpt_format != "fsdp_dtensor", f"--ckpt-format {args.ckpt_format}", "it saves fsdp_dtensor only"),
        (
            bool(args.vision_chunk_patches),
            f"--vision-chunk-patches {args.vision_chunk_patches}",
            FSDP_REFUSALS["vision_chunks"],
        ),
        (
            bool(args.gen_eval_interval),
            f"--gen-eval-interval {args.gen_eval_interval}",
            FSDP_REFUSALS["gen_eval"],
        ),
    )
    for bad, flag, why in refused:
        if bad:
            raise ValueError(f"--use-megatron-fsdp with {flag}: {why}")


def check_resume_lr(args) -> None:
    """megatron restores each optimizer group's learning rate with the optimizer state and matches
    the groups by it, so a resume with another ``--lr`` / ``--min-lr`` dies with "Could not find
    parameter group with key". Say what to do instead, before loading."""
    if not args.load or args.finetune or args.no_load_optim or not os.path.isfile(os.path.join(args.load, TRACKER)):
        return
    stored = stored_args(checkpoint_directory(args.load))
    if stored is None or not hasattr(stored, "lr"):
        return
    was, now = (stored.lr, stored.min_lr), (args.lr, args.min_lr)
    if was != now:
        raise ValueError(
            f"--lr {args.lr} --min-lr {args.min_lr}: the checkpoint under --load {args.load} trained with "
            f"--lr {stored.lr} --min-lr {stored.min_lr}, which its optimizer state keeps; resume with "
            f"those (LR={stored.lr}), or start from its weights with a fresh optimizer "
            f"(CKPT_LOAD={args.load} instead of CKPT_RESUME)"
        )


def check_finished_run(args) -> None:
    """A resume from a checkpoint already at ``--train-iters`` has nothing to train; megatron's data
    sampler would stop every rank with an assertion ("no samples left to consume")."""
    if not args.load or args.finetune or not args.train_iters or not os.path.isdir(args.load):
        return
    done = latest_iteration(args.load)
    if done is not None and done >= args.train_iters:
        raise ValueError(
            f"iteration {done} {'=' if done == args.train_iters else '>'} --train-iters {args.train_iters} "
            f"(TRAIN_ITERS), the checkpoint under --load {args.load}: nothing to train; raise TRAIN_ITERS to continue"
        )


def stop_at_first_nan(args, given: dict[str, str]) -> None:
    """megatron's default ``--rerun-mode validate_results`` skips the check on the first iteration
    of every start and, on a NaN, re-saves the last checkpoint with its rerun state and exits to be
    restarted on another GPU. This playground stops at the first NaN gradient instead, before the
    step and with nothing saved for it (``--rerun-mode`` given on the command line wins)."""
    if "rerun_mode" not in given:
        args.rerun_mode = "disabled"


_NAN = re.compile(r"iteration (\d+): Unexpected result .* \(message='([^']*)'\)")


def step_in_progress() -> int | None:
    """The iteration whose step is running: the training loop's own count (None outside the loop)."""
    from megatron.training import global_vars

    current = getattr(global_vars._GLOBAL_ARGS, "curr_iteration", None)
    return None if current is None else current + 1


def last_checkpoint(args) -> str:
    """Where a stopped run resumes from, in words."""
    latest = latest_iteration(args.save) if args.save and os.path.isdir(args.save) else None
    return (
        f"the last checkpoint is iteration {latest} in {args.save}" if latest is not None else "no checkpoint was saved"
    )


def one_line(err: BaseException, args) -> str | None:
    """The one-line report of a failure during training, or None for one to propagate as it is."""
    found = _NAN.search(str(err)) if isinstance(err, RuntimeError) else None
    if found is None:
        return None
    iteration, what = found.groups()
    # megatron's message counts one too many after a start (its rerun counter is reset to the
    # start iteration and then incremented before the step); the training loop's own count is exact
    iteration = step_in_progress() or iteration
    kept = last_checkpoint(args)
    return (
        f"iteration {iteration}: {what}; the run stopped before the optimizer step and saved nothing "
        f"for it: {kept} (lower the LR, or look for a bad batch, then resume)"
    )
