"""The model of one pipeline stage, for ``megatron.training.pretrain``: ``MODEL_REGISTRY``'s entry for
``--model-arch`` builds it from the shape of ``--model-variant`` (or ``HF_CONFIG``) and megatron's args.

``model_shape()`` and ``model_configs()`` are computed once a process: the argument checks, the
datasets and the model all read the same shape.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from examples.multimodal_dev.arguments import add_multimodal_args, megatron_args
from examples.multimodal_dev.checkpoint.run_shape import resolve_shape
from examples.multimodal_dev.lora import apply as lora
from examples.multimodal_dev.lora.targets import parse_targets
from examples.multimodal_dev.models import ModelShape, get_model_entry
from examples.multimodal_dev.models.common.config_from_args import given_flags, megatron_parser
from examples.multimodal_dev.training.backend import backend_of
from examples.multimodal_dev.vision_ranks import groups as vision_ranks
from examples.multimodal_dev.vision_ranks.stage import own_ranks_module


@functools.lru_cache(maxsize=None)
def model_shape() -> ModelShape:
    """The model's shape: the variant's table row, or the Hugging Face config's (``HF_CONFIG``)."""
    return resolve_shape(megatron_args())


@functools.lru_cache(maxsize=None)
def model_configs() -> tuple[Any, Any]:
    """(decoder, vision) TransformerConfigs: megatron's args with the shape laid over them."""
    args = megatron_args()
    configs_fn = get_model_entry(args.model_arch).configs_fn
    return configs_fn(args, model_shape(), backend_of(args), given_flags(megatron_parser(add_multimodal_args)))


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config: Any = None,
    pg_collection: Any = None,
) -> torch.nn.Module:
    """One pipeline stage (megatron.training's get_model calls it per virtual stage)."""
    args = megatron_args()
    entry = get_model_entry(args.model_arch)
    shape, backend = model_shape(), backend_of(args)
    separate = vision_ranks.active()  # the vision tower on ranks of its own: this rank builds one module
    if separate:
        for config in model_configs():  # the features' shapes vary by micro-batch; both modules' gradients
            config.variable_seq_lengths = True  # are finalised on their own groups, scaled by the world's tokens
            config.finalize_model_grads_func = vision_ranks.finalize_model_grads
    model = entry.build_fn(
        shape,
        backend=backend,
        max_sequence_length=args.seq_length,
        configs=model_configs(),
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        module=separate.role if separate else None,
    )
    if separate:  # the tower as a stage of its own, or the language model fed its features
        model = own_ranks_module(model, separate)
    if args.lora_rank:  # every weight frozen, adapters on the targets (lora/)
        targets = parse_targets(args.lora_targets)
        lora.apply(model, args.lora_rank, args.lora_alpha, args.lora_dropout, targets, args.seed)
    if model.vision_model is not None:
        model.vision_model.chunk_patches = args.vision_chunk_patches
        model.tower_once_per_forward = bool(args.use_megatron_fsdp)  # models/base.py says why
    for flag, part in (
        ("freeze_vision", model.vision_model),
        ("freeze_language", getattr(model, "language_model", None)),
    ):
        if getattr(args, flag) and part is not None:
            for p in part.parameters():
                p.requires_grad_(False)
    return model
