"""The training, validation and test iterators of one rank, for ``megatron.training.pretrain``.

Each rank builds its own (``is_distributed``): the provider of ``--dataset-provider`` makes the
splits, the collate packs micro-batches (THD or padded, ``data/collate.py``), the token-budget plan
fills rows (``data/token_budget.py``), and the iterators continue from the checkpoint's position
(``checkpoint/plan_state.py``, ``checkpoint/loader_state.py``). With pipeline parallelism every stage
draws the same micro-batches and keeps what it reads (``PackedBatch.for_stage``); with the vision
tower on ranks of its own, those ranks read the pixels of the language replicas they serve.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, SupportsInt

import torch
from megatron.core import parallel_state

from examples.multimodal_dev.arguments import OWN_DATA_OPTIONS, PATCH_BUDGET_OPTIONS, VIDEO_OPTIONS, megatron_args
from examples.multimodal_dev.checkpoint import loader_state, plan_state
from examples.multimodal_dev.console import say
from examples.multimodal_dev.data import get_dataset_provider
from examples.multimodal_dev.data.batch import PackedBatch, PromptBatch, ServedBatches, StageInput, to_megatron
from examples.multimodal_dev.data.collate import Collator, pad_multiple_for
from examples.multimodal_dev.data.loader import build_iterator
from examples.multimodal_dev.data.sample import DataError, VisionTokens
from examples.multimodal_dev.data.token_budget import plan_factory
from examples.multimodal_dev.model_provider import model_shape
from examples.multimodal_dev.training import gen_eval
from examples.multimodal_dev.training.throughput import batch_flops
from examples.multimodal_dev.vision_ranks import groups as vision_ranks

# (train, valid, test): an iterator of micro-batches each, None for a split the data has not
Iterators = tuple[Iterator | None, Iterator | None, Iterator | None]


def data_path_value(args: argparse.Namespace) -> str | None:
    """megatron's ``--data-path`` takes several words; the providers read one value (jsonl: a
    comma-separated list, each with an optional ``:weight``), so the words are joined for jsonl and
    refused for the others rather than silently reading the first."""
    if not args.data_path:
        return None
    if len(args.data_path) == 1:
        return args.data_path[0]
    if args.dataset_provider == "jsonl":
        return ",".join(args.data_path)
    raise ValueError(
        f"--data-path {' '.join(args.data_path)}: --dataset-provider {args.dataset_provider} reads one source"
    )


def check_tokens_agree(datasets: Iterable[Any], tokens: VisionTokens, args: argparse.Namespace) -> None:
    """A processor whose vision token ids are not the model's would train placeholders the model
    never replaces with vision features: refuse it by name."""
    for dataset in datasets:
        theirs = getattr(dataset, "tokens", None)
        if theirs is not None and theirs != tokens:
            raise DataError(
                f"--hf-processor-path {args.hf_processor_path!r}: its vision tokens {theirs} are not the "
                f"model's {tokens} (--model-variant {args.model_variant}); use the processor released "
                "with the model, or HF_CONFIG for a model built around this processor"
            )


def datasets_provider(train_val_test_num_samples: Sequence[SupportsInt], vp_stage: int | None = None) -> Iterators:
    """(train, valid, test) iterators of collated micro-batches for this data-parallel rank; with
    pipeline parallelism, for one (virtual) stage: every stage draws the same micro-batches and
    keeps only what it reads (``PackedBatch.for_stage``: no pixels after the first stage)."""
    args = megatron_args()
    shape = model_shape()
    tokens = VisionTokens.from_shape(shape)
    budget = args.packed_seq_length if args.packing == "tokens" else None
    build_splits = _split_builder(args, shape, tokens, train_val_test_num_samples, budget)
    datasets = build_splits()
    check_tokens_agree(datasets, tokens, args)
    pad_multiple = pad_multiple_for(args.context_parallel_size, args.tensor_model_parallel_size, args.sequence_parallel)
    collate = Collator(tokens, packed=args.use_packed_sequence, pad_multiple=pad_multiple, row_length=budget)
    stage, dp_rank, dp_size, served = _stage_and_ranks(vp_stage)
    common = dict(
        micro_batch_size=args.micro_batch_size,
        dp_size=dp_size,
        collate_fn=(
            PromptBatch.collate  # GRPO's answers are drawn and packed in the training step (forward_step.py)
            if args.train_mode == "grpo"
            else functools.partial(_collate_for_stage, collate, shape, stage, args.train_mode == "dpo")
        ),
        num_workers=args.num_workers,
    )
    train = dict(common)
    streams = hasattr(datasets[0], "build_iterator")  # energon: each rank's loader packs its own rows
    if budget and not streams:
        common["plan_fn"] = plan_factory(
            shape, budget, args.global_batch_size, dp_size, pad_multiple, args.packing_window
        )
        train["plan_fn"] = functools.partial(_resumed_plan, common["plan_fn"], args)
    _validation_split(datasets[1], args)
    # under fan-out a vision replica reads the micro-batches of each language replica it serves; a stream
    # holds one position, so each replica's from splits of its own
    replicas = [
        _replica_iterators(
            build_splits() if q and streams else datasets, args, dp_rank + q, budget, pad_multiple, common, train
        )
        for q in range(served)
    ]
    if served == 1:
        return replicas[0]
    train, valid, test = (_served_together([r[i] for r in replicas]) for i in range(3))
    return train, valid, test


def _split_builder(
    args: argparse.Namespace, shape, tokens: VisionTokens, num_samples: Sequence[SupportsInt], budget: int | None
) -> Callable[[], tuple]:
    """The dataset provider of ``--dataset-provider`` with this run's settings: called, it builds the
    (train, valid, test) splits (again, for each vision replica's own stream under fan-out)."""
    counts = tuple(int(n) for n in num_samples)
    if budget:  # megatron counts rows; a row holds at most `budget` conversations (the stream is virtual)
        counts = tuple(n * budget for n in counts)
    return functools.partial(
        get_dataset_provider(args.dataset_provider),
        tokens=tokens,
        vocab_size=shape.text.vocab_size,
        patch_dim=shape.vision.patch_dim,
        seq_length=args.seq_length,
        num_samples=counts,
        seed=args.seed,
        data_path=data_path_value(args),
        hf_processor_path=args.hf_processor_path,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
        mean_text_tokens=args.mock_text_tokens,
        valid_data_path=args.eval_data_path,
        # DATASET=jsonl, checked
        **({"preference_pairs": True} if args.train_mode == "dpo" else {}),
        **({"referenced_prompts": True} if args.train_mode == "grpo" else {}),
        **{
            name: getattr(args, name)
            for name in OWN_DATA_OPTIONS + VIDEO_OPTIONS + PATCH_BUDGET_OPTIONS
            if name != "eval_data_path"
        },
    )


def _stage_and_ranks(vp_stage: int | None) -> tuple[tuple[StageInput, bool], int, int, int]:
    """(what this stage reads and whether it is the last, its data-parallel rank and size, the
    language replicas it serves): with the vision tower on ranks of its own, pixels for the tower's
    ranks, the rest for the language model's (grids too under fan-in, to put the shares in order),
    each reading the micro-batches of the language replicas it serves."""
    first = StageInput.of(parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage))
    stage = (first, parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))
    separate = vision_ranks.active()
    if not separate:
        return stage, parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(), 1
    grids = separate.fan_in > 1 and first is StageInput.PIXELS
    if separate.on_vision:
        stage = (StageInput.PIXELS, False)
    else:
        stage = (StageInput.GRIDS if grids else StageInput.HIDDEN, stage[1])
    return stage, separate.data_rank, separate.data_size, separate.fan_out


