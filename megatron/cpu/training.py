"""``pretrain_cpu``: megatron.training.pretrain's contract (same providers, forward step and
parsed args) on a host without a GPU.

One iteration: ``num_microbatches = GBS / (MBS * DP)`` forward/backward passes accumulate
summed token losses into megatron-core DDP's grad buffers; ``finalize_model_grads`` reduces
them over DP and divides by the global count of trained tokens (per-token loss); the grad norm
is taken over unique parameter shards (see ``grad_norm``), clipped, and AdamW steps with the
megatron-core LR scheduler advanced by GBS samples.
"""

from __future__ import annotations

import math
import time

import torch

from .checkpointing import load_checkpoint, save_checkpoint
from .loop_setup import (build_optimizer, build_scheduler, init_distributed, refuse_unsupported, set_seeds,
                         validate_args_on_host)
from .reporting import Reporter


class _StatsTap:
    """Passes batches through, remembering the packing statistics the collate attached."""

    def __init__(self, iterator):
        self.iterator, self.real, self.padded, self.flops = iterator, 0, 0, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.iterator)
        stats = batch.get("stats", {})
        self.real += stats.get("real_tokens", 0)
        self.padded += stats.get("padded_tokens", 0)
        self.flops += stats.get("model_flops", 0.0)
        return batch

    def take(self):
        out, self.real, self.padded, self.flops = (self.real, self.padded, self.flops), 0, 0, 0.0
        return out


def grad_norm(params) -> float:
    """L2 norm of the full gradient, each element counted once across the world.

    A rank adds the squares of grads it owns (TP duplicates only on TP rank 0); a world
    all-reduce then counts every dense shard once per DP x CP replica and every expert shard
    once per expert-DP replica, so those factors are divided out."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    sums = torch.zeros(2, dtype=torch.float64)
    for p in params:
        if p.grad is None or not param_is_not_tensor_parallel_duplicate(p):
            continue
        sums[0 if getattr(p, "allreduce", True) else 1] += p.grad.double().pow(2).sum()
    torch.distributed.all_reduce(sums)
    dense_replicas = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    expert_replicas = parallel_state.get_expert_data_parallel_world_size()
    return math.sqrt(sums[0].item() / dense_replicas + sums[1].item() / expert_replicas)


def _all_reduce_dp(values: list[float], with_context_parallel: bool = True) -> list[float]:
    """Sum over data-parallel ranks, and over CP ranks unless ``with_context_parallel`` is False:
    losses are per CP rank (each holds part of every sample), while the collate's batch
    statistics are the same on every rank of a CP group (they draw the same micro-batches)."""
    from megatron.core import parallel_state

    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t, group=parallel_state.get_data_parallel_group(with_context_parallel))
    return t.tolist()


def take_mtp_losses(num_micro: int) -> dict[str, float]:
    """Per-layer MTP losses of the last step (mean over micro-batches and data-parallel ranks),
    read from megatron-core's tracker, which is then cleared. The tracker's own reduction
    averages with ReduceOp.AVG, which gloo does not have."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    if "loss_values" not in tracker:
        return {}
    values = tracker["loss_values"].double() / num_micro
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    torch.distributed.all_reduce(values, group=group)
    values /= torch.distributed.get_world_size(group)
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    return {f"mtp_{i + 1} loss": v for i, v in enumerate(values.tolist())}


def _micro_batches(args) -> int:
    from megatron.core import parallel_state

    per_step = args.micro_batch_size * parallel_state.get_data_parallel_world_size()
    if args.global_batch_size % per_step:
        raise SystemExit(f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
                         f"{args.micro_batch_size} x data-parallel size {per_step // args.micro_batch_size}")
    return args.global_batch_size // per_step


def train_step(model, optimizer, forward_step_func, data_iterator, num_micro: int, iteration: int):
    from megatron.core.distributed import finalize_model_grads

    model.zero_grad_buffer()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), dtype=torch.float64)
    tokens = torch.zeros((), dtype=torch.int)
    for _ in range(num_micro):
        output, loss_func = forward_step_func(data_iterator, model)
        loss, n_tokens, report = loss_func(output)
        loss.backward()
        loss_sum += report["lm loss"][0].double()
        tokens += n_tokens
    total_loss, total_tokens = _all_reduce_dp([loss_sum.item(), float(tokens)])
    if not math.isfinite(total_loss):
        raise FloatingPointError(f"lm loss is {total_loss} at iteration {iteration + 1}; stopping without "
                                 "writing a checkpoint (the last saved one is intact)")
    finalize_model_grads([model], num_tokens=tokens.clone())
    for p in model.parameters():
        if p.requires_grad:
            p.grad = p.main_grad
    return total_loss, total_tokens


