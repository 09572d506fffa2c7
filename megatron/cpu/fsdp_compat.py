"""What Megatron-FSDP (``--use-megatron-fsdp``) asks of a CUDA host that a CPU host answers differently.

megatron-core's adapter (``distributed/fsdp/mcore_fsdp_adapter.py``) puts its buffers on
``cuda:{torch.cuda.current_device()}`` and builds its DTensor device meshes with ``device_type="cuda"``;
on the host both are the CPU (a DTensor's mesh must name the device its local tensors live on).
"""

from __future__ import annotations

import functools

import torch


def _on_host(init):
    """The adapter's ``__init__`` with its device the CPU. ``MegatronFSDP``'s own ``__init__`` formats
    ``cuda:{torch.cuda.current_device()}`` to compare with it (a warning where they differ), which the
    device layer's ``torch.device("cpu")`` answer would make an invalid device string: meanwhile the
    current device is index 0, as on a one-GPU host."""

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        kwargs["device"] = kwargs.get("device") or torch.device("cpu")
        current = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0
        try:
            return init(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current

    return wrapped


class _HostMesh:
    """``DeviceMesh`` as the adapter calls it, with every mesh on the CPU."""

    def __init__(self, mesh_class):
        self._mesh_class = mesh_class

    def from_group(self, *args, **kwargs):
        if kwargs.get("device_type") == "cuda":
            kwargs["device_type"] = "cpu"
        return self._mesh_class.from_group(*args, **kwargs)

    def __call__(self, device_type, *args, **kwargs):
        return self._mesh_class("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._mesh_class, name)


def install() -> None:
    try:
        from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter
    except ImportError:  # megatron-core without Megatron-FSDP: nothing to adapt
        return
    from .training_compat import _expect_parameters

    _expect_parameters(adapter.FullyShardedDataParallel.__init__, ("device",))
    adapter.FullyShardedDataParallel.__init__ = _on_host(adapter.FullyShardedDataParallel.__init__)
    adapter.DeviceMesh = _HostMesh(adapter.DeviceMesh)
