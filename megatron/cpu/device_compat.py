"""Make megatron's CUDA assumptions hold on a host without a GPU.

megatron.training and megatron-core create tensors on ``torch.cuda.current_device()``, call
``.cuda()``, synchronise streams, seed the CUDA generator and assert ``torch.cuda.*`` tensor
types. ``install()`` answers all of that with the CPU:

- a ``TorchFunctionMode`` turns every CUDA device argument (``"cuda"``, ``"cuda:N"``, an integer
  index, ``torch.device("cuda")``) of a torch call into the CPU, and ``Tensor.cuda()`` /
  ``.to("cuda")`` / ``pin_memory()`` into no-ops. A mode is per thread, so every thread started
  afterwards enters it too (megatron's async checkpoint writer and data-loader threads);
- ``torch.cuda.*`` functions megatron calls get host answers, one function object per name
  (dynamo's trace rules reject one object registered under several names);
- ``Tensor.type()`` answers ``torch.cuda.FloatTensor`` & co. (``clip_grads.py`` asserts it);
- ``torch.accelerator.current_accelerator()`` answers None, so torch's optimizers do not ask
  a CUDA graph capture status;
- ``all_reduce`` with ``ReduceOp.AVG`` sums and divides (older gloo builds lack AVG);
- a group asked for on ``backend='nccl'`` is made on the default backend (gloo).

``torch.cuda.is_available()`` stays False: that is how the project tells the hosts apart.
Installed only there (``megatron.cpu.activate``); on a GPU host nothing here runs.
"""

from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_installed = False


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


# Already host tensors: ``.cuda()`` and ``.pin_memory()`` return them as they are.
_TO_SELF = (torch.Tensor.cuda, torch.Tensor.pin_memory)


class CudaToHostMode(TorchFunctionMode):
    """Every CUDA device argument of a torch call becomes the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TO_SELF:
            return args[0]
        if kwargs and (_is_cuda(kwargs.get("device")) or kwargs.get("pin_memory")):
            kwargs = dict(kwargs)
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = _CPU
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False  # pinning needs a CUDA driver; host memory is host memory
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _enter_mode_in_threads() -> None:
    """Threads started after ``install`` run under the mode as well (a mode is thread-local)."""
    original = threading.Thread._bootstrap_inner

    def bootstrap_inner(self):
        with CudaToHostMode():
            original(self)

    threading.Thread._bootstrap_inner = bootstrap_inner


class _HostStream:
    """A CUDA stream or event on a host where every op is synchronous: waits are no-ops."""

    def __init__(self, *_args, **_kwargs):
        pass

    def wait_event(self, *_args) -> None:
        pass

    def wait_stream(self, *_args) -> None:
        pass

    def wait(self, *_args) -> None:  # Event.wait(stream): Megatron-FSDP's gradient reduce pipeline
        pass

    def record_event(self, *_args, **_kwargs):
        return _HostStream()

    def record(self, *_args, **_kwargs) -> None:
        pass

    def synchronize(self, *_args, **_kwargs) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, _other) -> float:
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        return False


_HOST_STREAM = _HostStream()


# One function per name: dynamo keeps a table of torch functions and refuses one object that
# appears under two names.
def _current_device():
    return _CPU


def _device_count() -> int:
    return 1  # megatron.training seeds the model-parallel RNG tracker only when this is > 0


def _set_device(*_args, **_kwargs) -> None:
    pass


def _current_stream(*_args, **_kwargs):
    return _HOST_STREAM


def _default_stream(*_args, **_kwargs):
    return _HOST_STREAM


def _stream_context(*_args, **_kwargs):
    return _HOST_STREAM


def _synchronize(*_args, **_kwargs) -> None:
    pass


def _empty_cache() -> None:
    pass


def _memory_zero(*_args, **_kwargs) -> int:
    return 0


def _max_memory_zero(*_args, **_kwargs) -> int:
    return 0


def _memory_reserved_zero(*_args, **_kwargs) -> int:
    return 0


def _max_memory_reserved_zero(*_args, **_kwargs) -> int:
    return 0


def _reset_peak_memory_stats(*_args, **_kwargs) -> None:
    pass


def _memory_stats(*_args, **_kwargs) -> dict:
    return {}


def _device_name(*_args, **_kwargs) -> str:
    return "cpu"


def _capability(*_args, **_kwargs) -> tuple[int, int]:
    # The host's answer to megatron's feature checks: Ampere's, the oldest architecture whose features
    # the CPU kernels provide (bf16, and grouped GEMM: torch's grouped_mm runs on CPU, which
    # --moe-grouped-gemm's check, compute capability >= 8, asks about). Nothing newer is claimed.
    return (8, 0)


def _rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state, *_args, **_kwargs) -> None:
    torch.set_rng_state(new_state)


def _manual_seed(seed) -> None:
    torch.default_generator.manual_seed(int(seed))


def _manual_seed_all(seed) -> None:
    torch.default_generator.manual_seed(int(seed))


def _is_current_stream_capturing() -> bool:
    return False


def _no_accelerator(*_args, **_kwargs):
    return None


_CUDA_FUNCTIONS = {
    "current_device": _current_device,
    "device_count": _device_count,
    "set_device": _set_device,
    "current_stream": _current_stream,
    "default_stream": _default_stream,
    "stream": _stream_context,
    "Stream": _HostStream,
    "Event": _HostStream,
    "synchronize": _synchronize,
    "empty_cache": _empty_cache,
    "memory_allocated": _memory_zero,
    "max_memory_allocated": _max_memory_zero,
    "memory_reserved": _memory_reserved_zero,
    "max_memory_reserved": _max_memory_reserved_zero,
    "reset_peak_memory_stats": _reset_peak_memory_stats,
    "memory_stats": _memory_stats,
    "get_device_name": _device_name,
    "get_device_capability": _capability,
    "get_rng_state": _rng_state,
    "set_rng_state": _set_rng_state,
    "manual_seed": _manual_seed,
    "manual_seed_all": _manual_seed_all,
    "is_current_stream_capturing": _is_current_stream_capturing,
}

_TENSOR_TYPE = torch.Tensor.type
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
    """``t.type()`` names the CUDA type megatron expects; conversions go to the original."""
    if dtype is None and not kwargs:
        return _CUDA_TYPE_NAMES.get(self.dtype, _TENSOR_TYPE(self))
    if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
        dtype = "torch." + dtype[len("torch.cuda.") :]
    return _TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


class _DoneWork:
    def wait(self, *_args, **_kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _average_on_gloo(all_reduce):
    """megatron-core's MTP and MoE loggers all-reduce with ``ReduceOp.AVG``, which NCCL has and
    gloo builds of older torch releases lack: sum, then divide by the group's size, on any build."""

    def average_capable_all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if op != torch.distributed.ReduceOp.AVG:
            return all_reduce(tensor, op=op, group=group, async_op=async_op)
        all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=group)
        tensor.div_(torch.distributed.get_world_size(group))
        return _DoneWork() if async_op else None

    return average_capable_all_reduce


