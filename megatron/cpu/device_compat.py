"""Redirect the few CUDA-only calls megatron-core makes so its layers run on a CPU host.

Installed only when ``torch.cuda.is_available()`` is false (see ``megatron.cpu.activate``); on a
GPU host nothing here runs. Each redirection names the megatron-core call site it serves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

_CPU = torch.device("cpu")
_installed = False


def _cpu_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, *_args, **_kwargs) -> None:
    torch.set_rng_state(new_state)


def _seed_cpu_generator(seed) -> None:
    torch.default_generator.manual_seed(int(seed))


class _HostStream:
    """Stands in for a CUDA stream: on CPU every op is synchronous, so waits are no-ops."""

    def wait_event(self, _event) -> None:
        pass

    def wait_stream(self, _stream) -> None:
        pass

    def synchronize(self, *_args, **_kwargs) -> None:
        pass


_HOST_STREAM = _HostStream()

# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_BYTES = 1 << 30


def keep_freed_host_memory() -> bool:
    """Let glibc's malloc keep freed blocks of up to 1 GiB for reuse instead of returning them
    to the kernel. Activations of a training step are tens of MB each: by default every one is
    a fresh mmap whose pages the kernel faults in and zeroes on first touch, step after step
    (measured: a packed gated-delta-rule forward 0.136 s -> 0.103 s, fp32, 2 cores). Freed
    memory then stays with the process, so its RSS holds at the peak of a step. Returns False
    where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))


def install() -> None:
    """Idempotent. Afterwards ``torch.cuda.current_device()`` is the CPU device and the
    "CUDA" RNG tracker of megatron-core forks the CPU generator instead."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron.cpu.device_compat must not be installed on a CUDA host")

    # Parameters are created with device=torch.cuda.current_device() throughout megatron-core
    # (GatedDeltaNet conv1d / A_log / dt_bias, rotary inv_freq, linear layers).
    torch.cuda.current_device = lambda: _CPU
    # megatron.core.distributed.param_and_grad_buffer: start_grad_sync orders the gradient
    # all-reduce after pending work on torch.cuda.current_stream().
    torch.cuda.current_stream = lambda *_args, **_kwargs: _HOST_STREAM
    # megatron.core.dist_checkpointing (filesystem_async.preload_tensors) synchronises before
    # copying shards to host memory; CPU tensors are already there.
    torch.cuda.synchronize = _HOST_STREAM.synchronize
    # megatron-core wraps small fused element-wise functions (GDN's gated norm, MoE helpers) in
    # torch.compile. On CPU that builds C++ kernels with inductor on the first call of every
    # input shape: ~2 s per process per shape for a tiny model, more with ranks sharing cores,
    # and packed rows change shape every batch. Eager gives the same numbers.
    torch._dynamo.config.disable = True
    keep_freed_host_memory()
    # Gated DeltaNet's decays exp(gamma_i - gamma_j) underflow into subnormal floats, which x86
    # cores handle in microcode at a fraction of the normal rate: flushing them to zero made a
    # packed training step of the tiny model 20% faster (2.58 s -> 2.08 s). Values below 1.2e-38
    # become 0, as in GPU kernels built with fast math.
    torch.set_flush_denormal(True)

    # megatron.core.tensor_parallel.random: CudaRNGStatesTracker.add/fork and
    # model_parallel_cuda_manual_seed read/seed/set the CUDA generator. Point them at the CPU
    # generator so dropout / init forks keep their determinism contract on CPU.
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state
    torch.cuda.get_rng_state = _cpu_rng_state
    torch.cuda.set_rng_state = _set_cpu_rng_state
    # Seed the CPU generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all.
    torch.cuda.manual_seed = _seed_cpu_generator
    torch.cuda.manual_seed_all = _seed_cpu_generator
    # The tracker's fork warns when the CPU generator moved inside a "GPU" fork. Here the
    # forked generator *is* the CPU generator, so every random draw in a fork would warn.
    logging.getLogger(mcore_random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage())
    _installed = True
