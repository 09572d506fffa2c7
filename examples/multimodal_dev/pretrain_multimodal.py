"""Train a vision-language model of MODEL_REGISTRY with Megatron-Core.

    PYTHONPATH=<repository root> torchrun --nproc-per-node N -m examples.multimodal_dev.pretrain_multimodal \
        <megatron flags> --model-arch qwen35_vl --model-variant tiny --dataset-provider mock ...

Every host runs ``megatron.training.pretrain``; on a host without CUDA, ``megatron.cpu`` first
makes megatron's CUDA assumptions hold there (gloo, CPU tensors, torch GatedDeltaNet kernels).
``run_qwen35_vl.sh`` at the repository root builds the full command line.
"""

from __future__ import annotations

import functools
import gc
import os

if __name__ == "__main__":  # a run: the imports make ~0.8M objects and little garbage; collecting as they go costs ~1 s
    gc.disable()  # main() turns collection back on, without those objects (gc.freeze)

from megatron.training import get_args

from examples.multimodal_dev import megatron_changes
from examples.multimodal_dev.arguments import OWN_DATA_OPTIONS, PATCH_BUDGET_OPTIONS, VIDEO_OPTIONS, add_multimodal_args
from examples.multimodal_dev.checkpoint import (
    loader_state,
    optimizer_format,
    plan_state,
    safety,
    save_guard,
    write_queue,
)
from examples.multimodal_dev.checkpoint.integrity import check_resumable
from examples.multimodal_dev.checkpoint.run_shape import check_checkpoint_matches, declared_shape, resolve_shape
from examples.multimodal_dev.data import get_dataset_provider
from examples.multimodal_dev.data.batch import PackedBatch, ServedBatches, StageInput, to_megatron
from examples.multimodal_dev.data.collate import Collator, pad_multiple_for
from examples.multimodal_dev.data.jsonl_source import check_data_path
from examples.multimodal_dev.data.loader import build_iterator
from examples.multimodal_dev.data.patch_budget import check_patch_budget_args
from examples.multimodal_dev.data.sample import DataError, VisionTokens
from examples.multimodal_dev.data.sources import resolve as resolve_source
from examples.multimodal_dev.data.token_budget import check_packing_args, plan_factory
from examples.multimodal_dev.forward_step import forward_step
from examples.multimodal_dev.models import get_model_entry
from examples.multimodal_dev.models.common.config_from_args import given_flags, megatron_parser
from examples.multimodal_dev.models.common.varlen_attention import describe_thd_kernels
from examples.multimodal_dev.models.megatron_args import with_model_shape
from examples.multimodal_dev.planner.pipeline_layout import stage_layers
from examples.multimodal_dev.training import gen_eval, run_checks
from examples.multimodal_dev.training.backend import (
    backend_of,
    check_attention_backend,
    check_backend,
    engine_defaults,
)
from examples.multimodal_dev.training.throughput import StepFlops, batch_flops
from examples.multimodal_dev.vision_ranks import groups as vision_ranks


@functools.lru_cache(maxsize=None)
def model_shape():
    return resolve_shape(get_args())


@functools.lru_cache(maxsize=None)
def model_configs():
    """(decoder, vision) TransformerConfigs: megatron's args with the shape laid over them."""
    args = get_args()
    configs_fn = get_model_entry(args.model_arch).load("configs_fn")
    return configs_fn(args, model_shape(), backend_of(args), given_flags(megatron_parser(add_multimodal_args)))


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """One pipeline stage (megatron.training's get_model calls it per virtual stage)."""
    args = get_args()
    entry = get_model_entry(args.model_arch)
    shape, backend = model_shape(), backend_of(args)
    separate = vision_ranks.active()  # the vision tower on ranks of its own: this rank builds one module
    if separate:
        for config in model_configs():  # the features' shapes vary by micro-batch; both modules' gradients
            config.variable_seq_lengths = True  # are finalised on their own groups, scaled by the world's tokens
            config.finalize_model_grads_func = vision_ranks.finalize_model_grads
    model = entry.load("build_fn")(
        shape,
        backend=backend,
        max_sequence_length=args.seq_length,
        configs=model_configs(),
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        module=separate and separate.role,
        groups=separate and separate.groups,
    )
    if separate and separate.fan_in > 1:  # several vision replicas serve one language replica
        if separate.on_vision:
            model.shares, model.share = separate.fan_in, separate.share
        else:
            model.received_shares = separate.fan_in
    if model.vision_model is not None:
        model.vision_model.chunk_patches = args.vision_chunk_patches
    for flag, part in (
        ("freeze_vision", model.vision_model),
        ("freeze_language", getattr(model, "language_model", None)),
    ):
        if getattr(args, flag) and part is not None:
            for p in part.parameters():
                p.requires_grad_(False)
    return model


def data_path_value(args) -> str | None:
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


