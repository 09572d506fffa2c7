"""Single-process megatron-core environment for unit tests (gloo, world size 1)."""

from __future__ import annotations

import os

import torch


def init_single_process(seed: int = 1234, **parallel_kwargs) -> None:
    import megatron.cpu

    megatron.cpu.activate()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(**parallel_kwargs)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
