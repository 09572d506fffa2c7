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
        scale = self.weight.float() + 1.0 if self.zero_centered else self.weight.float()
        xf = x.float()
        if self.rms:
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * scale
        else:
            y = F.layer_norm(xf, xf.shape[-1:], scale, self.bias.float(), self.eps)
        return y.to(x.dtype)
