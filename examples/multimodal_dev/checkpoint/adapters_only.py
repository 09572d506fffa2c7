"""A LoRA run's checkpoints hold what trains, not the frozen base it adapts.

The base is named in every LoRA checkpoint (``args.lora_base``, ``adapters_from_base.record_base``), so
writing its weights again at every save (~800 GB for 397b_a17b, for adapters of a few hundred MB)
stores nothing new. A LoRA run whose base is a checkpoint saves the model's tensors that train (the
adapters), their optimizer state, the RNG, the scheduler and the loader's state; its args carry
``lora_base``, ``lora_adapters_only`` and the base's fingerprint (``base_fingerprint``: its tensors'
names and shapes, and the bytes of its two smallest tensors), which every later load checks before
it reads the base again.

- Save: ``without_frozen_base`` drops from the model's part of the saved state every tensor whose
  storage is a frozen parameter's (a megatron_changes row on ``generate_state_dict``).
- Load and resume: ``adapters_from_base.base_without_adapters`` reads the tensors such a checkpoint
  lacks from its base, at the run's layout, through the same resharding as any load.
- Conversion (export, export-peft, verify, generate): ``hf_conversion.load_megatron_with_lora``
  reads them the same way.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re

ADAPTERS_ONLY = "lora_adapters_only"  # an arg of the run that saved: its checkpoints lack the base
LORA_BASE_HELP = (
    "where the base of a LoRA checkpoint's adapters is now, if it moved since the save (a LoRA run's "
    "checkpoints hold the adapters, not the base: checkpoint/adapters_only.py)"
)


# megatron stores a parameter's optimizer state under the parameter's own key behind the optimizer's
# prefix (``optimizer.state.exp_avg.KEY``: the plain and the fully reshardable distributed optimizer;
# ``optimizer.distributed.*``: the DP-reshardable buckets), with ``chained_N.`` ahead where it chains a
# dense and an expert optimizer: an adapter's moments are not an adapter
_OPTIMIZER_KEY = re.compile(r"(chained_\d+\.)?optimizer\.")


def is_model_key(key: str) -> bool:
    """Whether a checkpoint's tensor ``key`` is the model's own, not the optimizer's state of one."""
    return _OPTIMIZER_KEY.match(key) is None


def base_fingerprint(directory: str) -> str:
    """The checkpoint iteration at ``directory``: a hash of its model tensors' names and shapes and of
    the bytes of its two smallest ones (cheap: read without a process group)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader, load

    from ..megatron_changes import apply

    apply("checkpoints-are-data")
    reader = FileSystemReader(directory)
    found = reader.read_metadata().state_dict_metadata
    tensors = {k: m for k, m in found.items() if hasattr(m, "size") and is_model_key(k) and "_extra_state" not in k}
    digest = hashlib.sha256()
    for key in sorted(tensors):
        digest.update(f"{key}{tuple(tensors[key].size)};".encode())
    few = sorted(tensors, key=lambda k: (math.prod(tensors[k].size), k))[:2]
    sample = {k: torch.empty(tuple(tensors[k].size), dtype=tensors[k].properties.dtype) for k in few}
    load(sample, storage_reader=reader, no_dist=True)
    for key in few:
        digest.update(sample[key].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def base_to_read(saved_args, moved: str | None, where: str) -> str:
    """The base iteration directory the adapters-only checkpoint at ``where`` (its args ``saved_args``)
    is read with: where it names it, or ``moved`` (LORA_BASE / --lora-base: the base's folder or its
    iteration's). ``ValueError`` in one line naming both paths where it is missing or no longer the
    checkpoint the adapters were trained on."""
    from .files import TRACKER, checkpoint_directory

    base = saved_args.lora_base
    if moved:
        base = os.path.abspath(checkpoint_directory(moved) if os.path.isfile(os.path.join(moved, TRACKER)) else moved)
    fix = "point LORA_BASE (--lora-base) at where that base is now"
    if not base or not os.path.isdir(base):
        raise ValueError(f"{where} holds LoRA adapters only; their base {base} is missing: {fix}")
    recorded = getattr(saved_args, "lora_base_fingerprint", None)
    if recorded and base_fingerprint(base) != recorded:
        raise ValueError(
            f"{where} holds LoRA adapters only; their base {base} is no longer the checkpoint they were trained "
            f"on (its tensors' shapes or bytes differ from the fingerprint recorded at save): {fix}"
        )
    return base


def _storage(value) -> int | None:
    import torch

    data = getattr(value, "data", None)
    return data.untyped_storage().data_ptr() if isinstance(data, torch.Tensor) else None


def without_frozen_base(generate_state_dict, run=None):
    """``generate_state_dict`` whose saved model state leaves out the frozen base of a LoRA run whose
    base is a checkpoint (a save passes the iteration and the model's metadata; a load's template
    passes no iteration, and keeps every tensor so that the load can fill it)."""

    @functools.wraps(generate_state_dict)
    def generate(args, model, *rest, **kwargs):
        state = generate_state_dict(args, model, *rest, **kwargs)
        saving = kwargs.get("iteration") is not None and "model_sd_kwargs" in kwargs
        if not (saving and getattr(args, ADAPTERS_ONLY, False)):
            return state
        frozen = {p.untyped_storage().data_ptr() for chunk in model for p in chunk.parameters() if not p.requires_grad}
        for part in [k for k in state if k.startswith("model") and isinstance(state[k], dict)]:
            state[part] = {k: v for k, v in state[part].items() if _storage(v) not in frozen}
        return state

    return generate
