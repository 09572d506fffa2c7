"""Compare two training checkpoints entry by entry (weights, optimizer state, RNG states, ...)."""

import os

import torch


def entries(checkpoint_dir, tmp_path) -> dict:
    """Every entry of a torch_dist checkpoint, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from examples.multimodal_dev.megatron_changes import apply

    apply("checkpoints-are-data")
    out = tmp_path / (os.path.basename(os.path.dirname(str(checkpoint_dir))) + ".pt")
    dcp_to_torch_save(str(checkpoint_dir), str(out))
    return torch.load(out, weights_only=True)  # megatron's registered safe classes: numpy RNG state


def differences(a, b, where="") -> list[str]:
    """Where two checkpoint values differ (tensors bitwise, numpy arrays, containers, scalars)."""
    import numpy as np

    if torch.is_tensor(a) or isinstance(a, np.ndarray):
        same = type(a) is type(b) and a.shape == b.shape and bool((a == b).all())
        return [] if same else [where]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{where} keys"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


def state_differences(a: dict, b: dict) -> list[str]:
    """``differences`` over two checkpoints' entries, leaving out the stored command line, which
    differs by design between a straight and a resumed run (--load, --exit-interval)."""
    if a.keys() != b.keys():
        return ["entries"]
    return [d for k in a for d in differences(a[k], b[k], k) if not d.endswith(".args")]
