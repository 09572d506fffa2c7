"""The device layer that lets megatron.training and megatron-core run on a host without a GPU.

``activate()`` makes megatron's CUDA assumptions hold on the CPU (``device_compat``), binds
the torch GatedDeltaNet kernels (``gdn_kernels``) where megatron-core looks for FLA's, and
fixes what megatron.training's distributed optimizer needs without Apex / Transformer Engine
(``training_compat``). On a CUDA host it does nothing.
``tune_host()`` is separate: process-wide allocator / floating-point settings the CPU entry
path asks for explicitly (``host_tuning``).

GatedDeltaNet's kernels on a CPU host: the torch kernels, even where flash-linear-attention (FLA)
imports, since FLA's Triton kernels find no GPU driver at their first call. ``MEGATRON_CPU_FLA=1``
together with ``TRITON_INTERPRET=1`` keeps FLA's instead, run by Triton's interpreter (seconds a
call): how tests/fla_cpu checks FLA against the torch kernels on a CPU host. The interpreter needs
two changes to run FLA (tests/fla_cpu/triton_interpreter.py, which the tests install); it is a
check of FLA, not a way to train. ``gdn_kernels_line()`` names the choice.
"""

from __future__ import annotations

import os

import torch

FLA_SWITCH = "MEGATRON_CPU_FLA"
_active = False
_fla_kept = False  # activate() kept FLA's kernels (MEGATRON_CPU_FLA=1)


def fla_available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:  # ImportError, or Triton failing to find a GPU at import
        return False
    return True


# Triton from 3.4.0 up to 3.7.1 compiles FLA's gated chunk backward (chunk_bwd_dqkwg) wrongly on Hopper
# (FLA issue #640): FLA 0.6 raises at the first backward there unless its TileLang backend takes the
# kernel, and older FLA computes wrong gradients silently. torch 2.11 pins Triton 3.6.0.
TRITON_HOPPER_BUG = ("3.4.0", "3.7.1")


def fla_unusable_reason() -> str | None:
    """Why FLA's GatedDeltaNet kernels cannot or must not train on this CUDA host, or None where they
    may (the one test every GPU entry path makes before binding the torch kernels)."""
    if not torch.cuda.is_available():
        return None
    if not fla_available():
        return "flash-linear-attention does not import (INSTALL_GPU_EXTRAS=1 installs it)"
    return _miscompiled_gated_backward()


def _miscompiled_gated_backward() -> str | None:
    """Why FLA's gated chunk backward (the rule alone) is wrong on this CUDA host, or None."""
    if torch.cuda.get_device_capability()[0] != 9:
        return None
    try:
        import triton
        from packaging.version import Version
    except ImportError:
        return None
    low, high = (Version(v) for v in TRITON_HOPPER_BUG)
    if not low <= Version(Version(triton.__version__).base_version) < high:
        return None
    if _fla_tilelang_usable():
        return None
    return (
        f"Triton {triton.__version__} on a Hopper GPU compiles FLA's gated chunk backward wrongly (FLA issue "
        f"#640; Triton >= {high} or FLA's TileLang backend, pip install tilelang, fixes it)"
    )


def _fla_tilelang_usable() -> bool:
    try:
        from fla.backends import TileLangBackend
    except Exception:  # noqa: BLE001 - an FLA without that backend cannot avoid the bug
        return False
    try:
        return bool(TileLangBackend.is_available())
    except Exception:  # noqa: BLE001
        return False


GDN_KERNELS = ("causal_conv1d", "chunk_gated_delta_rule", "l2norm")


def torch_gdn_kernel_names() -> tuple[str, ...]:
    """The GatedDeltaNet kernels that must run on torch's kernels on this CUDA host: all of them where
    FLA does not import; on Hopper with the miscompiling Triton, the gated chunk rule alone (#640 is in
    its backward; FLA's causal conv1d and l2norm compile right there and are several times faster than
    the torch ones); none where FLA's kernels are right."""
    if not torch.cuda.is_available() or not fla_available():
        return GDN_KERNELS
    return ("chunk_gated_delta_rule",) if _miscompiled_gated_backward() else ()


def register_torch_gdn_kernels(names: tuple[str, ...] = GDN_KERNELS) -> None:
    """Bind the torch kernels to these names megatron-core's GatedDeltaNet imports from FLA (the others
    keep FLA's). ``gdn.py`` copies the names at import time, so both modules are patched."""
    from megatron.core.ssm.gated_delta_net import common, gdn

    from . import gdn_kernels

    unknown = set(names) - set(GDN_KERNELS)
    if unknown:
        raise ValueError(f"no torch GatedDeltaNet kernel named {sorted(unknown)}; the kernels are {GDN_KERNELS}")
    for module in (common, gdn):
        for name in names:
            setattr(module, name, getattr(gdn_kernels, name))
    common.HAVE_FLA = True


def keep_fla_on_cpu() -> bool:
    """True when ``MEGATRON_CPU_FLA=1`` asks for FLA's kernels and they can run here; a request
    they cannot meet is refused in one line naming what is missing."""
    if os.environ.get(FLA_SWITCH, "0") in ("", "0"):
        return False
    if os.environ.get(FLA_SWITCH) != "1":
        raise RuntimeError(
            f"{FLA_SWITCH}={os.environ[FLA_SWITCH]!r}: expected 1 (FLA's kernels) or 0 (the torch kernels)"
        )
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{FLA_SWITCH}=1 needs TRITON_INTERPRET=1 on a host without CUDA: "
            "FLA's Triton kernels run there only under Triton's interpreter"
        )
    if not fla_available():
        raise RuntimeError(f"{FLA_SWITCH}=1 but flash-linear-attention does not import (fla.ops.gated_delta_rule)")
    return True


def activate() -> bool:
    """Make megatron usable on this host. Returns True when running on CPU."""
    global _active, _fla_kept
    if torch.cuda.is_available():
        return False
    if not _active:
        from . import device_compat, fsdp_compat, training_compat

        _fla_kept = keep_fla_on_cpu()  # first: a refused request leaves the process as it was
        device_compat.install()
        training_compat.install()
        fsdp_compat.install()
        if not _fla_kept:
            register_torch_gdn_kernels()
        _active = True
    return True


def gdn_kernels_line() -> str:
    """One line naming the GatedDeltaNet kernels ``activate()`` chose on this CPU host."""
    if _fla_kept:
        return f"Gated DeltaNet runs on flash-linear-attention's kernels under Triton's interpreter ({FLA_SWITCH}=1)"
    return (
        f"Gated DeltaNet runs on the torch kernels of megatron.cpu (no CUDA; {FLA_SWITCH}=1 "
        "TRITON_INTERPRET=1 runs FLA's, interpreted)"
    )


def tune_host() -> None:
    """CPU speed settings for the whole process (see ``host_tuning``); no-op on a CUDA host."""
    if not torch.cuda.is_available():
        from .host_tuning import tune_cpu_host

        tune_cpu_host()
