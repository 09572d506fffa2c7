"""Torch norms for the local (non-Transformer-Engine) backend.

megatron-core's ``WrappedTorchNorm`` refuses ``layernorm_zero_centered_gamma`` and sequence
parallelism, and both are needed here: Qwen3.5 RMSNorms are zero-centred (scale = 1 + w, weights
initialised to 0), and under SP each TP rank normalises its own sequence shard, so the weight
gradient must be all-reduced across TP (``sequence_parallel`` attribute read by megatron DDP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def normalise(x, weight, bias, eps: float, *, rms: bool, zero_centered: bool) -> torch.Tensor:
    """RMSNorm (``bias`` None) or LayerNorm of ``x`` over its last dimension, in fp32, returned in
    ``x``'s dtype; scale ``1 + weight`` when ``zero_centered``. The one formula of the project's
    norms, and of the input a LoRA adapter sees behind Transformer Engine's fused norm."""
    scale = weight.float() + 1.0 if zero_centered else weight.float()
    xf = x.float()
    if rms:  # xf * rsqrt(mean(xf^2) + eps) * scale, bit for bit on a CPU; one fused kernel each way on a GPU
        y = F.rms_norm(xf, xf.shape[-1:], scale, eps)
    else:
        y = F.layer_norm(xf, xf.shape[-1:], scale, bias.float(), eps)
    return y.to(x.dtype)


class TorchNorm(nn.Module):
    """RMSNorm or LayerNorm chosen by ``config.normalization``; computed in fp32."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        self.eps = eps
        dtype = config.params_dtype
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=dtype))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._normalise(x, self.weight)

    def _normalise(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return normalise(x, weight, self.bias, self.eps, rms=self.rms, zero_centered=self.zero_centered)


class HeadSharedNorm(TorchNorm):
    """A norm over the head dimension whose weight every head shares (Gated DeltaNet's
    ``out_norm``). Under TP each rank holds some of the heads, so its weight gradient is a
    partial sum; megatron-core only all-reduces norm gradients over TP for sequence-parallel
    norms and q/k layernorms, so this one sums its own in backward (identity forward). It works
    on the full sequence, never a sequence shard, so it is not marked sequence-parallel."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__(config, hidden_size, eps)
        for p in self.parameters():
            p.sequence_parallel = False
        self.tp_size = config.tensor_model_parallel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        scale = copy_to_tensor_model_parallel_region(self.weight)
        return self._normalise(x, scale)
