"""Values derived from one micro-batch's packed-sequence boundaries, computed once and kept on the
``cu_seqlens`` tensor they come from.

Every attention and Gated DeltaNet layer of a tower, query and key alike, asks for the same ones:
recomputed per layer they cost eager ops, and read back to the host per layer a device sync each.
The tensor lives as long as its micro-batch, and so does what is kept on it.
"""

from __future__ import annotations

import torch


def kept_on(cu_seqlens: torch.Tensor, name: str, key, make):
    """``make()``, computed the first time ``(name, key)`` is asked of this ``cu_seqlens`` tensor."""
    cache = cu_seqlens.__dict__.setdefault(name, {})
    if key not in cache:
        cache[key] = make()
    return cache[key]
