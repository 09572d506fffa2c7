"""Context-parallel split of a micro-batch: one index per rank, applied once to every per-token tensor.

Layouts (the load-balanced convention of megatron-core and Transformer Engine, so causal
attention costs the same on every rank):

    THD   every packed sample (padded length L_i, a multiple of 2*cp) is cut into 2*cp equal
          chunks; CP rank r keeps chunks r and 2cp-1-r of every sample, samples in row order.
          Rank r's slice of sample i starts at cu_seqlens_padded[i] / cp.
    BSHD  the row (length S, a multiple of 2*cp) is cut into 2*cp chunks; rank r keeps r, 2cp-1-r.

``positions`` are the global row positions a rank keeps, in its local order. ``take`` slices a
tensor to them; ``place`` is the inverse (scatters a local tensor into a global-length one),
for consumers that slice by the same rule themselves (megatron-core's THD rotary).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch_memo import on_host


def _runs(starts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(start, start + size) for every (start, size), vectorised."""
    offsets = torch.arange(int(sizes.sum())) - torch.repeat_interleave(F.pad(sizes.cumsum(0), (1, 0))[:-1], sizes)
    return torch.repeat_interleave(starts, sizes) + offsets


def thd_positions(cu_seqlens_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    cu = on_host(cu_seqlens_padded).to(torch.long)  # the batch's host copy: no read back from the GPU
    lengths = torch.diff(cu)
    if bool((lengths % (2 * cp)).any()):
        raise ValueError(
            f"context parallel size {cp}: padded sample lengths {lengths.tolist()} must be multiples "
            f"of 2*cp={2 * cp} (the collate pads to that when given the same --context-parallel-size)"
        )
    chunk = lengths // (2 * cp)
    starts = torch.stack([cu[:-1] + rank * chunk, cu[:-1] + (2 * cp - 1 - rank) * chunk], dim=1).reshape(-1)
    return _runs(starts, chunk.repeat_interleave(2))


def bshd_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    if seq_len % (2 * cp):
        raise ValueError(
            f"context parallel size {cp}: the padded row length {seq_len} must be a multiple of 2*cp={2 * cp}"
        )
    chunk = seq_len // (2 * cp)
    return _runs(torch.tensor([rank * chunk, (2 * cp - 1 - rank) * chunk]), torch.tensor([chunk, chunk]))


class ContextParallelSplit:
    """The positions one CP rank keeps of a row of ``seq_len`` tokens."""

    def __init__(self, seq_len: int, cp: int, rank: int, cu_seqlens_padded: torch.Tensor | None = None):
        self.seq_len, self.cp, self.rank = seq_len, cp, rank
        if cu_seqlens_padded is not None:
            end = int(on_host(cu_seqlens_padded)[-1])
            if end != seq_len:
                raise ValueError(f"cu_seqlens_padded ends at {end} but the row has {seq_len} tokens")
            self.positions = thd_positions(cu_seqlens_padded, cp, rank)
        else:
            self.positions = bshd_positions(seq_len, cp, rank)

    @classmethod
    def for_row(cls, seq_len: int, cp_group, packed_seq_params=None) -> "ContextParallelSplit | None":
        """This rank's share of a row of ``seq_len`` tokens (THD when ``packed_seq_params`` says
        so, else BSHD), or None without context parallelism."""
        if cp_group is None or cp_group.size() == 1:
            return None
        cu_padded = None
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_padded = packed_seq_params.cu_seqlens_q_padded
        return cls(seq_len, cp_group.size(), cp_group.rank(), cu_padded)

    def take(self, tensor: torch.Tensor | None, dim: int) -> torch.Tensor | None:
        if tensor is None:
            return None
        if tensor.shape[dim] != self.seq_len:
            raise ValueError(
                f"context-parallel split: dim {dim} of a {tuple(tensor.shape)} tensor is not the row "
                f"length {self.seq_len} (already split, or not a per-token tensor)"
            )
        return tensor.index_select(dim, self.positions.to(tensor.device))

    def place(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """A global-length tensor holding ``local`` at this rank's positions and zeros elsewhere."""
        shape = list(local.shape)
        shape[dim] = self.seq_len
        out = local.new_zeros(shape)
        return out.index_copy(dim, self.positions.to(local.device), local)


def process_groups_without_context_parallel():
    """megatron-core's default process groups, except a CP group of this rank alone: for towers
    that see whole inputs on every CP rank (the vision tower). None before parallel_state is set up."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not parallel_state.model_parallel_is_initialized():
        return None
    groups = ProcessGroupCollection.use_mpu_process_groups()
    if groups.cp.size() > 1:
        groups.cp = _own_rank_group()
    return groups


_OWN_RANK_GROUP = None


def _own_rank_group():
    """A process group of this rank alone (created collectively, once)."""
    global _OWN_RANK_GROUP
    if _OWN_RANK_GROUP is None:
        _OWN_RANK_GROUP, _ = torch.distributed.new_subgroups(group_size=1)
    return _OWN_RANK_GROUP
