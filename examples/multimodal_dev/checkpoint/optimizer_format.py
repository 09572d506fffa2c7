"""The distributed optimizer's checkpoint format: one that moves between layouts, and no stray bytes.

megatron saves the distributed optimizer's state in one of two layouts (``--ckpt-format torch_dist``):

- ``dp_reshardable`` (megatron's default): each data-parallel rank's slice of the flat gradient
  buckets, as it sits in memory. It resumes at another DP size only; at another TP / PP / VP / EP
  megatron stops with a RuntimeError whose hint (``--ckpt-fully-parallel-save``) is not the flag
  that helps. Its padding between parameters was written from ``torch.empty``: whatever the
  allocator held (NaN, 3e38), so two correct runs never wrote the same bytes.
- ``fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``): per parameter, in the model's
  own sharded layout, so it resumes at any TP / PP / VP / DP / EP; saving gathers each bucket
  over the DP group first (docs/checkpoints.md, "Across layouts", has the measured cost).

With experts split over EP ranks megatron chains two optimizers (dense and expert parameters); at
EP=1 one optimizer holds both. Its fully reshardable tensors load across that change, but the
common part (each optimizer's parameter groups) keeps the saving layout's nesting, and megatron
0.19.2 stops ("Expected 2 entries in state dict, but got 4"); ``regrouped`` hands each
optimizer the saved groups in the nesting it reads (groups are matched by their identifiers).

This playground saves ``fully_reshardable`` unless ``--dist-ckpt-optim-dp-reshardable`` asks for
megatron's default (``default_to_reshardable``); ``zeroed_padding`` makes a ``dp_reshardable`` save deterministic; and
``check_layout_change`` refuses, in one line and before loading, a ``dp_reshardable`` checkpoint
resumed at another layout or with the plain optimizer, naming what to run instead, and hands a
checkpoint of the other kind of optimizer to ``optimizer_switch``.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from typing import Any

from examples.multimodal_dev.console import say

from . import optimizer_switch
from .files import TRACKER, checkpoint_directory, is_fsdp_dtensor, stored_args

FORMAT_FLAG = "dist_ckpt_optim_fully_reshardable"
# (megatron arg, how the run script and docs name it)
_LAYOUT = (
    ("tensor_model_parallel_size", "TP"),
    ("pipeline_model_parallel_size", "PP"),
    ("virtual_pipeline_model_parallel_size", "VP"),
    ("expert_model_parallel_size", "EP"),
    ("expert_tensor_parallel_size", "ETP"),
    # grouped experts hold one tensor per projection where SequentialMLP holds one per expert: the
    # flat buffers' order differs, so a dp_reshardable state does not carry over between the two
    ("moe_grouped_gemm", "GROUPED_EXPERTS"),
)


def default_to_reshardable(args: argparse.Namespace) -> None:
    """``--dist-ckpt-optim-fully-reshardable`` unless ``--dist-ckpt-optim-dp-reshardable`` asks for
    megatron's own default."""
    if args.dist_ckpt_optim_dp_reshardable and getattr(args, FORMAT_FLAG):
        raise ValueError("--dist-ckpt-optim-dp-reshardable and --dist-ckpt-optim-fully-reshardable: choose one")
    if args.use_distributed_optimizer and not args.dist_ckpt_optim_dp_reshardable:
        setattr(args, FORMAT_FLAG, True)


