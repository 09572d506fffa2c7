"""Context-parallel THD attention as one variable-length kernel call.

Under CP each packed sample of length L arrives in megatron-core's load-balanced layout: rank r holds
chunk r and chunk 2cp-1-r of its 2cp chunks of c = L / 2cp tokens, in that order. A chunk's queries,
at global positions [a, a + c) of their sample, attend causally to the sample's keys [0, a + c): a
query segment of c rows against a key segment, the sample's key prefix of a + c rows, with the
causal mask aligned to the segment's last key (flash's bottom-right alignment, checked once a
process by ``varlen_attention.bottom_right_causal``). Without causality a chunk attends to its whole
sample. So every local query chunk is one segment of one varlen call, whose key segments are rows
gathered from the sample-ordered keys; the per-sample loop it replaces made a mask and an SDPA call
per sample, forward and backward.

The key prefixes repeat keys (chunk r's prefix lies inside chunk 2cp-1-r's): about (2cp + 1) / 2cp
times the sample's keys, gathered with one index.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CPSegments:
    key_rows: torch.Tensor  # [sum of key segments] rows of the sample-ordered keys, on the host
    cu_q: torch.Tensor  # int32 [segments + 1], local query rows
    cu_k: torch.Tensor  # int32 [segments + 1], rows of the gathered key segments
    max_q: int
    max_k: int

    def on(self, device) -> "CPSegments":
        """The index and offsets on ``device`` (copied once a micro-batch, not once a layer; the
        offsets keep their host copy, ``batch_memo.on_host``)."""
        from .batch_memo import to_device

        key_rows, cu_q, cu_k = (to_device(t, device) for t in (self.key_rows, self.cu_q, self.cu_k))
        return CPSegments(key_rows, cu_q, cu_k, self.max_q, self.max_k)


def cp_segments(bounds: list[int], cp: int, rank: int, causal: bool) -> CPSegments:
    """The varlen call's segments for this rank's queries; ``bounds``: the packed samples' global
    boundaries (each a multiple of 2cp long, as the CP split pads them)."""
    rows: list[int] = []
    q_lengths: list[int] = []
    k_lengths: list[int] = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * cp)
        if chunk == 0:
            continue
        for position in (rank, 2 * cp - 1 - rank):
            keys = (position + 1) * chunk if causal else end - start
            rows += range(start, start + keys)
            q_lengths.append(chunk)
            k_lengths.append(keys)

    def offsets(lengths: list[int]) -> torch.Tensor:  # host arithmetic: no tensor is read back
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)

    return CPSegments(
        key_rows=torch.tensor(rows, dtype=torch.long),
        cu_q=offsets(q_lengths),
        cu_k=offsets(k_lengths),
        max_q=max(q_lengths, default=0),
        max_k=max(k_lengths, default=0),
    )
