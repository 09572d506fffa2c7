"""A LoRA run's checkpoint read for conversion: its adapters put on the TP = 1 conversion model, and
merged into the base weights for the Hugging Face export.

A LoRA run stores every adapter's ``lora_A`` / ``lora_B`` (``B`` split into the weight's sections,
as ``lora/adapter.py`` says) and its megatron args with ``lora_rank``, ``lora_alpha`` and
``lora_targets``; the base weights beside them, or, where its base is a checkpoint, only that
checkpoint's name (``adapters_only.py``), from which the load reads them. The conversion model gets
the adapters those args name before the load asks the checkpoint for its tensors, so the adapters
load like the weights, resharded from whatever TP/EP the run saved at. A checkpoint without adapters
(an import, a full training run) loads as the base alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from examples.multimodal_dev.lora import apply as lora_apply
from examples.multimodal_dev.lora.adapter import LoraLinear
from examples.multimodal_dev.lora.targets import parse_targets

from .adapters_from_base import ADAPTER_SUFFIXES
from .adapters_only import is_model_key


@dataclass(frozen=True)
class StoredLora:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float
    base: str | None = None  # the checkpoint iteration the adapters adapt (args.lora_base), if recorded


def _adapter_keys(stored: dict) -> list[str]:
    """Checkpoint keys of the model's adapter tensors (not their optimizer state); a split ``B`` is
    stored as ``KEY.lora_B.query`` and so on."""
    return sorted(k for k in stored if is_model_key(k) and any(f"{s}." in f"{k}." for s in ADAPTER_SUFFIXES))


def stored_lora(megatron_path: str, saved_args, stored: dict) -> StoredLora | None:
    """The adapters of the checkpoint whose args are ``saved_args`` and whose tensor index is ``stored``
    (None: it has none). Args and tensors that disagree are refused in one line."""
    keys = _adapter_keys(stored)
    rank = getattr(saved_args, "lora_rank", 0) or 0
    flag = f"--megatron-path {megatron_path}"
    if keys and not rank:
        raise ValueError(f"{flag}: holds LoRA adapters ({keys[0]}) but its stored args have no lora_rank")
    if rank and not keys:
        raise ValueError(f"{flag}: its stored args have lora_rank {rank} but it holds no adapter tensors")
    if not rank:
        return None
    if not getattr(saved_args, "lora_targets", None):
        raise ValueError(f"{flag}: its stored args have lora_rank {rank} but no lora_targets")
    alpha = getattr(saved_args, "lora_alpha", None)
    return StoredLora(
        rank=rank,
        alpha=float(rank if alpha is None else alpha),  # the training script's default: scale 1
        targets=parse_targets(saved_args.lora_targets),
        dropout=float(getattr(saved_args, "lora_dropout", 0.0) or 0.0),
        base=getattr(saved_args, "lora_base", None),
    )


def attach_adapters(model: torch.nn.Module, lora: StoredLora, stored: dict, megatron_path: str) -> None:
    """Adapters on ``model`` as the run had them (dropout off: conversion never trains). An adapter in
    the checkpoint that the stored targets do not put on the model would be left unread, so it is
    refused by name."""
    # A is drawn here only to be overwritten by the checkpoint's.
    lora_apply.apply(model, lora.rank, lora.alpha, 0.0, lora.targets, seed=0)
    asked = [getattr(s, "key", None) for s in model.sharded_state_dict().values()]
    asked = {k for k in asked if k is not None}
    unread = [k for k in _adapter_keys(stored) if k not in asked and k.rpartition(".")[0] not in asked]
    if unread:
        raise ValueError(
            f"--megatron-path {megatron_path}: holds adapters its stored lora_targets "
            f"({','.join(lora.targets)}) do not name: {unread[0]}"
            + (f" and {len(unread) - 1} more" if len(unread) > 1 else "")
        )


def adapted_linears(model: torch.nn.Module) -> dict[str, LoraLinear]:
    """Module name -> linear with an adapter."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


class MergedState(Mapping):
    """The model's tensors by Megatron name (``state``) with every adapted weight read as
    ``W + (alpha / r) B A``: summed in float64 and rounded once, to the dtype the export writes it in
    (``dtype_of(name)``), not first to the model's fp32. Merged as each is read, so an export holds
    one rule's tensors at a time, as without adapters."""

    def __init__(self, state: Mapping, model: torch.nn.Module, dtype_of):
        self._state, self._dtype_of = state, dtype_of
        self.linears = {f"{n}.weight": m for n, m in adapted_linears(model).items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        linear = self.linears.get(name)
        if linear is None:
            return self._state[name]
        return linear.merged_weight(self._dtype_of(name))

    def __iter__(self):
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)
