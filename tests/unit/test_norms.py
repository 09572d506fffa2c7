"""The local backend's RMSNorm against transformers' Qwen3_5RMSNorm on the same weights: the same
tensor bit for bit on a CPU host, forward and backward, in fp32 and in bf16 (computed in fp32)."""

import types

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

from examples.multimodal_dev.models.common.norms import TorchNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rms_norm_is_transformers_bit_for_bit(dtype):
    config = types.SimpleNamespace(
        normalization="RMSNorm", layernorm_zero_centered_gamma=True, params_dtype=dtype, sequence_parallel=False
    )
    ours, theirs = TorchNorm(config, 48, eps=1e-6), Qwen3_5RMSNorm(48, eps=1e-6).to(dtype)
    weight = torch.randn(48, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    x = torch.randn(5, 7, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    grad = torch.randn(5, 7, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    results = []
    for norm in (ours, theirs):
        given = x.clone().requires_grad_()
        out = norm(given)
        out.backward(grad)
        results.append((out, given.grad, norm.weight.grad))
    for name, a, b in zip(("output", "input gradient", "weight gradient"), *results):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b), (name, (a.float() - b.float()).abs().max())
