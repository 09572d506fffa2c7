"""The model shape a run's arguments describe, and the check that a checkpoint under ``--load``
was saved from that shape.

A run's shape comes from ``--model-variant`` (or ``--hf-config-path``), with the vision token ids
of ``--hf-processor-path`` when one is given; a training checkpoint stores those arguments, so the
converter reads a trained checkpoint's shape the same way.
"""

from __future__ import annotations

import os
from dataclasses import fields, is_dataclass, replace

from examples.multimodal_dev.models import get_model_entry
from examples.multimodal_dev.models.megatron_args import SHAPE_FLAGS, check_model_flags, checkpoint_args

from .adapters_only import HF_CONFIG_RECORDED
from .files import TRACKER, checkpoint_directory, stored_args


def declared_shape(args):
    """(shape, what named it): the variant of ``--model-variant`` / ``--variant-moe``, or the Hugging
    Face config of ``--hf-config-path``; megatron's model flags are not read."""
    entry = get_model_entry(args.model_arch)
    if isinstance(args.hf_config_path, dict):  # a checkpoint's recorded config (adapters_only.HF_CONFIG_RECORDED)
        return entry.shape_from_hf(args.hf_config_path), "Hugging Face config recorded in the checkpoint"
    if args.hf_config_path:
        return entry.shape_from_hf(args.hf_config_path), f"--hf-config-path {args.hf_config_path}"
    moe = {"auto": None, "on": True, "off": False}[args.variant_moe]
    return entry.shape_fn(args.model_variant, moe=moe), f"variant {args.model_variant!r}"


def resolve_shape(args):
    """The model shape for these args, with the token ids of the processor when one is given."""
    shape, source = declared_shape(args)
    # The MTP head is trained only when asked for (megatron's --mtp-num-layers), whatever the
    # checkpoint or variant carries; a converted checkpoint's mtp.* tensors are then left unused.
    shape = replace(shape, text=replace(shape.text, mtp_num_layers=args.mtp_num_layers or 0))
    check_model_flags(args, shape, source)
    if args.hf_processor_path:
        from examples.multimodal_dev.data.processor import load_processor

        tokens = load_processor(args.hf_processor_path)[1].tokens
        if max(tokens.vision_ids + (tokens.vision_start, tokens.vision_end)) >= shape.text.vocab_size:
            raise ValueError(
                f"--hf-processor-path {args.hf_processor_path}: its vision token ids do not fit "
                f"the vocabulary of {shape.text.vocab_size}"
            )
        shape = replace(
            shape,
            image_token_id=tokens.image,
            video_token_id=tokens.video,
            vision_start_token_id=tokens.vision_start,
            vision_end_token_id=tokens.vision_end,
        )
    return shape


def check_checkpoint_matches(load_dir: str | None, shape, flag: str = "--load", weights_only: bool = False) -> None:
    """The checkpoint under ``--load`` was saved from this model shape: its stored args (megatron's
    common state) against ``checkpoint_args(shape)``, so a dense checkpoint loaded as MoE (or the
    wrong variant) is one line naming what differs, not a KeyError listing hundreds of tensors.
    ``weights_only`` (``--finetune``): a run with an MTP head may start from a checkpoint without one,
    whose head then starts afresh (``adapters_from_base.base_without_adapters``)."""
    if not load_dir or not os.path.isfile(os.path.join(load_dir, TRACKER)):
        return
    directory = checkpoint_directory(load_dir)
    if not os.path.isdir(directory):
        raise ValueError(f"{flag} {load_dir}: {TRACKER} names {os.path.basename(directory)}, which does not exist")
    stored = stored_args(directory)
    if stored is None:
        return
    expected = vars(checkpoint_args(shape))
    differ = [
        f"{flag} {getattr(stored, flag, None) or 0} (checkpoint) vs {expected[flag] or 0} (this run)"
        for flag in (*SHAPE_FLAGS, "vocab_size")
        if flag != "moe_router_topk" and (getattr(stored, flag, None) or 0) != (expected[flag] or 0)
    ]
    if not differ:  # megatron's flags agree: every other field of the shape too (vision depth, GDN heads, ...)
        differ = shape_differences(stored_shape(stored), shape)
    if expected["mtp_num_layers"] and not getattr(stored, "mtp_num_layers", None) and not weights_only:
        differ.append(
            "the run trains an MTP head (MTP=1) the checkpoint does not have (a start from its weights alone, "
            "CKPT_LOAD, trains a new one)"
        )
    if differ:
        raise ValueError(
            f"{flag} {load_dir} ({os.path.basename(directory)}) was saved from another model: "
            + "; ".join(differ)
            + " (MODEL_VARIANT / MOE / MTP / HF_CONFIG must match the checkpoint)"
        )


# Fields a run sets for itself, not properties of the weights: whether the MTP head trains (checked
# above), the router's loss coefficient, and the processor's token ids.
NOT_WEIGHTS = {"mtp_num_layers", "router_aux_loss_coef"}
_RUN_FIELDS = NOT_WEIGHTS | {"image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"}


def stored_shape(stored):
    """The shape a checkpoint's stored args describe (its variant, or the HF config it was trained
    or imported from), or None when they do not say."""
    arch = getattr(stored, "model_arch", None)
    if arch is None:
        return None
    entry = get_model_entry(arch)
    config = getattr(stored, "hf_config_path", None)
    if config and not os.path.exists(config):  # moved away with a LoRA base: the copy the adapters keep
        config = getattr(stored, HF_CONFIG_RECORDED, None)
        return entry.shape_from_hf(config) if isinstance(config, dict) else None
    if config:
        return entry.shape_from_hf(config)
    variant = getattr(stored, "model_variant", None)
    moe = {"auto": None, "on": True, "off": False}.get(getattr(stored, "variant_moe", "auto"))
    return entry.shape_fn(variant, moe=moe) if variant else None


def shape_differences(
    stored, current, labels=("checkpoint", "this run"), skip=_RUN_FIELDS, prefix: str = ""
) -> list[str]:
    """``field value (checkpoint) vs value (this run)`` for every field that differs."""
    if stored is None:
        return []
    differ = []
    for f in fields(current):
        if f.name in skip:
            continue
        was, now = getattr(stored, f.name), getattr(current, f.name)
        if is_dataclass(now):
            differ += shape_differences(was, now, labels, skip, f"{prefix}{f.name}.")
        elif was != now:
            differ.append(f"{prefix}{f.name} {was} ({labels[0]}) vs {now} ({labels[1]})")
    return differ