def _groups_on_the_default_backend(new_group):
    """megatron-core's bridge communicators (``models/mimo/comm``, ``pipeline_parallel``) create
    their groups with ``backend='nccl'`` written in; a host without CUDA has no NCCL, so such a
    group is made on the default backend (gloo), as every other group here."""

    def new_group_here(*args, **kwargs):
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = None
        elif len(args) > 2 and args[2] == "nccl":  # (ranks, timeout, backend, ...)
            args = (*args[:2], None, *args[3:])
        return new_group(*args, **kwargs)

    return new_group_here


def _patch_rng_tracker() -> None:
    """megatron-core's model-parallel RNG tracker forks the CUDA generator; on this host the
    forks are of the CPU generator, so dropout and init keep their determinism contract."""
    import logging

    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _rng_state
    mcore_random._set_cuda_rng_state = _set_rng_state
    # The tracker warns when the CPU generator moved inside a "GPU" fork: here the forked
    # generator is the CPU generator, so every draw in a fork would warn.
    logging.getLogger(mcore_random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage()
    )


def install() -> None:
    """Idempotent; refuses a CUDA host."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron.cpu.device_compat must not be installed on a CUDA host")
    for name, fn in _CUDA_FUNCTIONS.items():
        setattr(torch.cuda, name, fn)
    torch.Tensor.type = _tensor_type
    if hasattr(torch, "accelerator"):
        torch.accelerator.current_accelerator = _no_accelerator
    _patch_rng_tracker()
    torch.distributed.all_reduce = _average_on_gloo(torch.distributed.all_reduce)
    # new_subgroups_by_enumeration calls the module's own new_group: patch it there, and the
    # public name megatron calls directly
    from torch.distributed import distributed_c10d

    distributed_c10d.new_group = torch.distributed.new_group = _groups_on_the_default_backend(
        distributed_c10d.new_group
    )
    CudaToHostMode().__enter__()  # this thread, for the life of the process
    _enter_mode_in_threads()
    _installed = True
