"""megatron's args for this run, every setting checked before any process group exists: a mistake is
one line naming the flag and its value (``console.fail``), never a traceback.

The model's shape reaches megatron as its parser's defaults (``models/megatron_args.py``), so a
model flag given on the command line must agree with the variant.
"""

from __future__ import annotations

import argparse
import os
from typing import NoReturn

from examples.multimodal_dev.arguments import add_multimodal_args
from examples.multimodal_dev.checkpoint import optimizer_format, safety
from examples.multimodal_dev.checkpoint.adapters_from_base import check_adapters_kept, record_base
from examples.multimodal_dev.checkpoint.integrity import check_resumable
from examples.multimodal_dev.checkpoint.run_shape import check_checkpoint_matches, declared_shape
from examples.multimodal_dev.console import fail, say
from examples.multimodal_dev.data.jsonl_source import check_data_path
from examples.multimodal_dev.data.patch_budget import check_patch_budget_args
from examples.multimodal_dev.data.sources import resolve as resolve_source
from examples.multimodal_dev.data.token_budget import check_packing_args
from examples.multimodal_dev.data.video import check_video_flags
from examples.multimodal_dev.dataset_provider import data_path_value
from examples.multimodal_dev.lora import targets as lora_targets
from examples.multimodal_dev.model_provider import model_configs, model_shape
from examples.multimodal_dev.models.common.config_from_args import given_flags, megatron_parser
from examples.multimodal_dev.models.common.varlen_attention import describe_thd_kernels
from examples.multimodal_dev.models.megatron_args import apply_model_shape
from examples.multimodal_dev.post_training import dpo, grpo
from examples.multimodal_dev.training import gen_eval, lost_nodes, run_checks
from examples.multimodal_dev.training.backend import (
    backend_of,
    check_attention_backend,
    engine_defaults,
    te_importable,
)
from examples.multimodal_dev.vision_ranks import groups as vision_ranks


def check_as_launched(args: argparse.Namespace, shape, typed: dict[str, str]) -> None:
    """The run script's checks (``launcher/checks.py``) on the run these flags describe, rebuilt as the
    launcher's ``RunConfig`` (``launcher/from_args.py``): the one set of checks, whoever started the
    script, on what it was actually given."""
    import torch

    from examples.multimodal_dev.launcher.from_args import check_as_launched as check
    from examples.multimodal_dev.launcher.from_args import rebuilt
    from examples.multimodal_dev.launcher.from_env import Host

    parser = megatron_parser(add_multimodal_args)
    dest_of = {option: action.dest for action in parser._actions for option in action.option_strings}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    config = rebuilt(args, dest_of, typed, world, per_node, shape.text.is_moe)
    check(config, shape, Host(gpu=torch.cuda.is_available(), transformer_engine=te_importable))


