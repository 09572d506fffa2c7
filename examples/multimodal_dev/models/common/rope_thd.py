"""Rotary embeddings on a packed (THD) row in one pass: megatron-core's unfused
``_apply_rotary_pos_emb_thd`` without its per-sequence Python loop.

megatron-core splits the row at ``cu_seqlens`` (reading it back to the host: a sync per call),
picks each sequence's rotary rows (and, under context parallelism, the two zigzag chunks this rank
holds), and rotates sequence by sequence: ~10 eager ops a sequence. The vision tower alone calls it
twice per block on every image frame of the micro-batch. Here every token's rotary row is computed
as one index on the device, and the rotation is one elementwise pass; the result is the same
tensor (the rotation is elementwise, so rotating per sequence or all at once is the same arithmetic).

    t_TND      [T, heads, dim]   this rank's tokens of the packed row (T = sum(lengths) / cp)
    cu_seqlens [n + 1]           global boundaries (each length a multiple of 2 * cp under CP)
    freqs      [S, 1, 1, rot]    rotary rows: S = T * cp, one per token of the whole packed row
                                 (positions already laid out per token, as MRoPE gives them), or
                                 S >= the longest sequence, each sequence counting from 0
"""

from __future__ import annotations

import torch

from .batch_memo import kept_on


def token_rotary_rows(cu_seqlens: torch.Tensor, local_tokens: int, cp_size: int, cp_rank: int, packed: bool):
    """[T] index into ``freqs`` of every local token: its position in its sequence (the zigzag chunks
    ``cp_rank`` and ``2 cp - 1 - cp_rank`` under CP), plus the sequence's start in the row when
    ``packed`` (freqs hold one row per token of the whole packed row)."""
    cu = cu_seqlens.to(torch.long)
    local_cu = cu // cp_size
    token = torch.arange(local_tokens, device=cu.device)
    seq = torch.bucketize(token, local_cu[1:], right=True)
    within = token - local_cu[seq]
    if cp_size > 1:
        half = (local_cu[seq + 1] - local_cu[seq]) // 2
        full = cu[seq + 1] - cu[seq]
        within = torch.where(within < half, cp_rank * half + within, full - (cp_rank + 1) * half + (within - half))
    return within + cu[seq] if packed else within


def rotary_thd(original, run=None):
    """The replacement for ``rope_utils._apply_rotary_pos_emb_thd`` (same signature, same result)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd, _rotate_half

    def apply(
        t,
        cu_seqlens,
        freqs,
        rotary_interleaved=False,
        mla_rotary_interleaved=False,
        mscale=1.0,
        cp_group=None,
        multi_latent_attention=None,
    ):
        if multi_latent_attention is not None:
            mla_rotary_interleaved = multi_latent_attention
        if cp_group is None:
            raise ValueError("cp_group must be provided for THD format RoPE")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        # megatron splits t at cu_seqlens / cp, so the row's global length is t's times cp; freqs with
        # one row per token of it are "packed" (megatron's has_packed_freqs), read without a sync
        packed = freqs.dim() >= 1 and freqs.size(0) == t.shape[0] * cp_size
        layout = (t.shape[0], cp_size, cp_rank, packed)
        rows = kept_on(cu_seqlens, "_rotary_rows", layout, lambda: token_rotary_rows(cu_seqlens, *layout))
        if mla_rotary_interleaved:  # MLA's layout: megatron's own rotation (no Qwen3.5 layer uses it)
            return _apply_rotary_pos_emb_bshd(
                t.unsqueeze(1), freqs[rows], rotary_interleaved, mla_rotary_interleaved, mscale
            ).squeeze(1)

        def cos_sin():
            token_freqs = freqs[rows].reshape(t.shape[0], 1, -1)  # [T, 1, rot]: broadcast over the heads
            cos_ = (torch.cos(token_freqs) * mscale).to(t.dtype)
            sin_ = (torch.sin(token_freqs) * mscale).to(t.dtype)
            if not rotary_interleaved:  # for the roll below: rotate_half(x) * sin == roll(x) * [-sin1, sin2]
                half = sin_.shape[-1] // 2
                sin_ = torch.cat((-sin_[..., :half], sin_[..., half:]), dim=-1)
            return freqs, cos_, sin_

        # keyed by the table too (another tower's, with the same segments, is another entry); the entry
        # holds the table, so its id cannot pass to another tensor while the entry lives
        key = (*layout, t.dtype, mscale, rotary_interleaved, id(freqs))
        _, cos_, sin_ = kept_on(cu_seqlens, "_rotary_cos_sin", key, cos_sin)
        # megatron's _apply_rotary_pos_emb_bshd with the cosines and sines computed once per micro-batch.
        # Its rotate_half (chunk, negate, concatenate) is one roll here, the sign folded into the sines:
        # the same products bit for bit, in four ops forward and four backward where it took ~25 (the
        # vision tower rotates q and k in every block)
        rot = freqs.shape[-1]
        x = t if rot == t.shape[-1] else t[..., :rot]
        if rotary_interleaved:  # megatron's (no Qwen3.5 layer rotates interleaved)
            turned = _rotate_half(x.unsqueeze(1), True).squeeze(1)
        else:
            turned = torch.roll(x, rot // 2, dims=-1)
        out = x * cos_ + turned * sin_
        return out if x is t else torch.cat((out, t[..., rot:]), dim=-1)

    return apply
