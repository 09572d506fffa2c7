"""The model weights of a Megatron-FSDP checkpoint (``--ckpt-format fsdp_dtensor``), for export, verify
and generation.

An fsdp_dtensor iteration is one torch.distributed.checkpoint (DCP) directory. Its model part is keyed
by the parameter names of the model megatron wrapped (``model.module.<name>``), each stored whole
(DCP's index has the global shape), so it reads into a one-process model of the run's shape without
resharding. The weights are FSDP's fp32 main copies whatever the run trained in: the dtype a weight
had in the run comes from the run's args (``weight_dtypes``), where a torch_dist checkpoint stores it.
"""

from __future__ import annotations

import torch

PREFIX = "model.module."  # megatron's "model" part, then the wrapper's ``module``


def _requested(model) -> dict[str, torch.Tensor]:
    """Checkpoint key -> the model's own tensor (DCP reads into it in place)."""
    return {PREFIX + n: t for n, t in model.state_dict().items() if "_extra_state" not in n}


def check_model_matches(model, stored: dict, described_by: str) -> None:
    """``ValueError`` naming the first weight of ``model`` the checkpoint lacks or holds at another shape."""
    config = model.config
    split = {"TP": config.tensor_model_parallel_size, "EP": config.expert_model_parallel_size}
    if any(size > 1 for size in split.values()):
        sizes = ", ".join(f"{k}={v}" for k, v in split.items())
        raise ValueError(f"a Megatron-FSDP (fsdp_dtensor) checkpoint loads into one process here, not at {sizes}")
    for key, tensor in _requested(model).items():
        name, meta = key[len(PREFIX) :], stored.get(key)
        if meta is None:
            raise ValueError(f"{described_by} does not describe the checkpoint's model: it has no tensor {name}")
        if tuple(meta.size) != tuple(tensor.shape):
            raise ValueError(
                f"{described_by} does not describe the checkpoint's model: {name} is "
                f"{tuple(meta.size)} there, {tuple(tensor.shape)} here"
            )


def load_weights(model, directory: str) -> None:
    """Every weight of ``model`` (one process, the run's shape) from the fsdp_dtensor ``directory``."""
    from torch.distributed.checkpoint import load

    from ..megatron_changes import apply

    apply("checkpoints-are-data")
    load(_requested(model), checkpoint_id=directory, no_dist=True)


def save_weights(model, args, iteration: int, directory: str) -> None:
    """``model``'s weights (one process, whole) as Megatron-FSDP saves them, fp32, with ``args``: the
    checkpoint an FSDP=1 run starts from (``CKPT_LOAD``) as from its own."""
    from torch.distributed.checkpoint import save

    model_part = {k[len("model.") :]: t.float() for k, t in _requested(model).items()}
    save({"model": model_part, "args": args, "checkpoint_version": 3.0, "iteration": iteration}, checkpoint_id=directory)


def weight_dtypes(model, saved_args, fp32_suffixes: tuple[str, ...]) -> dict[str, torch.dtype]:
    """Each weight's dtype in the run that saved ``saved_args``: its training dtype, except the weights the
    model keeps in fp32 whatever it trains in (``fp32_suffixes``, the model entry's)."""
    trained = (
        torch.bfloat16
        if getattr(saved_args, "bf16", False)
        else torch.float16
        if getattr(saved_args, "fp16", False)
        else torch.float32
    )
    return {name: torch.float32 if name.endswith(fp32_suffixes) else trained for name in model.sharded_state_dict()}