def check_tokens_agree(datasets, tokens: VisionTokens, args) -> None:
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


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """(train, valid, test) iterators of collated micro-batches for this data-parallel rank; with
    pipeline parallelism, for one (virtual) stage: every stage draws the same micro-batches and
    keeps only what it reads (``PackedBatch.for_stage``: no pixels after the first stage)."""
    from megatron.core import parallel_state

    args = get_args()
    shape = model_shape()
    tokens = VisionTokens.from_shape(shape)
    build = get_dataset_provider(args.dataset_provider)
    num_samples = tuple(int(n) for n in train_val_test_num_samples)
    budget = args.packed_seq_length if args.packing == "tokens" else None
    if budget:  # megatron counts rows; a row holds at most `budget` conversations (the stream is virtual)
        num_samples = tuple(n * budget for n in num_samples)
    build_splits = functools.partial(
        build,
        tokens=tokens,
        vocab_size=shape.text.vocab_size,
        patch_dim=shape.vision.patch_dim,
        seq_length=args.seq_length,
        num_samples=num_samples,
        seed=args.seed,
        data_path=data_path_value(args),
        hf_processor_path=args.hf_processor_path,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
        mean_text_tokens=args.mock_text_tokens,
        valid_data_path=args.eval_data_path,
        **{
            name: getattr(args, name)
            for name in OWN_DATA_OPTIONS + VIDEO_OPTIONS + PATCH_BUDGET_OPTIONS
            if name != "eval_data_path"
        },
    )
    datasets = build_splits()
    check_tokens_agree(datasets, tokens, args)
    pad_multiple = pad_multiple_for(args.context_parallel_size, args.tensor_model_parallel_size, args.sequence_parallel)
    collate = Collator(tokens, packed=args.use_packed_sequence, pad_multiple=pad_multiple, row_length=budget)
    first = StageInput.of(parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage))
    stage = (first, parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))
    separate = vision_ranks.active()
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    served = 1
    if separate:  # pixels for the tower's ranks, the rest for the language model's (grids too under fan-in,
        # to put the shares in order), each reading the micro-batches of the language replicas it serves
        grids = separate.fan_in > 1 and first is StageInput.PIXELS
        stage = (
            (StageInput.PIXELS, False)
            if separate.on_vision
            else (StageInput.GRIDS if grids else StageInput.HIDDEN, stage[1])
        )
        dp_rank, dp_size, served = separate.data_rank, separate.data_size, separate.fan_out
    common = dict(
        micro_batch_size=args.micro_batch_size,
        dp_size=dp_size,
        collate_fn=functools.partial(_collate_for_stage, collate, shape, stage),
        num_workers=args.num_workers,
    )
    train = dict(common)
    streams = hasattr(datasets[0], "build_iterator")  # energon: each rank's loader packs its own rows
    if budget and not streams:
        common["plan_fn"] = plan_factory(
            shape, budget, args.global_batch_size, dp_size, pad_multiple, args.packing_window
        )
        train["plan_fn"] = functools.partial(_resumed_plan, common["plan_fn"], args)
    if datasets[1] is None:
        if args.gen_eval_interval:
            raise DataError(
                f"--gen-eval-interval {args.gen_eval_interval}: the data has no validation split to answer "
                "(--eval-data-path or --valid-fraction, with --eval-iters above 0)"
            )
        _no_validation(args)
    elif args.gen_eval_interval:
        gen_eval.remember_validation(datasets[1])
    # under fan-out a vision replica reads the micro-batches of each language replica it serves; a stream
    # holds one position, so each replica's from splits of its own
    replicas = [
        _replica_iterators(
            build_splits() if q and streams else datasets, args, dp_rank + q, budget, pad_multiple, common, train
        )
        for q in range(served)
    ]
    return replicas[0] if served == 1 else tuple(_served_together([r[i] for r in replicas]) for i in range(3))


def _replica_iterators(datasets, args, dp_rank: int, budget, pad_multiple: int, common: dict, train: dict):
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


def _served_together(iterators):
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
        if args.rank == 0:
            print(
                "pretrain_multimodal.py: the data has no validation split: evaluation is off (--eval-iters 0; "
                "megatron.training uses it for the test split too)",
                flush=True,
            )


def _resumed_plan(plan_fn, args, dataset, cyclic):
    """The training plan, continued from the checkpoint the run resumed from (checkpoint/plan_state.py)."""
    import torch

    plan = plan_fn(dataset, cyclic)
    line = plan_state.resume(plan, args.load, args.iteration, args.consumed_train_samples)
    if line and not plan_state.tracked() and torch.distributed.get_rank() == 0:
        print(f"pretrain_multimodal.py: {line}", flush=True)
    plan_state.track(plan)
    return plan


