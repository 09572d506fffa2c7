"""What a micro-batch's tensors carry besides their values: the values derived from its
packed-sequence boundaries, computed once, and the host copy each tensor was moved from.

Every attention and Gated DeltaNet layer of a tower, query and key alike, asks for the same derived
values: recomputed per layer they cost eager ops, and read back to the host per layer a device sync
each. The checks and bounds the host needs (segment ends, placeholder counts) are read from the host
copy the batch was collated in, so on a GPU they stop nothing. What is kept lives on the tensor,
as long as its micro-batch.
"""

from __future__ import annotations

import torch

_HOST_COPY = "_host_copy"  # megatron/cpu/gdn_kernels.py's torch kernels read it too (HOST_COPY)
# Set on a tensor that stays on the host on every device (a batch's host copies, the vision grids):
# the host reads it without waiting for a GPU. ``benchmarks/op_counter.py`` reads the mark.
HOST_SIDE_MARK = "_host_side"


def kept_on(cu_seqlens: torch.Tensor, name: str, key, make):
    """``make()``, computed the first time ``(name, key)`` is asked of this ``cu_seqlens`` tensor."""
    cache = cu_seqlens.__dict__.setdefault(name, {})
    if key not in cache:
        cache[key] = make()
    return cache[key]


def host_side(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values, marked as living on the host on every device."""
    return _alias(t, HOST_SIDE_MARK, True)


def to_device(t: torch.Tensor, device, dtype=None) -> torch.Tensor:
    """``t`` on ``device`` (non-blocking), carrying its host copy for ``on_host``."""
    host = t if dtype is None else t.to(dtype)
    if torch.device(device).type == "cuda" and not host.is_pinned():
        host = host.pin_memory()  # from pageable memory the copy may wait for the stream
    moved = host.to(device, non_blocking=True)
    return _alias(moved, _HOST_COPY, host_side(host)) if moved is host else _keep(moved, _HOST_COPY, host_side(host))


def _alias(t: torch.Tensor, name: str, value) -> torch.Tensor:
    # What is kept goes on a new tensor object over the same values, never on the caller's: a tensor's
    # attributes are pickled with it, and megatron's rerun state machine saves the collated batches.
    return _keep(t.detach(), name, value)


def _keep(t: torch.Tensor, name: str, value) -> torch.Tensor:
    t.__dict__[name] = value
    return t


def mapped(t: torch.Tensor, fn) -> torch.Tensor:
    """``fn(t)``, carrying ``fn`` of ``t``'s host copy where ``t`` has one (a batch padded on the device
    keeps what the host reads of it without a sync)."""
    out = fn(t)
    host = t.__dict__.get(_HOST_COPY)
    return out if host is None else _keep(out, _HOST_COPY, host_side(fn(host)))


def on_host(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values on the host: the copy it was moved from, else read back (a sync on a GPU)."""
    host = t.__dict__.get(_HOST_COPY)
    return host if host is not None else t.cpu()
