"""megatron-core's GatedDeltaNet with its decay parameters kept in fp32 under bf16 / fp16.

Qwen3.5's released checkpoints store ``A_log`` and ``dt_bias`` in fp32 whatever the rest is in:
the decay ``g = -exp(A_log) * softplus(a + dt_bias)`` is summed over up to 64 tokens a chunk
inside the kernel, and in bf16 (8 significant bits) ``exp(A_log)`` alone is off by up to 0.4%.
megatron-core creates both in ``params_dtype``, and ``Float16Module`` casts the whole model to
bf16, so a GPU run would round them and train them in bf16. Here they are fp32 from construction,
and stay fp32 through any later cast to half precision (``Float16Module``'s ``.bfloat16()``).
megatron's DDP keeps a separate fp32 gradient buffer for them and its optimizers treat them as
fp32 parameters (no separate main copy), as they do any fp32 parameter of a half-precision model.

Given an inference context (generation), the layer decodes with cached state (``gdn_decoding.py``),
which megatron-core's own forward refuses.

A packed row's segments are checked once per micro-batch, not in every layer, and on the batch's host
copy: megatron-core reads ``cu_seqlens`` back to the host for its checks in each GatedDeltaNet layer
(three syncs a layer, query and key alike, on a GPU run).
"""

from __future__ import annotations

import types

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet

from .batch_memo import kept_on, on_host
from .gdn_decoding import cached_forward

FP32_DECAY_PARAMS = ("A_log", "dt_bias")
_HALF = (torch.bfloat16, torch.float16)


class GatedDeltaNetFp32Decay(GatedDeltaNet):
    def forward(self, hidden_states, attention_mask, inference_context=None, **kwargs):
        if inference_context is None:
            return super().forward(hidden_states, attention_mask, **kwargs)
        return cached_forward(self, hidden_states, inference_context)

    def _resolve_cu_seqlens(self, cu_seqlens_padded, cu_seqlens_actual, total_seq_len, name, cp_size: int = 1):
        cu_seqlens = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens_actual

        def check() -> bool:  # megatron-core's checks (which raise), on the batch's host copies
            padded, actual = (None if t is None else on_host(t) for t in (cu_seqlens_padded, cu_seqlens_actual))
            super(GatedDeltaNetFp32Decay, self)._resolve_cu_seqlens(padded, actual, total_seq_len, name, cp_size)
            return True

        kept_on(cu_seqlens, "_gdn_checked", (total_seq_len, cp_size), check)
        return cu_seqlens

    def reset_parameters(self):
        # megatron-core draws ``A`` in params_dtype (and writes dt_bias with ``out=``, which must
        # match it); the values are kept as drawn, the same random stream, and only widened after.
        super().reset_parameters()
        self._widen_decay()

    def _apply(self, fn, recurse=True):
        # every dtype / device conversion of the model passes here (``Float16Module`` calls
        # ``module.bfloat16()`` on the whole model, which applies to each child)
        super()._apply(fn, recurse)
        self._widen_decay()
        return self

    def _widen_decay(self) -> None:
        for name in FP32_DECAY_PARAMS:
            param = getattr(self, name, None)
            if param is not None and param.dtype in _HALF:
                param.data = param.data.float()  # the same Parameter: its TP attributes stay


class _TorchComparingByIdentity(types.ModuleType):
    """``torch`` for megatron-core's gdn module: every name is torch's but ``equal``."""

    def __init__(self, torch_module):
        super().__init__(torch_module.__name__)
        self.__dict__["_torch"] = torch_module

    def __getattr__(self, name):  # names not set on this module: torch's
        return getattr(self._torch, name)

    @staticmethod
    def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a is b or torch.equal(a, b)


def torch_comparing_by_identity(original, run=None):
    """The megatron change ``gdn-segments-compared-once``: the batch hands GatedDeltaNet one
    ``cu_seqlens`` tensor for query and key (``forward_step.packed_seq_params``)."""
    return _TorchComparingByIdentity(original)