def checked_args() -> argparse.Namespace:
    """megatron's args, the user's settings checked before any process group exists: a mistake is
    one line naming the flag and the value, never a traceback."""
    from megatron.training.arguments import parse_args

    try:
        args = parse_args(add_multimodal_args)  # the one parse of the command line
        typed = given_flags(megatron_parser(add_multimodal_args))  # the flags it names, read off its words
        # the shape's numbers are the values of megatron's model flags not given (a flag given must agree)
        shape = declared_shape(args)[0]
        apply_model_shape(args, shape, typed)
        if line := dpo.without_router_loss(args, typed):
            say(line)
        if args.train_mode == "grpo":  # a function of the user's imports here, once, as one line if it fails
            grpo.reward_function(grpo.Settings.of(args).reward)
        check_as_launched(args, shape, typed)  # the launcher's checks, before megatron asserts on these
        check_attention_backend(args)
        run_checks.check_finite_flags(args, typed)
        defaults = {**engine_defaults(), **run_checks.vision_defaults(args, int(os.environ.get("WORLD_SIZE", "1")))}
        with vision_ranks.language_world(args):  # megatron sizes data parallelism from the language model's ranks
            # megatron's parse read WORLD_SIZE, the whole world's, into these two
            args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
            if "inprocess_active_world_size" not in typed:
                args.inprocess_active_world_size = args.world_size
            validated(args, defaults)
        run_checks.stop_at_first_nan(args, typed)
        optimizer_format.default_to_reshardable(args)
        check_packing_args(args)
        check_patch_budget_args(args)
        check_data_args(args)
        gen_eval.check(args, typed)
        lora_targets.check(args)
        if line := lora_targets.rank_warning(args, model_shape()):
            say(line)
        run_checks.check_vision_layout(args, model_shape().vision.num_heads, int(os.environ.get("WORLD_SIZE", "1")))
        run_checks.check_fsdp(args)
        language, vision = model_configs()
        text = model_shape().text
        run_checks.check_memory_floor(args, text.hidden_size, text.num_layers, text.vocab_size)
        if backend_of(args) == "local":  # refuses --attention-backend flash where varlen cannot run
            thd_line = describe_thd_kernels({"language model": language, "vision encoder": vision})
            say(thd_line)
        check_checkpoints(args)
    except (ValueError, KeyError, FileNotFoundError) as err:
        fail(err.args[0] if err.args else str(err))
    except BaseException as err:  # reading --load's stored args may meet a planted pickle
        exit_in_one_line(err, None)
    return args


def validated(args: argparse.Namespace, defaults: dict) -> None:
    """What megatron's ``parse_and_validate_args`` does after its parse, on the args parsed here: the
    stored args of ``--use-checkpoint-args``, megatron's checks and defaults, its global state."""
    from megatron.training.arguments import validate_args
    from megatron.training.checkpointing import load_args_from_checkpoint
    from megatron.training.global_vars import set_global_variables

    if args.yaml_cfg is not None:  # megatron reads its own arguments from the file, not this script's
        raise ValueError(f"--yaml-cfg {args.yaml_cfg}: the training script takes its settings as flags")
    if args.use_checkpoint_args:
        if args.load is None and args.pretrained_checkpoint is None:
            raise ValueError("--use-checkpoint-args needs --load or --pretrained-checkpoint: the args are read there")
        load_args_from_checkpoint(args, load_arg="pretrained_checkpoint")
        load_args_from_checkpoint(args)
    validate_args(args, defaults)
    set_global_variables(args)


def check_checkpoints(args) -> None:
    """What ``--load`` / ``--pretrained-checkpoint`` hold fits this run, before megatron reads it: a
    readable tracker, a whole latest iteration, the same model shape, the LoRA adapters it trained,
    the same LR, an optimizer format that loads at this layout."""
    for flag, directory in (("--load", args.load), ("--pretrained-checkpoint", args.pretrained_checkpoint)):
        safety.check_tracker(directory, flag)
        check_resumable(directory, flag)
        check_checkpoint_matches(directory, model_shape(), flag, weights_only=flag == "--load" and args.finetune)
        check_adapters_kept(args, directory, flag)
    record_base(args)
    run_checks.check_resume_lr(args)
    run_checks.check_finished_run(args)
    optimizer_format.check_layout_change(args)


def check_data_args(args) -> None:
    """The data the flags name exists and reads, before any process group: a wrong path is one line."""
    if args.dataset_provider == "jsonl":
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
    elif path := data_path_value(args):
        resolve_source(path, "--data-path")
    if args.vision_chunk_patches < 0:
        raise ValueError(f"--vision-chunk-patches {args.vision_chunk_patches}: must be 0 (off) or a patch count")
    check_video_flags(args)


def exit_in_one_line(err: BaseException, args) -> NoReturn:
    """One line for a checkpoint refused as code (DCP wraps it in its CheckpointException, a
    BaseException), for a NaN found during training and for a node lost during it; anything else
    propagates unchanged."""
    during = args is not None and (run_checks.one_line(err, args) or lost_nodes.one_line(err, args))
    line = safety.refusal(err) or during
    if not line:
        raise err
    fail(line)
