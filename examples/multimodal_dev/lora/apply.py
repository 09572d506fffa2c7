"""Putting LoRA adapters on a built model: every weight frozen, each target linear given an adapter."""

from __future__ import annotations

import hashlib

import torch

from ..models.common.grouped_experts import ExpertProjection
from .adapter import attach
from .grouped import attach_grouped
from .targets import target_of


def apply(model: torch.nn.Module, rank: int, alpha: float, dropout: float, targets, seed: int) -> dict[str, int]:
    """Freeze every weight of ``model`` (one pipeline stage) and give each target linear an adapter.

    Returns {target: linears adapted on this stage}. ``A`` is drawn from ``seed`` and the linear's
    name in the whole model (global layer and expert numbers), so any layout starts alike."""
    for param in model.parameters():
        param.requires_grad_(False)
    modules = dict(model.named_modules())
    counts = dict.fromkeys(targets, 0)
    for name, module in list(modules.items()):
        target = target_of(name, targets)
        if target is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name]
        if isinstance(module, ExpertProjection):  # a projection of the grouped experts: every expert's at once
            experts_name = global_name(parent_name, modules)
            first = parent.ep_group.rank() * parent.num_local_experts

            def generator_of(e, experts_name=experts_name, first=first, child=child):
                # the name SequentialMLP gives expert e's linear: the same A either way
                return _generator(seed, f"{experts_name}.local_experts.{first + e}.{child}")

            attach_grouped(module, parent, rank, alpha, dropout, generator_of)
        else:
            generator = _generator(seed, global_name(name, modules))
            attach(module, rank, alpha, dropout, generator, ".local_experts." in name, _row_layout(parent, name))
        counts[target] += 1
    return counts


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def global_name(name: str, modules: dict) -> str:
    """``name`` with this stage's layer and expert numbers replaced by the whole model's."""
    parts, out = name.split("."), []
    for i, part in enumerate(parts):
        if part.isdigit() and i and parts[i - 1] == "layers":
            layer = modules[".".join(parts[: i + 1])]
            part = str(getattr(layer, "layer_number", int(part) + 1) - 1)
        elif part.isdigit() and i and parts[i - 1] == "local_experts":
            experts = modules[".".join(parts[: i - 1])]
            part = str(experts.ep_group.rank() * experts.num_local_experts + int(part))
        out.append(part)
    return ".".join(out)


def _row_layout(parent, name: str):
    """How ``parent`` splits the weight of its child ``name`` in checkpoints (None: by TP alone)."""
    child = name.rpartition(".")[2]
    sections = getattr(parent, "in_proj_split_sections", None)
    if child == "in_proj" and sections is not None:  # Gated DeltaNet: q, k, v, z, beta, alpha

        def gdn_sections(sharded, sharded_offsets, metadata):
            from megatron.core.ssm.utils import _split_tensor_factory

            return _split_tensor_factory(sharded, list(sections), list(parent.in_proj_split_names), 0)

        return gdn_sections
    config = getattr(parent, "config", None)
    if child == "linear_fc1" and getattr(config, "gated_linear_unit", False):  # gate and up halves

        def gated_halves(sharded, sharded_offsets, metadata):
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            return apply_swiglu_sharded_factory(
                sharded,
                sharded_offsets,
                metadata.get("singleton_local_shards", False),
                tp_group=parent.tp_group,
                dp_group=metadata["dp_cp_group"],
            )

        return gated_halves
    return None
