"""Core attention on torch SDPA: the local backend's attention on every host (CPU, and GPUs without
Transformer Engine, where SDPA dispatches to its fused flash / memory-efficient kernels).

A drop-in for megatron-core's ``core_attention`` submodule (same constructor and forward as
``DotProductAttention``) that also handles packed THD batches:

    BSHD  q [s, b, np, hn], k/v [s, b, ng, hn]   -> [s, b, np*hn]
    THD   q [t, np, hn],    k/v [t, ng, hn]      -> [t, np*hn]   (segments from cu_seqlens)

Segments come from ``cu_seqlens_q_padded`` when present (the packed tensor is laid out on the
padded boundaries; the tail padding of a sample sits after its real tokens, so causal attention
of real tokens never sees it). A THD batch runs on torch's variable-length flash kernel where
``varlen_attention.thd_kernel`` allows it (CUDA, bf16/fp16, ``--attention-backend`` auto or flash),
else on one SDPA call per packed sample.

Context parallelism (``pg_collection.cp`` of size cp > 1): the sequence arrives split in
megatron-core's load-balanced layout (per packed sample for THD, per row for BSHD: rank r holds
chunks r and 2cp-1-r). Keys and values are all-gathered over the CP group (gradients
reduce-scattered back), put into global order with megatron-core's own layout helpers, and each
local query attends to the global keys of its sample with the causal mask taken from global
positions. Where a THD call runs on varlen, that is one varlen call, each local query chunk against
its key prefix (``cp_varlen.py``); elsewhere one SDPA call per sample with the mask written out
(memory O(local queries x sample length) per sample).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.module import MegatronModule

from .batch_memo import host_side, kept_on, on_host
from .cp_varlen import cp_segments
from .varlen_attention import VARLEN, bottom_right_causal, thd_kernel, torch_varlen, varlen_failed

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)


class SDPACoreAttention(MegatronModule):
    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        **unused,
    ):
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.cp_group is None and config.context_parallel_size > 1:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()
        self.cp_size = self.cp_group.size() if self.cp_group is not None else 1
        self.attention_backend = config.attention_backend

    def _attend(self, q, k, v, causal: bool, mask=None):
        """q [b, np, s, hn], k/v [b, ng, s, hn]; grouped-query heads are shared in blocks."""
        if k.shape[1] != q.shape[1]:
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        dropout = self.dropout_p if self.training else 0.0
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=causal and mask is None,
            scale=self.softmax_scale,
        )

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention does not take an attention_bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in _CAUSAL
        if self.cp_size > 1:
            if attention_mask is not None:
                raise NotImplementedError("SDPACoreAttention: an explicit attention_mask under context parallelism")
            return self._forward_cp(query, key, value, packed_seq_params, causal)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_thd(query, key, value, packed_seq_params, causal)
        # BSHD: [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None
        if attention_mask is not None:
            # megatron convention: True marks a position that must NOT be attended.
            keep = ~attention_mask.to(torch.bool)
            if causal:
                s_q, s_k = q.shape[2], k.shape[2]
                keep = keep & torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
            mask = keep
        out = self._attend(q, k, v, causal, mask)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    @staticmethod
    def _segments(params) -> tuple[torch.Tensor, list[int]]:
        """(cu_seqlens on the device, the same bounds on the host: the batch's host copy, read once a
        micro-batch; reading them back in each layer stopped the host at every attention layer)."""
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv

        def host_bounds() -> list[int]:
            if cu_kv is not None and cu_kv is not cu and not torch.equal(on_host(cu), on_host(cu_kv)):
                raise NotImplementedError("SDPACoreAttention THD needs identical q and kv segments")
            return on_host(cu).tolist()

        return cu, kept_on(cu, "_host_bounds", (), host_bounds)

    def _forward_thd(self, query, key, value, params, causal: bool):
        cu, bounds = self._segments(params)
        if bounds[-1] != query.shape[0]:
            raise ValueError(f"THD: cu_seqlens ends at {bounds[-1]} but the packed row has {query.shape[0]} tokens")
        dropout = self.dropout_p if self.training else 0.0
        kernel, _ = thd_kernel(self.attention_backend, query.is_cuda, query.dtype, query.shape[-1], dropout)
        if kernel == VARLEN:  # one kernel over the whole row
            max_len = max(end - start for start, end in zip(bounds[:-1], bounds[1:]))
            try:
                out = torch_varlen()(
                    query.contiguous(), key.contiguous(), value.contiguous(), cu, max_len, causal, self.softmax_scale
                )
                return out.reshape(out.shape[0], -1)
            except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:
                if self.attention_backend == AttnBackend.flash:
                    raise
                varlen_failed(err)
        outs = []
        # One SDPA call per packed sample: cost is sum(L_i^2), not T^2.
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            outs.append(self._attend(q, k, v, causal)[0].transpose(0, 1))
        out = torch.cat(outs, dim=0)
        return out.reshape(out.shape[0], -1)

    def _forward_cp(self, query, key, value, params, causal: bool):
        """Local queries against all-gathered keys/values; see the module docstring."""
        from megatron.core.ssm.gated_delta_net.common import _build_thd_cp_a2a_perm
        from megatron.core.ssm.mamba_context_parallel import _undo_attention_load_balancing
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        cp, rank = self.cp_size, self.cp_group.rank()
        local = query.shape[0]
        # [cp * local, ...] in rank-major order; backward reduce-scatters the key/value grads.
        k_all, v_all = (
            gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=True, group=self.cp_group)
            for t in (key, value)
        )
        total = cp * local
        if params is not None and params.qkv_format == "thd":
            cu = host_side(torch.tensor(self._segments(params)[1], dtype=torch.long))  # made from host values
            if int(cu[-1]) != total:
                raise ValueError(f"THD under CP: cu_seqlens ends at {int(cu[-1])} but cp x local tokens is {total}")
            to_global, to_gathered = _build_thd_cp_a2a_perm(cu, cp, total)
            k_glob, v_glob = (t.index_select(0, to_global.to(t.device)) for t in (k_all, v_all))
            if self._cp_takes_varlen(query):
                return self._cp_varlen(query, k_glob, v_glob, params, causal)
            q_pos = to_gathered[rank * local : (rank + 1) * local]  # global position of every local query
            outs = []
            for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
                lo, hi = start // cp, end // cp  # this sample's local query rows
                if hi == lo:
                    continue
                q = query[lo:hi].transpose(0, 1).unsqueeze(0)
                k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (k_glob, v_glob))
                mask = self._cp_mask(q_pos[lo:hi] - start, end - start, causal, query.device)
                outs.append(self._attend(q, k, v, False, mask)[0].transpose(0, 1))
            out = torch.cat(outs, dim=0)
            return out.reshape(out.shape[0], -1)
        # BSHD [s, b, h, d]: one sample per row, every row split the same way
        k_glob, v_glob = (_undo_attention_load_balancing(t, cp) for t in (k_all, v_all))
        chunk = local // 2
        q_pos = torch.cat(
            [
                torch.arange(rank * chunk, (rank + 1) * chunk),
                torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk),
            ]
        )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, k_glob, v_glob))
        out = self._attend(q, k, v, False, self._cp_mask(q_pos, total, causal, query.device))
        return out.permute(2, 0, 1, 3).reshape(local, query.shape[1], -1)

    def _cp_takes_varlen(self, query) -> bool:
        """Whether the CP THD attention runs as one varlen call (``cp_varlen.py``): where a THD call
        would, and this torch's kernel aligns causality as that call needs."""
        dropout = self.dropout_p if self.training else 0.0
        kernel, _ = thd_kernel(self.attention_backend, query.is_cuda, query.dtype, query.shape[-1], dropout)
        if kernel != VARLEN:
            return False
        if not bottom_right_causal(str(query.device), query.dtype):
            if self.attention_backend == AttnBackend.flash:
                raise ValueError(
                    "--attention-backend flash under context parallelism: this torch's varlen kernel does not "
                    "align a causal segment with more keys than queries to its last key"
                )
            return False
        return True

    def _cp_varlen(self, query, k_glob, v_glob, params, causal: bool):
        """Every local query chunk against its key prefix, in one varlen call (``cp_varlen.py``)."""
        cu, bounds = self._segments(params)
        cp, rank, device = self.cp_size, self.cp_group.rank(), query.device
        seg = kept_on(
            cu, "_cp_segments", (cp, rank, causal, device), lambda: cp_segments(bounds, cp, rank, causal).on(device)
        )
        k, v = (t.index_select(0, seg.key_rows) for t in (k_glob, v_glob))
        out = torch_varlen()(
            query.contiguous(), k, v, seg.cu_q, seg.max_q, causal, self.softmax_scale, cu_k=seg.cu_k, max_k=seg.max_k
        )
        return out.reshape(out.shape[0], -1)

    @staticmethod
    def _cp_mask(q_pos: torch.Tensor, n_keys: int, causal: bool, device):
        """[q, k] True where query (at global position q_pos within its sample) may attend key k."""
        if not causal:
            return None
        return torch.arange(n_keys, device=device).unsqueeze(0) <= q_pos.to(device).unsqueeze(1)
