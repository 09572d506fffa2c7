"""What megatron.training asks of a CUDA host that a CPU host answers differently.

Each patch names its call site, and ``install`` checks the patched function still has the
signature it was written against, so a megatron-core upgrade fails loudly here instead of
training something else.
"""

from __future__ import annotations

import functools
import inspect


def _expect_parameters(fn, names: tuple[str, ...]) -> None:
    params = inspect.signature(fn).parameters
    missing = [n for n in names if n not in params]
    if missing:
        raise RuntimeError(
            f"{fn.__module__}.{fn.__qualname__} no longer takes {missing}; megatron.cpu's "
            "patch of it needs updating for this megatron-core"
        )


def _device_arch_version() -> int:
    """megatron.training.arguments.validate_args asks the CUDA architecture with TP or CP > 1 for
    the CUDA_DEVICE_MAX_CONNECTIONS rule of pre-Blackwell GPUs: a rule a CPU host does not have."""
    return 10


def _allow_no_cuda(initialize_megatron):
    """megatron.training.pretrain -> initialize_megatron asserts CUDA unless allow_no_cuda."""

    @functools.wraps(initialize_megatron)
    def wrapped(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    return wrapped


def install() -> None:
    from megatron.training import arguments, training

    arguments.get_device_arch_version = _device_arch_version
    _expect_parameters(training.initialize_megatron, ("allow_no_cuda",))
    training.initialize_megatron = _allow_no_cuda(training.initialize_megatron)
