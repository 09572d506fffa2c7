"""A LoRA run's checkpoints hold what trains, not the frozen base it adapts.

The base is named in every LoRA checkpoint (``args.lora_base``, ``adapters_from_base.record_base``), so
writing its weights again at every save (~800 GB for 397b_a17b, for adapters of a few hundred MB)
stores nothing new. A LoRA run whose base is a checkpoint saves the model's tensors that train (the
adapters), their optimizer state, the RNG, the scheduler and the loader's state; its args carry
``lora_base``, ``lora_adapters_only``, the run's HF config (``HF_CONFIG_RECORDED``) and the base's
fingerprint (``base_fingerprint``: a hash of the crc32 the base's save recorded for every shard,
``shard_checksums.py``, and of where its index puts each tensor), which every later load checks
before it reads the base again, after the base's checksums themselves, as any checkpoint loaded is
(``integrity.damage``): every byte of the base is the byte the adapters were trained on.

- Older adapters-only checkpoints recorded a weaker fingerprint (the base's tensors' names and shapes
  and the bytes of its two smallest tensors: ``sampled_fingerprint``). They still load, checked by
  that form and by the base's checksums: refusing them would strand adapters whose base is intact,
  and a resume records the full form from then on. A base saved without checksums (by another
  program) is fingerprinted in that form too; the run says so.

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
import json
import math
import os
import re

ADAPTERS_ONLY = "lora_adapters_only"  # an arg of the run that saved: its checkpoints lack the base
# an arg of such a run: its Hugging Face config (a dict), so that its checkpoints describe their model
# when the file --hf-config-path named moved away with the base (an import keeps it in its folder)
HF_CONFIG_RECORDED = "lora_hf_config"
FULL = "crc32:"  # the fingerprint's form over every byte (``recorded_fingerprint``)
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


def recorded_fingerprint(directory: str) -> str | None:
    """The checkpoint iteration at ``directory``: a hash of the size and crc32 its save recorded for
    each shard and of where its index puts each tensor (None where it recorded no checksums). Cheap,
    and over every byte: the files are checked against that record (``integrity.damage``) whenever
    the base is read. The index's own bytes are not hashed: DCP writes a new save id into each save,
    so a re-import of the same weights to the same path is the same base."""
    from torch.distributed.checkpoint import FileSystemReader

    from ..megatron_changes import apply
    from . import shard_checksums

    sums = shard_checksums.recorded(directory)
    if not sums:
        return None
    apply("checkpoints-are-data")
    index = FileSystemReader(directory).read_metadata().storage_data
    where = sorted((i.fqn, tuple(i.offset or ()), s.relative_path, s.offset, s.length) for i, s in index.items())
    files = sorted((name, size_crc) for name, size_crc in sums.items() if name != ".metadata")
    return FULL + hashlib.sha256(json.dumps([files, where]).encode()).hexdigest()[:16]


def sampled_fingerprint(directory: str) -> str:
    """The older form: a hash of its model tensors' names and shapes and of the bytes of its two
    smallest ones (read without a process group)."""
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


def base_fingerprint(directory: str) -> str:
    """What a LoRA run records of its base: the full form where the base's save recorded checksums."""
    return recorded_fingerprint(directory) or sampled_fingerprint(directory)


def base_path(saved_args, moved: str | None) -> str | None:
    """The base iteration directory of an adapters-only checkpoint (its args ``saved_args``): where they
    name it, or ``moved`` (LORA_BASE / --lora-base: the base's folder or its iteration's)."""
    from .files import TRACKER, checkpoint_directory

    if moved:
        return os.path.abspath(checkpoint_directory(moved) if os.path.isfile(os.path.join(moved, TRACKER)) else moved)
    return saved_args.lora_base


def base_to_read(saved_args, moved: str | None, where: str) -> str:
    """The base iteration directory the adapters-only checkpoint at ``where`` (its args ``saved_args``)
    is read with (``base_path``). ``ValueError`` in one line naming both paths where it is missing,
    damaged, or another checkpoint than the one the adapters were trained on."""
    from .integrity import damage

    base = base_path(saved_args, moved)
    fix = "point LORA_BASE (--lora-base) at where that base is now"
    if not base or not os.path.isdir(base):
        raise ValueError(f"{where} holds LoRA adapters only; their base {base} is missing: {fix}")
    share = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # torchrun's, as integrity's
    if what := damage(base, *share):
        raise ValueError(
            f"{where} holds LoRA adapters only; their base {base} is damaged: {what}; copy or import that base "
            "again, or point LORA_BASE (--lora-base) at a whole copy"
        )
    recorded = getattr(saved_args, "lora_base_fingerprint", None)
    if recorded and recorded.startswith(FULL) and recorded_fingerprint(base) != recorded:
        raise ValueError(_another(where, base, "the crc32 of its files differ from those recorded", fix))
    if recorded and not recorded.startswith(FULL) and sampled_fingerprint(base) != recorded:
        raise ValueError(_another(where, base, "its tensors' shapes or bytes differ from those recorded", fix))
    return base


def _another(where: str, base: str, why: str, fix: str) -> str:
    return (
        f"{where} holds LoRA adapters only; their base {base} is not the checkpoint they were trained on: its "
        f"contents differ from that base's ({why} at save): {fix}"
    )


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
