"""Megatron-FSDP checkpoints (``--ckpt-format fsdp_dtensor``) of a model some of whose parameters hold
nothing on some ranks.

Megatron-FSDP shards each parameter's flat buffer over the data-parallel ranks; a small parameter
(a norm's weight, ``A_log``) can lie wholly on one rank, leaving an empty shard on the others. A rank
gives an empty shard no gradient, so torch's Adam never makes state for it there: the ranks' optimizer
state dicts then name different parameters. megatron-core 0.19.2 prepares an ``fsdp_dtensor`` save
(and load) with collectives per DTensor of the state dict (``preprocess_state_dict_for_uneven_dtensor``),
so ranks with different dicts make different collectives, and the save hung (upstream
NVIDIA/Megatron-LM issues 4910, 5265). On load, megatron's dummy step skips empty shards too.

``every_parameter_has_state`` (a ``megatron_changes`` row) completes the optimizer's part of the state
dict: a parameter without state gets zeros shaped like its (empty) shard for each tensor the others
have, and their step. Nothing is read from or written into those entries: their shard holds no element.
"""

from __future__ import annotations

import functools
import re

import torch

from .files import TRACKER


def completed_state(state: dict, named_params: dict) -> dict:
    """``state`` (parameter name -> Adam state) with an entry for every name in ``named_params``."""
    sample = next(iter(state.values()), None)
    if sample is None:
        return state
    out = dict(state)
    for name, param in named_params.items():
        if name in out:
            continue
        out[name] = {
            key: value.clone() if value.dim() == 0 else torch.zeros_like(param, dtype=value.dtype)
            for key, value in sample.items()
            if isinstance(value, torch.Tensor)
        }
    return out


def every_parameter_has_state(method, run=None):
    """``DistributedOptimizer.sharded_param_state_fsdp_dtensor`` with a state entry for every parameter of
    its groups on every rank (megatron_changes row)."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        state_dict = method(self, *args, **kwargs)
        params = {self._param_name(p): p for group in self.optimizer.param_groups for p in group["params"]}
        state_dict["state"] = completed_state(state_dict["state"], params)
        return state_dict

    return wrapped


def nothing_to_load_changes_nothing(load_checkpoint, run=None):
    """megatron.training's ``load_checkpoint``, returning (0, 0) at once where an fsdp_dtensor run has no
    checkpoint to load (megatron_changes row).

    For ``fsdp_dtensor`` megatron-core 0.19.2 builds the loading state dict before it looks for a
    checkpoint, and building it takes one optimizer step on zero gradients to make Adam's slots: with
    no checkpoint to overwrite them, a fresh run launched with ``--load`` (the run script's
    ``CKPT_RESUME``) starts at Adam step 1 with its weights decayed once, and trains differently from
    the same run without ``--load``."""
    from megatron.training import get_args
    from megatron.training.checkpointing import checkpoint_exists
    from megatron.training.utils import print_rank_0

    @functools.wraps(load_checkpoint)
    def load(ddp_model, optimizer, opt_param_scheduler, load_arg="load", *rest, **kwargs):
        args = get_args()
        load_dir = getattr(args, load_arg)
        if (
            args.ckpt_format == "fsdp_dtensor"
            and not getattr(args, "pretrained_checkpoint", None)
            and not getattr(args, "non_persistent_ckpt_type", None)
            and not getattr(args, "exit_on_missing_checkpoint", False)
            and not checkpoint_exists(load_dir)
        ):
            print_rank_0(f"no checkpoint in {load_dir} (no {TRACKER}): starting from random weights")
            return 0, 0
        return load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg, *rest, **kwargs)

    return load


# Grouped experts (models/common/grouped_experts.py) hold every local expert in one 3-D weight per projection
GROUPED_EXPERT_WEIGHT = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight$")


def grouped_weights_name_no_expert(get_expert_index_from_key, run=None):
    """megatron-core's ``get_expert_index_from_key`` of fsdp_dtensor checkpoints, with None (no one expert)
    for the 3-D weights of grouped experts (megatron_changes row). megatron reads an index off every key
    containing ``mlp.experts.linear_fc1.weight``, as TE's GroupedMLP names its experts ``weight0``,
    ``weight1`` ...; ours end at ``weight`` and the save stopped ("Failed to parse expert index"). At EP=1
    the weight holds every expert, so the key needs no renumbering (EP > 1 is refused: ``run_checks``)."""

    @functools.wraps(get_expert_index_from_key)
    def index(key):
        return None if GROUPED_EXPERT_WEIGHT.search(key) else get_expert_index_from_key(key)

    return index