def _validation_split(valid, args: argparse.Namespace) -> None:
    """Without a validation split evaluation is off, and generated answers have nothing to answer."""
    if valid is None:
        if args.gen_eval_interval:
            raise DataError(
                f"--gen-eval-interval {args.gen_eval_interval}: the data has no validation split to answer "
                "(--eval-data-path or --valid-fraction, with --eval-iters above 0)"
            )
        _no_validation(args)
    elif args.gen_eval_interval:
        gen_eval.remember_validation(valid)


def _replica_iterators(datasets, args, dp_rank: int, budget, pad_multiple: int, common: dict, train: dict) -> Iterators:
    """(train, valid, test) iterators of data-parallel rank ``dp_rank``'s micro-batches."""
    streams = hasattr(datasets[0], "build_iterator")  # energon: each rank's loader packs its own rows
    if budget and streams:
        for split in datasets:
            if split is not None:
                split.pack_rows(budget, pad_multiple)
    if streams:  # its position comes from the checkpoint
        _resume_stream(datasets[0], args, dp_rank, common["dp_size"])
    return (
        build_iterator(datasets[0], args.consumed_train_samples, dp_rank=dp_rank, **train),
        build_iterator(datasets[1], args.consumed_valid_samples, dp_rank=dp_rank, cyclic=True, **common),
        build_iterator(datasets[2], 0, dp_rank=dp_rank, **common),
    )