def _resume_stream(split, args, dp_rank: int, dp_size: int) -> None:
    """The training stream continued from this DP rank's state in the checkpoint
    (checkpoint/loader_state.py); a restart is said by each DP rank it happens on."""
    import torch

    settings = split.stream_settings(args.micro_batch_size, dp_rank, dp_size, args.num_workers)
    line = loader_state.resume(split, args.load, args.iteration, args.consumed_train_samples, settings)
    says = torch.distributed.get_rank() == 0 or ("restarts" in (line or "") and loader_state.first_of_dp_rank())
    if line and says and not loader_state.tracked():
        print(f"pretrain_multimodal.py: {line}", flush=True)
    loader_state.track(split)


def _collate_for_stage(collate, shape, stage: tuple[StageInput, bool], samples: list[dict]) -> PackedBatch:
    """The collate, plus the micro-batch's training FLOPs on its real tokens (for the log),
    without the tensors the (first layer's input, post_process) ``stage`` never reads."""
    batch = collate(samples)
    batch.stats.model_flops = batch_flops(shape, batch).training
    return batch.for_stage(*stage)


datasets_provider.is_distributed = True  # every rank builds its own iterators (no TP broadcast)


def metered(provider, meter):
    """``provider`` whose training iterator reports each micro-batch's model FLOPs to ``meter``
    (one iterator a rank: virtual pipeline stages draw the same micro-batches again)."""

    def datasets(train_val_test_num_samples, vp_stage=None):
        train, valid, test = provider(train_val_test_num_samples, vp_stage=vp_stage)
        # the tower's own ranks draw their language replica's micro-batches again: they add no FLOPs
        counted = not (vision_ranks.active() and vision_ranks.active().on_vision)
        return (meter.tap(train, counted) if vp_stage in (None, 0) else train), valid, test

    datasets.is_distributed = provider.is_distributed
    return datasets


def plain_for_megatron(provider):
    """``provider`` whose iterators hand megatron plain dicts (``batch.to_megatron`` says why)."""

    def datasets(train_val_test_num_samples, vp_stage=None):
        return tuple(
            None if it is None else map(to_megatron, it)
            for it in provider(train_val_test_num_samples, vp_stage=vp_stage)
        )

    datasets.is_distributed = provider.is_distributed
    return datasets


def check_pipeline_split(args) -> None:
    """Refuse a pipeline split of the decoder that megatron-core cannot build, by flag name
    (``--num-layers`` is checked against the model shape later)."""
    if (
        args.num_layers is None
        or args.pipeline_model_parallel_size == 1
        and not args.num_virtual_stages_per_pipeline_rank
    ):
        return
    stage_layers(
        args.num_layers,
        args.pipeline_model_parallel_size,
        args.num_virtual_stages_per_pipeline_rank,
        args.decoder_first_pipeline_num_layers,
        args.decoder_last_pipeline_num_layers,
    )


def checked_args():
    """megatron's args, the user's settings checked before any process group exists: a mistake is
    one line naming the flag and the value, never a traceback."""
    from megatron.training.arguments import parse_and_validate_args, parse_args

    try:
        # the shape's numbers are the defaults of megatron's model flags (a flag given must agree)
        named = parse_args(add_multimodal_args)
        flags = with_model_shape(add_multimodal_args, declared_shape(named)[0], named.seq_length)
        given = parse_args(flags)
        typed = given_flags(megatron_parser(add_multimodal_args))
        check_pipeline_split(given)  # before megatron asserts on these
        check_attention_backend(given)
        run_checks.check_finite_flags(given, typed)
        run_checks.check_lr_schedule(given)
        run_checks.check_sequence_length(given)
        defaults = {**engine_defaults(), **run_checks.vision_defaults(given, int(os.environ.get("WORLD_SIZE", "1")))}
        with vision_ranks.language_world(given):  # megatron sizes data parallelism from the language model's ranks
            args = parse_and_validate_args(extra_args_provider=flags, args_defaults=defaults)
        run_checks.stop_at_first_nan(args, typed)
        optimizer_format.default_to_reshardable(args)
        check_backend(args)
        check_packing_args(args)
        check_patch_budget_args(args)
        if args.dataset_provider == "jsonl":  # before any process group: a wrong path is one line
            check_data_path(data_path_value(args), "--data-path")
            if args.eval_data_path:
                check_data_path(args.eval_data_path, "--eval-data-path")
        elif args.dataset_provider == "energon":  # a prepared folder or a metadataset .yaml
            from examples.multimodal_dev.data.energon import check_energon_path, energon_sizes

            check_energon_path(data_path_value(args), "--data-path")
            energon_sizes(
                args.energon_shuffle_buffer_size,
                args.energon_max_samples_per_sequence,
                args.energon_packing_buffer_size,
            )
        elif args.data_path:
            resolve_source(data_path_value(args), "--data-path")
        gen_eval.check(args)
        if args.vision_chunk_patches < 0:
            raise ValueError(f"--vision-chunk-patches {args.vision_chunk_patches}: must be 0 (off) or a patch count")
        run_checks.check_vision_layout(args, model_shape().vision.num_heads, int(os.environ.get("WORLD_SIZE", "1")))
        language, vision = model_configs()
        text = model_shape().text
        run_checks.check_memory_floor(args, text.hidden_size, text.num_layers, text.vocab_size)
        if backend_of(args) == "local":  # refuses --attention-backend flash where varlen cannot run
            thd_line = describe_thd_kernels({"language model": language, "vision encoder": vision})
            if args.rank == 0:
                print(f"pretrain_multimodal.py: {thd_line}", flush=True)
        check_checkpoints(args)
    except (ValueError, KeyError, FileNotFoundError) as err:
        raise SystemExit(f"pretrain_multimodal.py: {err.args[0] if err.args else err}")
    except BaseException as err:  # reading --load's stored args may meet a planted pickle
        _exit_in_one_line(err, None)
    return args


