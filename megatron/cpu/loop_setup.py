"""Start-up of the CPU training loop: refuse what it cannot do, initialise gloo and the
megatron-core process groups, and build the optimizer and LR scheduler from the parsed args.

Every flag below changes what megatron.training would do; silently ignoring one would train
something other than what was asked, so each is refused by name with the reason.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

# (predicate on args, flag text, reason)
UNSUPPORTED = [
    (lambda a: a.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size",
     "megatron-core's pipeline schedules allocate on CUDA"),
    (lambda a: a.num_experts and a.moe_token_dispatcher_type != "allgather", "--moe-token-dispatcher-type",
     "only the allgather dispatcher is validated on gloo (the alltoall one needs CUDA streams)"),
    (lambda a: a.use_distributed_optimizer, "--use-distributed-optimizer",
     "megatron-core's distributed optimizer needs CUDA; the CPU loop uses torch AdamW"),
    (lambda a: a.fp16 or a.bf16, "--fp16/--bf16", "the CPU loop trains in fp32"),
    (lambda a: a.optimizer != "adam", "--optimizer", "the CPU loop implements AdamW only"),
    (lambda a: a.ckpt_format != "torch_dist", "--ckpt-format", "the CPU loop saves torch_dist checkpoints"),
    (lambda a: a.train_samples is not None, "--train-samples", "the CPU loop is iteration based: use --train-iters"),
    (lambda a: a.rampup_batch_size is not None, "--rampup-batch-size", "batch-size ramp-up is not implemented"),
    (lambda a: a.overlap_grad_reduce or a.overlap_param_gather, "--overlap-grad-reduce/--overlap-param-gather",
     "communication overlap needs CUDA streams"),
    (lambda a: getattr(a, "async_save", False), "--async-save", "checkpoints are written synchronously"),
    (lambda a: a.recompute_granularity is not None, "--recompute-granularity", "activation recomputation is not wired"),
    (lambda a: getattr(a, "use_torch_fsdp2", False) or getattr(a, "use_megatron_fsdp", False),
     "--use-torch-fsdp2/--use-megatron-fsdp", "FSDP is not supported on the CPU path"),
    (lambda a: a.exit_duration_in_mins is not None, "--exit-duration-in-mins",
     "use --exit-interval or --train-iters"),
    (lambda a: a.dataloader_type not in (None, "single", "external"), "--dataloader-type",
     "the playground's iterators follow megatron's 'single' sampler"),
]


def refuse_unsupported(args) -> None:
    refused = [f"{flag} ({reason})" for pred, flag, reason in UNSUPPORTED if pred(args)]
    if refused:
        raise SystemExit("the CPU training loop does not support: " + "; ".join(refused))


def validate_args_on_host(args) -> None:
    """megatron.training's validate_args. With TP or CP > 1 it asks for the CUDA device's
    architecture (for the CUDA_DEVICE_MAX_CONNECTIONS rule, meaningless on CPU); answer as a
    device that has no such rule."""
    from megatron.training import arguments

    original = arguments.get_device_arch_version
    arguments.get_device_arch_version = lambda: 10
    try:
        arguments.validate_args(args, {})
    finally:
        arguments.get_device_arch_version = original


def init_distributed(args) -> None:
    """gloo from torchrun's environment (or a single process), then megatron-core's groups."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        torch.distributed.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)),
                                             world_size=int(os.environ.get("WORLD_SIZE", 1)))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size, pipeline_model_parallel_size=1,
        context_parallel_size=args.context_parallel_size, expert_model_parallel_size=args.expert_model_parallel_size,
    )


def set_seeds(seed: int) -> None:
    """Same seeds on every rank, as megatron.training does with PP = 1; the model-parallel RNG
    tracker then derives per-TP-rank streams."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def build_optimizer(args, model):
    """AdamW; like megatron.training, no weight decay on biases and 1-D (norm) parameters."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() > 1 else no_decay).append(p)
    groups = [{"params": decay, "wd_mult": 1.0, "lr_mult": 1.0},
              {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_eps, weight_decay=args.weight_decay)


def build_scheduler(args, optimizer):
    """megatron-core's scheduler, stepped in samples exactly as megatron.training does."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = args.global_batch_size
    decay_iters = args.lr_decay_iters or args.train_iters
    warmup_steps = (args.lr_warmup_fraction * decay_iters * gbs if args.lr_warmup_fraction is not None
                    else args.lr_warmup_iters * gbs)
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=decay_iters * gbs, lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay, end_wd=args.end_weight_decay, wd_incr_steps=args.train_iters * gbs,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )
