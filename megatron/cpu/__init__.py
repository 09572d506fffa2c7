"""The device layer that lets megatron.training and megatron-core run on a host without a GPU.

``activate()`` makes megatron's CUDA assumptions hold on the CPU (``device_compat``), binds
the torch GatedDeltaNet kernels (``gdn_kernels``) where megatron-core looks for FLA's when FLA
cannot be imported, and fixes what megatron.training's distributed optimizer needs without
Apex / Transformer Engine (``training_compat``). On a CUDA host it does nothing.
``tune_host()`` is separate: process-wide allocator / floating-point settings the CPU entry
path asks for explicitly (``host_tuning``).
"""

from __future__ import annotations

import torch

_active = False


def fla_available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:  # ImportError, or Triton failing to find a GPU at import
        return False
    return True


def register_torch_gdn_kernels() -> None:
    """Bind the torch kernels to the names megatron-core's GatedDeltaNet imports from FLA.
    ``gdn.py`` copies the names at import time, so both modules are patched."""
    from megatron.core.ssm.gated_delta_net import common, gdn

    from . import gdn_kernels

    for module in (common, gdn):
        module.causal_conv1d = gdn_kernels.causal_conv1d
        module.chunk_gated_delta_rule = gdn_kernels.chunk_gated_delta_rule
        module.l2norm = gdn_kernels.l2norm
    common.HAVE_FLA = True


def activate() -> bool:
    """Make megatron usable on this host. Returns True when running on CPU."""
    global _active
    if torch.cuda.is_available():
        return False
    if not _active:
        from . import device_compat, training_compat

        device_compat.install()
        training_compat.install()
        if not fla_available():
            register_torch_gdn_kernels()
        _active = True
    return True


def tune_host() -> None:
    """CPU speed settings for the whole process (see ``host_tuning``); no-op on a CUDA host."""
    if not torch.cuda.is_available():
        from .host_tuning import tune_cpu_host

        tune_cpu_host()