def check_checkpoints(args) -> None:
    """What ``--load`` / ``--pretrained-checkpoint`` hold fits this run, before megatron reads it: a
    readable tracker, a whole latest iteration, the same model shape, the same LR, an optimizer
    format that loads at this layout."""
    for flag, directory in (("--load", args.load), ("--pretrained-checkpoint", args.pretrained_checkpoint)):
        safety.check_tracker(directory, flag)
        check_resumable(directory, flag)
        check_checkpoint_matches(directory, model_shape(), flag)
    run_checks.check_resume_lr(args)
    optimizer_format.check_layout_change(args)


def main():
    import megatron.cpu

    try:
        on_cpu = megatron.cpu.activate()
    except RuntimeError as err:  # MEGATRON_CPU_FLA=1 where FLA's kernels cannot run
        raise SystemExit(f"pretrain_multimodal.py: {err}") from None
    if on_cpu:
        megatron.cpu.tune_host()
        if os.environ.get("RANK", "0") == "0":  # torchrun's rank: args are not parsed yet
            print(f"pretrain_multimodal.py: {megatron.cpu.gdn_kernels_line()}", flush=True)
    elif reason := megatron.cpu.fla_unusable_reason():
        print(
            f"pretrain_multimodal.py: Gated DeltaNet runs on the torch kernels of megatron.cpu (correct, slower), "
            f"not flash-linear-attention's: {reason}",
            flush=True,
        )
        megatron.cpu.register_torch_gdn_kernels()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    gc.freeze()  # what the imports made lives for the whole run: no collection need walk it again
    gc.enable()
    megatron_changes.apply("checkpoints-are-data")  # before the arguments: --load's stored args are read
    args = checked_args()
    for line in save_guard.clear_incomplete_saves(args.save):
        print(f"pretrain_multimodal.py: {line}", flush=True)
    meter = StepFlops()
    try:
        lines = megatron_changes.install(args, meter)  # every change to megatron: megatron_changes/table.py
    except megatron_changes.MegatronChangeError as err:
        raise SystemExit(f"pretrain_multimodal.py: {err}") from None
    for line in lines if os.environ.get("RANK", "0") == "0" else ():
        print(f"pretrain_multimodal.py: {line}", flush=True)
    if args.save:
        write_queue.install()  # the writer's queue from a fork now, not a spawned interpreter at the first save
    grids = {}
    if args.vision_nproc:  # both modules' process grids, made before megatron starts (vision_ranks/groups.py)
        layout = vision_ranks.setup(args)
        grids = dict(
            pg_collection=layout.pg_collection, p2p_communicator=layout.communicator, skip_model_parallel_init=True
        )
    try:
        pretrain(
            pretrain_cfg_container_from_args(args),
            plain_for_megatron(metered(datasets_provider, meter)),
            ModelType.encoder_or_decoder,
            forward_step,
            model_provider=model_provider,
            **grids,
        )
    except DataError as err:  # the user's data, found unusable while the iterators are built or drawn
        raise SystemExit(f"pretrain_multimodal.py: {err}") from None
    except BaseException as err:
        _exit_in_one_line(err, args)


def _exit_in_one_line(err: BaseException, args):
    """One line for a checkpoint refused as code (DCP wraps it in its CheckpointException, a
    BaseException) and for a NaN found during training; anything else propagates unchanged."""
    line = safety.refusal(err) or (run_checks.one_line(err, args) if args is not None else None)
    if line is None:
        raise err
    raise SystemExit(f"pretrain_multimodal.py: {line}") from None


if __name__ == "__main__":
    try:
        main()
    finally:
        # Everything is written by now. The interpreter's last collection would walk every object torch,
        # megatron-core and sympy made (about 2 s a process, on every run); the OS frees them instead.
        gc.freeze()
