"""Core attention on torch SDPA for hosts without Transformer Engine / flash-attention.

A drop-in for megatron-core's ``core_attention`` submodule (same constructor and forward as
``DotProductAttention``) that also handles packed THD batches:

    BSHD  q [s, b, np, hn], k/v [s, b, ng, hn]   -> [s, b, np*hn]
    THD   q [t, np, hn],    k/v [t, ng, hn]      -> [t, np*hn]   (segments from cu_seqlens)

Segments come from ``cu_seqlens_q_padded`` when present (the packed tensor is laid out on the
padded boundaries; the tail padding of a sample sits after its real tokens, so causal attention
of real tokens never sees it). Context parallelism is part of the interface (``pg_collection``)
but is refused until the CP implementation lands, rather than silently attending locally.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

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
        cp_size = self.cp_group.size() if self.cp_group is not None else config.context_parallel_size
        if cp_size > 1:
            raise NotImplementedError(
                f"SDPACoreAttention: context parallelism (context_parallel_size={cp_size}) is not "
                "implemented for the CPU attention yet"
            )

    def _attend(self, q, k, v, causal: bool, mask=None):
        """q [b, np, s, hn], k/v [b, ng, s, hn]; grouped-query heads are shared in blocks."""
        if k.shape[1] != q.shape[1]:
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        dropout = self.dropout_p if self.training else 0.0
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal and mask is None,
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

    def _forward_thd(self, query, key, value, params, causal: bool):
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        if cu_kv is not None and not torch.equal(cu.cpu(), cu_kv.cpu()):
            raise NotImplementedError("SDPACoreAttention THD needs identical q and kv segments")
        bounds = cu.tolist()
        if bounds[-1] != query.shape[0]:
            raise ValueError(f"THD: cu_seqlens ends at {bounds[-1]} but the packed row has {query.shape[0]} tokens")
        outs = []
        # One SDPA call per packed sample: cost is sum(L_i^2), not T^2.
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            outs.append(self._attend(q, k, v, causal)[0].transpose(0, 1))
        out = torch.cat(outs, dim=0)
        return out.reshape(out.shape[0], -1)
