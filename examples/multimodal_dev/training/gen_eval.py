"""Evaluation by generation while training (``--gen-eval-interval N``): every N iterations, the model
answers ``--gen-eval-samples`` validation conversations (``generation/decode.py``, greedy, at most
``--gen-eval-max-new-tokens`` each) and the answers are scored against the conversations' own last
assistant turns (``evaluation/scores.py``).

The conversations are the first ``--gen-eval-samples`` records of the validation split, read as
prompts by the provider (``prompt(index)``: JSONL and CORD-V2; a record that cannot be read is
skipped and counted), dealt round-robin to the data-parallel replicas. Every rank runs the same
number of batches and decoding steps (a replica with fewer prompts repeats its last one, unscored):
ranks that share experts (EP) or heads (TP) step together. The replicas' score sums are all-reduced,
so every rank holds the same metrics: the last rank logs them (one line; the metrics file, as a
record of its own ``{"gen_eval_iteration": N, ...}``; TensorBoard ``gen-eval/*``), and rank 0 writes
every answer to ``{--save}/gen_eval/iter_{N:07d}.jsonl`` (after a line of the metrics).

Training is not changed by it: the model is put back in training mode, no random stream is drawn
(greedy decoding), the training data iterators are not touched, and the interval timer is stopped
meanwhile, as megatron's own evaluation does. A test holds the loss curve to the run without it,
bitwise.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..data.processor import answer_end_ids, answer_text
from ..data.sample import BadSample, DataError
from ..evaluation.scores import Scores

_VALIDATION = {}  # the validation dataset the run's provider built (``remember_validation``)


_NEEDS_INTERVAL = ("gen_eval_samples", "gen_eval_max_new_tokens", "gen_eval_batch_size")


def check(args, typed: dict[str, str] | None = None) -> None:
    """One line for a setting evaluation by generation does not take, before any process group exists.
    ``typed``: dest -> the option the user typed (a ``--gen-eval-*`` setting without
    ``--gen-eval-interval`` would be ignored: refused, as a LoRA alpha without a rank is)."""
    if not args.gen_eval_interval:
        stray = [flag for dest, flag in (typed or {}).items() if dest in _NEEDS_INTERVAL]
        if stray:
            raise ValueError(
                f"{stray[0]} without --gen-eval-interval: evaluation by generation is off, so it would be "
                "ignored (set --gen-eval-interval N to evaluate every N iterations)"
            )
        return
    for flag, value, ok in (
        ("--gen-eval-interval", args.gen_eval_interval, args.gen_eval_interval > 0),
        ("--gen-eval-samples", args.gen_eval_samples, args.gen_eval_samples > 0),
        ("--gen-eval-max-new-tokens", args.gen_eval_max_new_tokens, args.gen_eval_max_new_tokens > 0),
        ("--gen-eval-batch-size", args.gen_eval_batch_size, args.gen_eval_batch_size > 0),
    ):
        if not ok:
            raise ValueError(f"{flag} {value}: must be at least 1")
    if args.gen_eval_max_new_tokens > args.seq_length:  # each answer's cache grows by a token a step
        raise ValueError(
            f"--gen-eval-max-new-tokens {args.gen_eval_max_new_tokens}: at most --seq-length {args.seq_length} "
            "(answers are decoded within the positions the run trains)"
        )
    if args.dataset_provider not in ("jsonl", "cord_v2"):
        raise ValueError(
            f"--gen-eval-interval with --dataset-provider {args.dataset_provider}: evaluation by generation "
            "reads conversations with answers (jsonl, cord_v2)"
        )
    for problem in layout_problems(args):
        raise ValueError(f"--gen-eval-interval {args.gen_eval_interval}: {problem}")


def layout_problems(args) -> list[str]:
    """What decoding does not run under, by flag."""
    problems = []
    if args.pipeline_model_parallel_size > 1:
        problems.append(
            f"generation runs with --pipeline-model-parallel-size 1, not {args.pipeline_model_parallel_size}"
        )
    if args.context_parallel_size > 1:
        problems.append(f"generation runs with --context-parallel-size 1, not {args.context_parallel_size}")
    if getattr(args, "vision_nproc", 0):
        problems.append("generation needs the vision tower on the language model's ranks (--vision-nproc 0)")
    return problems


def remember_validation(dataset) -> None:
    _VALIDATION["dataset"] = dataset


def evaluated_callbacks(original, run):
    """megatron.training's ``post_training_step_callbacks`` (after the iteration's log and evaluation)
    that also evaluates by generation every ``--gen-eval-interval`` iterations."""
    args = run.args

    def post_training_step_callbacks(model, optimizer, opt_param_scheduler, iteration, *rest, **kwargs):
        result = original(model, optimizer, opt_param_scheduler, iteration, *rest, **kwargs)
        if args.gen_eval_interval and iteration % args.gen_eval_interval == 0:
            _evaluate_between_steps(model, optimizer, iteration, args)
        return result

    return post_training_step_callbacks


def _evaluate_between_steps(model_chunks, optimizer, iteration: int, args) -> None:
    from megatron.training import get_tensorboard_writer, get_timers
    from megatron.training.training import (
        disable_forward_pre_hook,
        enable_forward_pre_hook,
        should_disable_forward_pre_hook,
    )
    from megatron.training.utils import print_rank_last

    timers = get_timers()
    timers("interval-time").stop()
    hooks = should_disable_forward_pre_hook(args)
    if hooks:  # the distributed optimizer's overlapped gather: the weights a forward would see
        disable_forward_pre_hook(model_chunks, optimizer=optimizer)
    was_training = [chunk.training for chunk in model_chunks]
    for chunk in model_chunks:
        chunk.eval()
    try:
        scores, answers, skipped = evaluate(model_chunks[0], args)
    finally:
        for chunk, mode in zip(model_chunks, was_training):
            chunk.train(mode)
        if hooks:
            enable_forward_pre_hook(model_chunks)
    means = scores.means()
    line = " | ".join(f"{name} {value:.4f}" for name, value in means.items())
    print_rank_last(
        f" generation eval at iteration {iteration} | {int(scores.sums['answers'])} answers"
        f"{f' ({skipped} records unreadable)' if skipped else ''} | {line} |"
    )
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if rank == world - 1:
        if getattr(args, "metrics_file", None):
            with open(args.metrics_file, "a") as f:
                f.write(
                    json.dumps({"gen_eval_iteration": iteration, **means, "answers": scores.sums["answers"]}) + "\n"
                )
        writer = get_tensorboard_writer()
        if writer is not None:
            for name, value in means.items():
                writer.add_scalar(f"gen-eval/{name}", value, iteration)
    everyone: list[Any] = [None] * world  # all_gather_object fills in each rank's answers
    torch.distributed.all_gather_object(everyone, answers)
    if rank == 0 and args.save:
        folder = os.path.join(args.save, "gen_eval")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"iter_{iteration:07d}.jsonl"), "w") as f:
            f.write(json.dumps({"iteration": iteration, **means}) + "\n")
            # the ranks of one replica hold the same answers: one copy each (tensor-parallel ranks are
            # consecutive in megatron's order; expert parallelism splits data-parallel ranks)
            replicas = everyone[:: args.tensor_model_parallel_size]
            for answer in sorted((a for part in replicas for a in part), key=lambda a: a["index"]):
                f.write(json.dumps(answer, ensure_ascii=False) + "\n")
    timers("interval-time", log_level=0).start(barrier=True)


@torch.no_grad()
def evaluate(model, args) -> tuple[Scores, list[dict], int]:
    """(this replica's scores all-reduced over data-parallel replicas, this replica's answers, records
    skipped as unreadable)."""
    from megatron.core import parallel_state

    from ..generation.decode import Prompt, generate

    dataset = _VALIDATION["dataset"]  # datasets_provider refuses --gen-eval-interval without a validation split
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    count = min(args.gen_eval_samples, dataset.num_source)
    per_replica = -(-count // dp_size)
    prompts, skipped = [], 0
    for index in range(dp_rank, count, dp_size):
        try:
            sample, reference = dataset.prompt(index)
        except (BadSample, DataError):
            skipped += 1
            continue
        if reference is not None:
            media = {k: v for k, v in sample.items() if k != "input_ids"}
            prompts.append((index, Prompt(sample["input_ids"].tolist(), **media), reference))
    processor = dataset.produce.processor
    end_ids = answer_end_ids(processor, dataset.produce.info)
    scores, answers = Scores(), []
    size = args.gen_eval_batch_size
    for first in range(0, per_replica, size):  # the same number of batches on every replica
        batch = prompts[first : first + size]
        scored = len(batch)
        if not batch:  # this replica has run out: repeat a prompt, unscored, to step with the others
            batch = prompts[-1:] or [(None, Prompt([end_ids[0]]), None)]
        done = generate(model, [p for _, p, _ in batch], args.gen_eval_max_new_tokens, end_ids)
        for (index, _, reference), tokens in list(zip(batch, done.tokens))[:scored]:
            prediction = answer_text(processor, tokens)
            scores.add(prediction, reference)
            answers.append({"index": index, "prediction": prediction, "reference": reference})
    device = next(model.parameters()).device  # NCCL reduces device tensors
    totals = torch.tensor(scores.vector() + [skipped], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    return Scores(totals[:-1].tolist()), answers, int(totals[-1])