def _zero_padding_entries(node) -> None:
    """Zero the tensors of every ``padding`` entry (a LocalNonpersistentObject(True)) in the state."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(node, dict):
        padding = node.get("padding")
        if padding is not None and getattr(padding, "unwrap", lambda: padding)() is True:
            for value in node.values():
                if isinstance(value, ShardedTensor) and value.data is not None:
                    value.data.zero_()
        for value in node.values():
            _zero_padding_entries(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            _zero_padding_entries(value)


def zeroed_padding(original: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """``sharded_param_state_dp_reshardable`` with its padding tensors zeroed instead of uninitialised
    (megatron_changes row)."""

    @functools.wraps(original)
    def sharded_param_state_dp_reshardable(self, *args, **kwargs):
        state = original(self, *args, **kwargs)
        _zero_padding_entries(state)
        return state

    return sharded_param_state_dp_reshardable


_COMMON = ("optimizer", "param_state_sharding_type")


def _regroup(state_dict, parts: int):
    """The loaded optimizer state in the nesting of ``parts`` chained optimizers (1: one optimizer),
    or None when it already has it."""
    indexed = sorted(k for k in state_dict if isinstance(k, int))
    flat = all(k in state_dict for k in _COMMON)
    if parts > 1 and flat and indexed and indexed[-1] < parts:  # saved by one optimizer, loaded by a chain
        # a member of the chain with no parameter on this rank (the experts' optimizer on the vision
        # tower's own ranks, vision_ranks/groups.py) has no sharded state: it reads the groups alone
        groups = _with_expert_twins(state_dict["optimizer"]["param_groups"])
        common = {
            "optimizer": {"param_groups": groups},
            "param_state_sharding_type": state_dict["param_state_sharding_type"],
        }
        return {i: {**state_dict.get(i, {}), **common} for i in range(parts)}
    if (
        parts == 1
        and not flat
        and indexed
        and all(isinstance(state_dict[i], dict) and "optimizer" in state_dict[i] for i in indexed)
    ):  # saved by a chain, loaded by one
        groups = [g for i in indexed for g in state_dict[i]["optimizer"]["param_groups"]]
        rest = {k: v for k, v in state_dict.items() if not isinstance(k, int)}
        for i in indexed:
            rest.update({k: v for k, v in state_dict[i].items() if k not in _COMMON})
        return {
            **rest,
            "optimizer": {"param_groups": groups},
            "param_state_sharding_type": state_dict[indexed[0]]["param_state_sharding_type"],
        }
    return None


def _with_expert_twins(groups: list[dict]) -> list[dict]:
    """At EP=1 the experts' parameters share the dense groups; at EP>1 they form groups of their own
    that differ in ``is_expert_parallel`` only (same LR and weight-decay multipliers, same step)."""

    def key(g):
        return tuple(sorted((k, repr(v)) for k, v in g.items() if k != "params"))

    have = {key(g) for g in groups}
    twins = [{**g, "is_expert_parallel": not g.get("is_expert_parallel", False)} for g in groups]
    return groups + [t for t in twins if key(t) not in have]


def regrouped(original: Callable[..., Any], run: Any = None) -> Callable[..., Any]:
    """ChainedOptimizer.load_state_dict reading the saved groups in the nesting of the saving layout
    (megatron_changes row)."""

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        if isinstance(state_dict, dict):
            state_dict = _regroup(state_dict, len(self.chained_optimizers)) or state_dict
        return original(self, state_dict)

    return load_state_dict


def _layout(args) -> dict[str, int]:
    """Each setting as the run script names it: sizes (unset: 1), switches as 0 / 1."""
    values = {name: getattr(args, arg, None) for arg, name in _LAYOUT}
    return {name: int(v) if isinstance(v, bool) else (v or 1) for name, v in values.items()}


def _holds_checkpoint(path) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, TRACKER))


def _check_fsdp_experts(load: str, args) -> None:
    """fsdp_dtensor names expert weights as the saving run's implementation did (one 3-D weight of grouped
    experts, one per expert of SequentialMLP), and megatron-core 0.19.2 reads them only into the same."""
    if not getattr(args, "num_experts", None):
        return
    grouped = bool(getattr(stored_args(checkpoint_directory(load)), "moe_grouped_gemm", False))
    if grouped != bool(getattr(args, "moe_grouped_gemm", False)):
        saved = "grouped (one weight of all experts)" if grouped else "one weight each (SequentialMLP)"
        raise ValueError(
            f"{load}: its experts were saved {saved}, and an fsdp_dtensor checkpoint loads only into the same; "
            f"run with GROUPED_EXPERTS={int(grouped)}"
        )


def _check_fsdp_both(load: str, args, saved_by_fsdp: bool) -> None:
    """megatron-core 0.19.2 reads an fsdp_dtensor checkpoint only into a Megatron-FSDP run, and a
    Megatron-FSDP run reads only that format (its load asks for DTensors, not sharded tensors), the
    weights alone included. The weights move through a Hugging Face export and an import."""
    if saved_by_fsdp and getattr(args, "use_megatron_fsdp", False):
        _check_fsdp_experts(load, args)
    if saved_by_fsdp == bool(getattr(args, "use_megatron_fsdp", False)):
        return
    saved, other = ("fsdp_dtensor", "torch_dist") if saved_by_fsdp else ("torch_dist", "fsdp_dtensor")
    run = "without FSDP" if saved_by_fsdp else "with FSDP=1"
    raise ValueError(
        f"{load}: saved in {saved} format, which megatron-core 0.19.2 does not read into a run {run}; "
        f"move its weights with convert_checkpoint export --megatron-path {load} --hf-path HF, then import "
        f"--hf-path HF --megatron-path NEW --ckpt-format {other}, and start from NEW (CKPT_LOAD)"
    )


def check_layout_change(args: argparse.Namespace) -> None:
    """A ``dp_reshardable`` checkpoint resumed with its optimizer state at another TP / PP / VP / EP /
    ETP, with the other expert implementation, or by the plain optimizer: one line saying what to
    run. A checkpoint saved by the other kind of optimizer (plain, or distributed in the fully
    reshardable format) is translated on load. A checkpoint of the other format (torch_dist and
    Megatron-FSDP's fsdp_dtensor), weights alone included, is refused with how to move it."""
    held: list[str] = [
        d for d in (args.load, getattr(args, "pretrained_checkpoint", None)) if d and _holds_checkpoint(d)
    ]
    saved_by_fsdp = bool(held) and is_fsdp_dtensor(checkpoint_directory(held[0]))
    if held and (saved_by_fsdp or getattr(args, "use_megatron_fsdp", False)):
        _check_fsdp_both(held[0], args, saved_by_fsdp)
        return
    if not _holds_checkpoint(args.load) or args.finetune or args.no_load_optim:
        return
    from megatron.core import dist_checkpointing

    directory = checkpoint_directory(args.load)
    stored = stored_args(directory)
    if stored is None:
        return
    saved_dist = bool(getattr(stored, "use_distributed_optimizer", False))
    sharding = (dist_checkpointing.load_content_metadata(directory) or {}).get("distrib_optim_sharding_type")
    switched = saved_dist != bool(args.use_distributed_optimizer)
    was, now = _layout(stored), _layout(args)
    changed = [f"{k}={was[k]} -> {now[k]}" for k in was if was[k] != now[k]]
    if saved_dist and (sharding == "dp_reshardable" and changed or switched and sharding != "fully_reshardable"):
        change = ", ".join(changed + (["the plain optimizer"] if switched else []))
        raise ValueError(
            f"--load {args.load}: its optimizer state was saved in the distributed optimizer's "
            f"{sharding} layout, which resumes at another DP size only ({change}); "
            "resume once at the saved layout with --dist-ckpt-optim-fully-reshardable (this "
            "playground's default) and save, or load the weights alone with --no-load-optim"
        )
    if switched:
        say(
            f"--load {args.load}: optimizer state saved "
            f"{'with' if saved_dist else 'without'} --use-distributed-optimizer, resumed "
            f"{'without' if saved_dist else 'with'} it"
        )
        optimizer_switch.expect(saved_dist, bool(getattr(stored, "bf16", False) or getattr(stored, "fp16", False)))