def clip_and_step(args, model, optimizer, scheduler) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    norm = grad_norm(params)
    if not math.isfinite(norm):
        raise FloatingPointError(f"grad norm is {norm}; stopping without writing a checkpoint")
    if args.clip_grad and args.clip_grad > 0 and norm > args.clip_grad:
        for p in params:
            p.grad.mul_(args.clip_grad / (norm + 1e-6))
    optimizer.step()
    scheduler.step(increment=args.global_batch_size)
    return norm


def evaluate(args, model, forward_step_func, valid_iterator, num_micro: int) -> float:
    model.eval()
    loss_sum = tokens = 0.0
    with torch.no_grad():
        for _ in range(args.eval_iters * num_micro):
            output, loss_func = forward_step_func(valid_iterator, model)
            _, n_tokens, report = loss_func(output)
            loss_sum += report["lm loss"][0].item()
            tokens += float(n_tokens)
    model.train()
    args.consumed_valid_samples += args.eval_iters * args.global_batch_size
    total_loss, total_tokens = _all_reduce_dp([loss_sum, tokens])
    return total_loss / max(total_tokens, 1.0)


def pretrain_cpu(datasets_provider, model_provider, forward_step_func, extra_args_provider=None, args_defaults=None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.training.arguments import parse_args
    from megatron.training.global_vars import set_args

    args = parse_args(extra_args_provider)
    for key, value in (args_defaults or {}).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    refuse_unsupported(args)
    validate_args_on_host(args)
    args.calculate_per_token_loss = True  # loss = sum / tokens over the global batch, as documented
    set_args(args)
    init_distributed(args)
    set_seeds(args.seed)
    rank = torch.distributed.get_rank()
    is_logging_rank = rank == torch.distributed.get_world_size() - 1  # megatron logs on the last rank

    module = model_provider(pre_process=True, post_process=True)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    model = DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)
    optimizer = build_optimizer(args, model)
    scheduler = build_scheduler(args, optimizer)
    args.consumed_train_samples = args.consumed_valid_samples = 0
    iteration = load_checkpoint(args, module, optimizer, scheduler) if args.load else 0
    args.iteration = iteration

    num_micro = _micro_batches(args)
    eval_runs = args.train_iters // args.eval_interval + 1 if args.eval_interval else 0
    num_samples = (args.train_iters * args.global_batch_size,
                   args.eval_iters * eval_runs * args.global_batch_size, args.eval_iters * args.global_batch_size)
    train_iterator, valid_iterator, _ = datasets_provider(num_samples)
    train_iterator = _StatsTap(train_iterator)
    reporter = Reporter(args, iteration, is_logging_rank)
    if is_logging_rank:
        n_params = sum(p.numel() for p in module.parameters())
        print(f"CPU training loop: {n_params / 1e6:.2f} M parameters on this rank, world size "
              f"{torch.distributed.get_world_size()}, {num_micro} micro-batch(es) per step, iterations "
              f"{iteration} -> {args.train_iters}", flush=True)
    model.train()
    saved = False
    try:
        while iteration < args.train_iters:
            loss_sum, tokens = train_step(model, optimizer, forward_step_func, train_iterator, num_micro, iteration)
            norm = clip_and_step(args, model, optimizer, scheduler)
            iteration += 1
            args.iteration = iteration
            args.consumed_train_samples += args.global_batch_size
            real, padded, flops = _all_reduce_dp(list(train_iterator.take()), with_context_parallel=False)
            reporter.train_step(iteration, loss_sum, tokens, norm, optimizer.param_groups[0]["lr"], int(real), int(padded),
                                extra=take_mtp_losses(num_micro),
                                # summed over DP ranks = the global batch's model FLOPs, shared by all devices
                                flops_per_device=flops / torch.distributed.get_world_size())
            side_work = time.perf_counter()
            if args.eval_interval and valid_iterator is not None and iteration % args.eval_interval == 0:
                reporter.validation(iteration, evaluate(args, model, forward_step_func, valid_iterator, num_micro))
            saved = bool(args.save and args.save_interval and iteration % args.save_interval == 0)
            if saved:
                save_checkpoint(args, iteration, module, optimizer, scheduler)
            reporter.exclude(time.perf_counter() - side_work)
            if args.exit_interval and iteration % args.exit_interval == 0:
                break  # megatron.training semantics: stop here (saving first), resume later
        if args.save and not saved:
            save_checkpoint(args, iteration, module, optimizer, scheduler)
    finally:
        reporter.close()
    return model
