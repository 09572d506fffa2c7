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

import functools

import torch
import torch.nn.functional as F

__all__ = ["chunk_gated_delta_rule", "causal_conv1d", "l2norm"]

# Where a tensor moved to the device from the host keeps its host copy: the training batch's segment
# bounds carry one (examples/multimodal_dev/models/common/batch_memo.py, ``to_device``).
HOST_COPY = "_host_copy"


def _compute(t: torch.Tensor) -> torch.Tensor:
    """The dtype the kernels compute in: fp32, or float64 for float64 inputs (the float64 reference
    tests compare FLA and these kernels against)."""
    return t if t.dtype == torch.float64 else t.float()


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, output_dtype=None) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) along ``dim``, computed in fp32 (FLA's definition)."""
    y = _compute(x) * torch.rsqrt(_compute(x).pow(2).sum(dim=dim, keepdim=True) + eps)
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
    x_f = _compute(x)
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
    out = F.conv1d(row, _compute(weight)[:, None, :], None if bias is None else _compute(bias), groups=channels)
    out = (out if take is None else out[:, :, take]).transpose(1, 2)
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r} (expected 'silu' or None)")
    return out.to(x.dtype), None


class _StepMajorChunks:
    """Where every token of a packed row goes in the chunked scan's layout.

    The scan walks each sequence's chunks in order, but sequences are independent, so step j
    advances chunk j of every sequence still running in one batched matmul: a packed row takes
    as many steps as its longest sequence has chunks. Chunks are stored step-major, [M, H, C, *]:
    step 0's chunks, then step 1's, ...; within a step, sequences longest first, so the ones
    still running are always a prefix of the state batch. Every sequence is zero-padded to whole
    chunks (at least one), so no chunk holds two sequences.
    """

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, total: int, chunk: int) -> _StepMajorChunks:
        """The layout of this micro-batch's segments, made once for every layer that asks (kept on the
        tensor) and from its host copy where it has one: made from the device tensor it reads the
        segment lengths back, three syncs a layer on a GPU."""
        kept = cu_seqlens.__dict__.setdefault("_step_major_chunks", {})
        if (total, chunk) not in kept:
            host = cu_seqlens.__dict__.get(HOST_COPY)
            layout = cls(cu_seqlens if host is None else host, total, chunk)
            kept[(total, chunk)] = layout.to(cu_seqlens.device)
        return kept[(total, chunk)]

    def __init__(self, cu_seqlens: torch.Tensor, total: int, chunk: int):
        cu = cu_seqlens.to(torch.long)
        lengths = cu[1:] - cu[:-1]
        per_seq = ((lengths + chunk - 1) // chunk).clamp(min=1)
        self.order = torch.argsort(per_seq, descending=True, stable=True)  # sequence of each state row
        rank = torch.empty_like(self.order)
        rank[self.order] = torch.arange(self.order.numel(), device=cu.device)
        steps = int(per_seq.max())
        active = (per_seq[None, :] > torch.arange(steps, device=cu.device)[:, None]).sum(1)  # per step
        self.active = active.tolist()
        step_start = active.cumsum(0) - active
        seg = _segment_ids(cu_seqlens, total)
        pos = torch.arange(total, device=cu.device) - cu[seg]
        self.chunk_of = step_start[pos // chunk] + rank[seg]  # [T]: the chunk each token lands in
        self.pos_in_chunk = pos % chunk
        self.num_chunks, self.chunk = int(active.sum()), chunk

    def to(self, device) -> _StepMajorChunks:
        for name in ("order", "chunk_of", "pos_in_chunk"):
            setattr(self, name, getattr(self, name).to(device, non_blocking=True))
        return self

    def scatter(self, t: torch.Tensor) -> torch.Tensor:
        """[1, T, H, *] -> [M, H, C, *] (zeros where no token lands)."""
        out = t.new_zeros((self.num_chunks, t.shape[2], self.chunk) + tuple(t.shape[3:]))
        out[self.chunk_of, :, self.pos_in_chunk] = t.squeeze(0)  # a view each way; t[0]'s backward fills zeros
        return out

    def gather(self, chunks: torch.Tensor) -> torch.Tensor:
        """[M, H, C, *] -> [1, T, H, *]."""
        return chunks[self.chunk_of, :, self.pos_in_chunk].unsqueeze(0)


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

    Returns (o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32 (float64 for float64 inputs)
    or None), N = B or the number of packed sequences.
    """
    out_dtype = q.dtype
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q, k, v, g, beta = (_compute(t) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    batch, length = q.shape[:2]
    if cu_seqlens is None:  # B rows of equal length are B packed sequences of one row
        cu_seqlens = torch.arange(batch + 1, device=q.device) * length
        q, k, v, g, beta = (t.reshape(1, batch * length, *t.shape[2:]) for t in (q, k, v, g, beta))
    elif batch != 1:
        raise ValueError(f"cu_seqlens requires a single packed row, got batch={batch}")
    layout = _StepMajorChunks.of(cu_seqlens, q.shape[1], chunk_size)
    heads = q.shape[2]
    start = None if initial_state is None else _compute(initial_state)[layout.order].flatten(0, 1)
    rows = tuple(a * heads for a in layout.active)
    o, final = _chunked_scan(*(layout.scatter(t).flatten(0, 1) for t in (q, k, v, g, beta)), scale, start, rows)
    o = layout.gather(o.view(-1, heads, *o.shape[1:])).reshape(batch, length, heads, o.shape[-1])
    final = final.view(-1, heads, *final.shape[1:])
    state = torch.empty_like(final)
    state[layout.order] = final
    return o.to(out_dtype), (state if output_final_state else None)


@functools.cache
def _chunk_masks(chunk: int, dtype: torch.dtype, device: torch.device):
    """(not causal, not strictly causal, identity) for a chunk: made once, not in every layer."""
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
    return ~causal, ~causal.tril(-1), torch.eye(chunk, dtype=dtype, device=device)


def _chunked_scan(q, k, v, g, beta, scale, start_state, rows):
    """Step-major chunks, one (chunk, head) pair a row: [R, C, *] (fp32 or float64) -> (o [R, C, V], final
    states [S * H, K, V] of the sequences longest first, heads inner). ``rows[j]``: the rows of the
    sequences running at step j (non-increasing). Zero padding is inert: k = 0 and beta = 0 leave the
    state unchanged and g = 0 does not decay it. 3-D tensors and bmm throughout: a 4-D matmul costs the
    host an expand and two reshapes each way."""
    chunk, dk, dv = q.shape[1], k.shape[-1], v.shape[-1]
    not_causal, not_strict, eye = _chunk_masks(chunk, q.dtype, q.device)
    gamma = g.cumsum(-1)  # log of the decay accumulated from the chunk start, inclusive
    # decay_ij = exp(gamma_i - gamma_j) for j <= i, else 0 (masked before exp: no overflow)
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(not_causal, float("-inf")).exp()
    grown = gamma.exp().unsqueeze(-1)  # exp(gamma): the decay from the chunk start to each token

    # WY form: (I + A) u = beta v and (I + A) w = beta exp(gamma) k, A strictly lower.
    beta = beta.unsqueeze(-1)
    k_beta, k_t = k * beta, k.mT
    system = (torch.bmm(k_beta, k_t) * decay).masked_fill_(not_strict, 0.0).add_(eye)
    rhs = (v * beta, k_beta * grown)
    # The triangular solve (and its backward) costs in proportion to the right-hand side's
    # width: solve for both right-hand sides at once (V + K wide) or for the inverse (C wide),
    # whichever is narrower, then apply the inverse with batched matmuls.
    if dv + dk <= chunk:
        uw = torch.linalg.solve_triangular(system, torch.cat(rhs, -1), upper=False, unitriangular=True)
        u, w = uw[..., :dv], uw[..., dv:]
    else:
        inverse = torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False, unitriangular=True)
        u, w = torch.bmm(inverse, rhs[0]), torch.bmm(inverse, rhs[1])
    k_to_end = (k * (gamma[:, -1:] - gamma).exp().unsqueeze(-1)).mT
    chunk_decay = gamma[:, -1:].exp().unsqueeze(-1)
    q = q * scale
    qk_intra = torch.bmm(q, k_t) * decay
    return _ChunkScan.apply(u, w, q * grown, qk_intra, k_to_end, chunk_decay, start_state, rows)


class _ChunkScan(torch.autograd.Function):
    """The sequential part of the scan, chunk step by chunk step, with its backward written out.

    Per step and (sequence, head), with S the state entering the chunk:

        v_new = u - w S;   o = q S + qk v_new;   S' = d S + k_end v_new

    Autograd through this loop dispatched ~64 ATen ops a step, eight per op written (4-D matmuls expand,
    reshape and copy) and records the loop for backward; on a GPU every op costs the host its launch,
    which on Hopper (where FLA's gated backward is refused) made this loop the largest share of the
    host's work per training step. Here a step is three ops forward (the outputs come from the stacked
    states in two batched matmuls after the loop) and three backward: the reverse loop carries only
    the state's gradient, and every weight's gradient is one batched matmul over all chunks after it.

    Inputs are step-major chunks, one (chunk, head) pair a row, [R, C, *]; ``rows[j]``: the rows of
    step j (non-increasing). Returns o [R, C, V] and the final states [S * H, K, V], longest first.
    """

    @staticmethod
    def forward(ctx, u, w, q, qk, k_end, decay, start, rows):
        state = start if start is not None else u.new_zeros(rows[0], w.shape[-1], u.shape[-1])
        entering, v_new, finals = [], [], []
        for r, u_c, w_c, k_c, d_c in zip(rows, *(t.split(rows) for t in (u, w, k_end, decay))):
            if r < state.shape[0]:  # the shortest sequences have ended: their states are final
                finals.append(state[r:])
                state = state[:r]
            entering.append(state)
            v_new.append(torch.baddbmm(u_c, w_c, state, alpha=-1))
            state = torch.baddbmm(state * d_c, k_c, v_new[-1])
        finals.append(state)
        s_in, v_new = torch.cat(entering), torch.cat(v_new)
        o = torch.baddbmm(torch.bmm(qk, v_new), q, s_in)
        ctx.save_for_backward(w, q, qk, k_end, decay, s_in, v_new)
        ctx.rows, ctx.has_start = rows, start is not None
        return o, torch.cat(finals[::-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_o, d_final):
        w, q, qk, k_end, decay, s_in, v_new = ctx.saved_tensors
        rows = ctx.rows
        # What o sends to each chunk's v_new and entering state, for all chunks at once.
        dv_from_o, ds_from_o = torch.bmm(qk.mT, d_o), torch.bmm(q.mT, d_o)
        per_step = (t.split(rows) for t in (dv_from_o, ds_from_o, w.mT, k_end.mT, decay))
        d_state, d_v_new, d_out = d_final[: rows[-1]], [], []
        for r, dv_c, ds_c, w_t, k_t, d_c in reversed(list(zip(rows, *per_step))):
            if r > d_state.shape[0]:  # sequences that ended after this step: their final state's gradient
                d_state = torch.cat([d_state, d_final[d_state.shape[0] : r]])
            d_out.append(d_state)  # the gradient of the state this step leaves
            d_v_new.append(torch.baddbmm(dv_c, k_t, d_state))
            d_state = torch.baddbmm(torch.addcmul(ds_c, d_state, d_c), w_t, d_v_new[-1], alpha=-1)
        d_v_new, d_out = torch.cat(d_v_new[::-1]), torch.cat(d_out[::-1])
        return (
            d_v_new,  # u
            torch.bmm(d_v_new, s_in.mT).neg_(),  # w
            torch.bmm(d_o, s_in.mT),  # q
            torch.bmm(d_o, v_new.mT),  # qk
            torch.bmm(d_out, v_new.mT),  # k_end
            (d_out * s_in).sum((-2, -1), keepdim=True),  # decay
            d_state if ctx.has_start else None,
            None,
        )


def recurrent_gated_delta_rule_reference(q, k, v, g, beta, scale=None):
    """Token-by-token recurrence on dense [B, T, H, *] inputs: the definition the chunked kernel
    must reproduce. Slow; used by tests only."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (_compute(t) for t in (q, k, v, g, beta))
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
