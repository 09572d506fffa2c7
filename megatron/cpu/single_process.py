"""megatron-core in one process (gloo, world size 1): for tools and tests that build a model
outside torchrun, such as checkpoint conversion."""

from __future__ import annotations

import os

import torch


def init_single_process(seed: int = 1234, **parallel_kwargs) -> None:
    """Initialise torch.distributed and megatron-core's parallel state once (idempotent)."""
    import megatron.cpu
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    megatron.cpu.activate()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(**parallel_kwargs)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
