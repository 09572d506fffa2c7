"""megatron-core in one process (gloo, world size 1): for tools and tests that build a model
outside torchrun, such as checkpoint conversion."""

from __future__ import annotations

import tempfile

import torch


def init_single_process(seed: int = 1234, **parallel_kwargs) -> None:
    """Initialise torch.distributed and megatron-core's parallel state once (idempotent)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron.cpu

    megatron.cpu.activate()
    if not torch.distributed.is_initialized():
        # A file store, not a TCP port: torchrun jobs this process launches (tests, tools) can
        # never collide with it, and nothing leaks into their environment.
        store = tempfile.NamedTemporaryFile(prefix="megatron_cpu_store_", delete=False).name
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(**parallel_kwargs)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
