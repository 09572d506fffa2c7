"""Torch reference kernels for GatedDeltaNet with the signatures of flash-linear-attention (FLA).

megatron-core's ``GatedDeltaNet`` imports ``chunk_gated_delta_rule``, ``causal_conv1d`` and
``l2norm`` from FLA, whose Triton kernels need a GPU. These functions take the same arguments
and return the same tuples, so the megatron-core layer runs unchanged on a CPU host; they are
also the numerical reference the tests compare against.

Layouts (FLA's): ``x_BTD`` is [batch, tokens, channels]; q/k are [B, T, H, K], v is
[B, T, H, V] (megatron-core has already repeated q/k heads up to the value heads), g and beta
are [B, T, H]. With ``cu_seqlens`` the batch is a single packed row (B == 1) holding
``len(cu_seqlens) - 1`` independent sequences: no state crosses a boundary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunk_gated_delta_rule", "causal_conv1d", "l2norm"]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, output_dtype=None) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) along ``dim``, computed in fp32 (FLA's definition)."""
    y = x.float() * torch.rsqrt(x.float().pow(2).sum(dim=dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def _segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Index of the packed sequence each token belongs to, [T] (long)."""
    bounds = cu_seqlens[1:].to(torch.long)
    return torch.bucketize(torch.arange(total, device=cu_seqlens.device), bounds, right=True)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **unused,
) -> tuple[torch.Tensor, None]:
    """Depthwise causal conv1d over x [B, T, D] with weight [D, W]; the window never reaches
    across a ``cu_seqlens`` boundary (each packed sequence starts from a zero state)."""
    if initial_state is not None or output_final_state:
        raise NotImplementedError(
            "the CPU causal_conv1d has no conv-state carry (initial_state / output_final_state); "
            "it serves training forward/backward, where megatron-core passes neither"
        )
    batch, total, channels = x.shape
    width = weight.shape[-1]
    x_f = x.float()
    # The depthwise conv runs channels-first on a contiguous row (a transposed view is copied
    # inside conv1d anyway, and its backward is ~3x slower on a strided input).
    if cu_seqlens is None:
        row, take = F.pad(x_f.transpose(1, 2), (width - 1, 0)), None  # zeros before the row
    else:
        if batch != 1:
            raise ValueError(f"cu_seqlens requires a single packed row, got batch={batch}")
        # Every sequence gets width - 1 zeros in front of it, so one conv over the row never
        # mixes neighbours; token t then sits at t + (its sequence index + 1) * (width - 1).
        seg = _segment_ids(cu_seqlens, total)
        dest = torch.arange(total, device=x.device) + (seg + 1) * (width - 1)
        row = x_f.new_zeros(1, channels, total + (cu_seqlens.numel() - 1) * (width - 1))
        row[0, :, dest] = x_f[0].T
        take = dest - (width - 1)
    # Output j covers row[j .. j + width - 1], i.e. the token at row position j + width - 1.
    out = F.conv1d(row, weight.float()[:, None, :], None if bias is None else bias.float(), groups=channels)
    out = (out if take is None else out[:, :, take]).transpose(1, 2)
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r} (expected 'silu' or None)")
    return out.to(x.dtype), None


def _pack_chunk_aligned(tensors, cu_seqlens: torch.Tensor, chunk: int):
    """[1, T, ...] packed tensors -> [1, T', ...] with every sequence zero-padded to a multiple
    of ``chunk`` (at least one chunk), so no chunk holds two sequences. Returns the row, the
    destination of each original token, and the sequence index of every chunk."""
    total = tensors[0].shape[1]
    cu = cu_seqlens.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    chunks_per_seq = ((lengths + chunk - 1) // chunk).clamp(min=1)
    starts = (chunks_per_seq.cumsum(0) - chunks_per_seq) * chunk
    seg = _segment_ids(cu_seqlens, total)
    dest = starts[seg] + torch.arange(total, device=cu.device) - cu[seg]
    width = int(chunks_per_seq.sum()) * chunk
    out = []
    for t in tensors:
        buf = t.new_zeros((1, width) + tuple(t.shape[2:]))
        buf[0, dest] = t[0]
        out.append(buf)
    chunk_seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), chunks_per_seq)
    return out, dest, chunk_seq.tolist()


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    **unused,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, chunked. Recurrence per head, with state S [K, V]:

        S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = scale S_t^T q_t

    Returns (o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32 or None).
    """
    out_dtype = q.dtype
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    dest = chunk_seq = None
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"cu_seqlens requires a single packed row, got batch={q.shape[0]}")
        (q, k, v, g, beta), dest, chunk_seq = _pack_chunk_aligned((q, k, v, g, beta), cu_seqlens, chunk_size)
    o, state = _chunked_scan(q, k, v, g, beta, scale, initial_state, chunk_size, chunk_seq)
    if dest is not None:
        o = o[0, dest].unsqueeze(0)
    return o.to(out_dtype), (state if output_final_state else None)


def _chunked_scan(q, k, v, g, beta, scale, initial_state, chunk, chunk_seq=None):
    """Dense [N, L, H, *] fp32 inputs; L is padded here to a multiple of ``chunk``. Zero padding
    is inert: k = 0 and beta = 0 leave the state unchanged and g = 0 does not decay it.

    ``chunk_seq`` (with N = 1): the packed sequence of every chunk; the state restarts (from
    zero or that sequence's initial state) where the sequence changes, and the final state of
    each sequence is returned [num_sequences, H, K, V]. Everything but the walk over chunks is
    batched over all chunks of all sequences, so packing costs no padding to the longest."""
    n, length, heads, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    n_chunks = (length + pad) // chunk

    # -> [N, H, n_chunks, C, *]
    def to_chunks(t):
        t = t.transpose(1, 2)
        return t.reshape(t.shape[0], t.shape[1], n_chunks, chunk, *t.shape[3:])

    q, k, v = to_chunks(q) * scale, to_chunks(k), to_chunks(v)
    g, beta = to_chunks(g), to_chunks(beta)
    gamma = g.cumsum(-1)  # log of the decay accumulated from the chunk start, inclusive
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay_ij = exp(gamma_i - gamma_j) for j <= i, else 0 (masked before exp: no overflow)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    # WY form: (I + A) u = beta v and (I + A) w = beta exp(gamma) k, A strictly lower.
    k_beta = k * beta[..., None]
    a_strict = (k_beta @ k.transpose(-1, -2)) * decay
    a_strict = a_strict.masked_fill(~causal.tril(-1), 0.0)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    system = eye + a_strict
    # One triangular solve for both right-hand sides (they share the system matrix).
    uw = torch.linalg.solve_triangular(system, torch.cat([v * beta[..., None], k_beta * gamma.exp()[..., None]], -1),
                                       upper=False, unitriangular=True)
    u, w = uw[..., :dv], uw[..., dv:]
    qk_intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]

    def start_state(seq):
        if initial_state is None:
            return q.new_zeros(1 if seq is not None else n, heads, dk, dv)
        return initial_state.float()[seq:seq + 1].clone() if seq is not None else initial_state.float().clone()

    state = start_state(chunk_seq[0] if chunk_seq else None)
    finals = []
    outs = []
    # Split into per-chunk views once: indexing chunk c inside the loop would make autograd
    # write a full-size zero gradient for every chunk (quadratic in the number of chunks).
    per_chunk = zip(*(t.unbind(2) for t in (u, w, q_decayed, qk_intra, k_to_end, chunk_decay)))
    for c, (u_c, w_c, q_c, qk_c, k_end_c, decay_c) in enumerate(per_chunk):
        if chunk_seq and c and chunk_seq[c] != chunk_seq[c - 1]:
            finals.append(state)
            state = start_state(chunk_seq[c])
        v_new = u_c - w_c @ state
        outs.append(q_c @ state + qk_c @ v_new)
        state = state * decay_c + k_end_c.transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(n, heads, n_chunks * chunk, dv)[:, :, :length]
    if chunk_seq:
        state = torch.cat(finals + [state], dim=0)
    return o.transpose(1, 2), state


def recurrent_gated_delta_rule_reference(q, k, v, g, beta, scale=None):
    """Token-by-token recurrence on dense [B, T, H, *] inputs: the definition the chunked kernel
    must reproduce. Slow; used by tests only."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    b, t_len, h, dk = k.shape
    state = q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for t in range(t_len):
        state = state * g[:, t].exp()[..., None, None]
        pred = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - pred) * beta[:, t][..., None]
        state = state + k[:, t][..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t] * scale))
    return torch.stack(outs, dim=1)