def _served_together(iterators: list[Iterator | None]) -> Iterator | None:
    """One micro-batch of each served language replica at a time, ``ServedBatches``
    (forward_step.vision_features)."""
    if any(it is None for it in iterators):
        return None
    return (ServedBatches(list(batches)) for batches in zip(*iterators))


def _no_validation(args) -> None:
    """megatron.training 0.19.2 decides whether to evaluate from the list it wraps the validation
    iterator in (``[None]`` is truthy), not from the iterator, and would evaluate on None at the
    first ``--eval-interval``; ``--eval-iters`` is its only other input, so set it to 0. It decides
    the test evaluation from the same flag, so that is off too."""
    if args.eval_iters and not args.full_validation:
        args.eval_iters = 0
        say(
            "the data has no validation split: evaluation is off (--eval-iters 0; "
            "megatron.training uses it for the test split too)"
        )


def _resumed_plan(plan_fn, args, dataset, cyclic):
    """The training plan, continued from the checkpoint the run resumed from (checkpoint/plan_state.py)."""
    plan = plan_fn(dataset, cyclic)
    line = plan_state.resume(plan, args.load, args.iteration, args.consumed_train_samples)
    if line and not plan_state.tracked():
        say(line)
    plan_state.track(plan)
    return plan


def _resume_stream(split, args, dp_rank: int, dp_size: int) -> None:
    """The training stream continued from this DP rank's state in the checkpoint
    (checkpoint/loader_state.py); a restart is said by each DP rank it happens on."""
    settings = split.stream_settings(args.micro_batch_size, dp_rank, dp_size, args.num_workers)
    line = loader_state.resume(split, args.load, args.iteration, args.consumed_train_samples, settings)
    says = torch.distributed.get_rank() == 0 or ("restarts" in (line or "") and loader_state.first_of_dp_rank())
    if line and says and not loader_state.tracked():
        say(line, every_rank=True)
    loader_state.track(split)


def _collate_for_stage(
    collate, shape, stage: tuple[StageInput, bool], reference_forward: bool, samples: list
) -> PackedBatch:
    """The collate, plus the micro-batch's training FLOPs on its real tokens (for the log),
    without the tensors the (first layer's input, post_process) ``stage`` never reads."""
    batch = collate(samples)
    flops = batch_flops(shape, batch)
    # DPO runs the reference's forward too (forward_step.dpo_step): its work is the model's as well
    batch.stats.model_flops = flops.training + (flops.forward if reference_forward else 0.0)
    return batch.for_stage(*stage)


DatasetsProvider = Callable[..., Iterators]


def marked_distributed(provider: DatasetsProvider, value: bool = True) -> DatasetsProvider:
    """megatron.training builds the iterators on every rank where the provider function's
    ``is_distributed`` says so (else on TP rank 0, broadcast to the others): the attribute, set."""
    setattr(provider, "is_distributed", value)
    return provider


marked_distributed(datasets_provider)  # every rank builds its own iterators (no TP broadcast)


def metered(provider: DatasetsProvider, meter: Any) -> DatasetsProvider:
    """``provider`` whose training iterator reports each micro-batch's model FLOPs to ``meter``
    (one iterator a rank: virtual pipeline stages draw the same micro-batches again)."""

    def datasets(train_val_test_num_samples: Sequence[int], vp_stage: int | None = None) -> Iterators:
        train, valid, test = provider(train_val_test_num_samples, vp_stage=vp_stage)
        # the tower's own ranks draw their language replica's micro-batches again: they add no FLOPs
        counted = not ((layout := vision_ranks.active()) is not None and layout.on_vision)
        return (meter.tap(train, counted) if vp_stage in (None, 0) else train), valid, test

    return marked_distributed(datasets, getattr(provider, "is_distributed", False))


def plain_for_megatron(provider: DatasetsProvider) -> DatasetsProvider:
    """``provider`` whose iterators hand megatron plain dicts (``batch.to_megatron`` says why)."""

    def datasets(train_val_test_num_samples: Sequence[int], vp_stage: int | None = None) -> Iterators:
        train, valid, test = (
            None if it is None else map(to_megatron, it)
            for it in provider(train_val_test_num_samples, vp_stage=vp_stage)
        )
        return train, valid, test

    return marked_distributed(datasets, getattr(provider, "is_distributed", False))
