"""GatedDeltaNet's kernel calls as megatron-core 0.19.2 makes them (``ssm/gated_delta_net/gdn.py`` and
``common.py``: keyword names, int32 ``cu_seqlens`` of one packed row, q/k heads repeated up to the value
heads, the decay in fp32), forward and backward, with any kernel set: FLA's in the worker process, the
torch kernels (and their float64 run) in the test. Inputs and results are dicts of CPU tensors, passed
between the processes with ``torch.save``.

Legend: T tokens of the packed row, Hk key heads, Hv value heads, D conv channels (q | k | v), W conv width.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

LENGTHS = (1, 63, 65, 130)  # a lone token, both sides of the 64-token chunk, two chunks and a bit
KEY_HEADS, VALUE_HEADS, HEAD_DIM, CONV_WIDTH = 2, 4, 16, 4  # GQA: each key head serves 2 value heads


def cu_seqlens(lengths=LENGTHS) -> torch.Tensor:
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)


def kernel_inputs(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    total, channels = sum(LENGTHS), (2 * KEY_HEADS + VALUE_HEADS) * HEAD_DIM

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    return {
        "cu_seqlens": cu_seqlens(),
        "conv_x_1TD": randn(1, total, channels),
        "conv_weight_DW": 0.5 * randn(channels, CONV_WIDTH),
        "conv_grad_1TD": randn(1, total, channels),
        "qk_1THK": randn(1, total, 2 * KEY_HEADS, HEAD_DIM),
        "qk_grad_1THK": randn(1, total, 2 * KEY_HEADS, HEAD_DIM),
        # q and k per key head as l2norm leaves them (unit rows); v, the gate's inputs per value head
        "q_1THK": F.normalize(randn(1, total, KEY_HEADS, HEAD_DIM), dim=-1),
        "k_1THK": F.normalize(randn(1, total, KEY_HEADS, HEAD_DIM), dim=-1),
        "v_1THV": randn(1, total, VALUE_HEADS, HEAD_DIM),
        "alpha_1TH": randn(1, total, VALUE_HEADS),
        "beta_logit_1TH": randn(1, total, VALUE_HEADS),
        "A_log": torch.empty(VALUE_HEADS).uniform_(1, 16, generator=gen).log(),
        "dt_bias": torch.ones(VALUE_HEADS),
        "o_grad_1THV": randn(1, total, VALUE_HEADS, HEAD_DIM),
    }


def _timed_grad(fn, leaves: dict, grad_out) -> tuple[dict, float]:
    """{"out": fn(*leaves), "d<name>": gradient of <out, grad_out> for every leaf}, and the seconds."""
    start = time.perf_counter()
    out = fn(*leaves.values())
    grads = torch.autograd.grad(out, list(leaves.values()), grad_out)
    seconds = time.perf_counter() - start
    return {"out": out.detach(), **{f"d{name}": g for name, g in zip(leaves, grads)}}, seconds


def run_kernels(kernels, inputs: dict) -> dict:
    """``kernels`` has megatron-core's three names (``causal_conv1d``, ``l2norm``,
    ``chunk_gated_delta_rule``). Returns {kernel: {"out", "d<input>"...}, "seconds": {kernel: s}}."""
    cu = inputs["cu_seqlens"]

    def leaves(*names):
        return {name: inputs[name].detach().clone().requires_grad_() for name in names}

    def conv(x, weight):
        return kernels.causal_conv1d(
            x=x,
            weight=weight,
            bias=None,
            activation="silu",
            initial_state=None,
            output_final_state=False,
            cu_seqlens=cu,
        )[0]

    def norm(qk):  # megatron passes x alone (FLA's and the torch signatures differ after it)
        return kernels.l2norm(qk.contiguous())

    def chunk(q, k, v, alpha, beta_logit, A_log, dt_bias):
        repeat = VALUE_HEADS // KEY_HEADS
        q, k = (t.repeat_interleave(repeat, dim=2).contiguous() for t in (q, k))
        g = -A_log.exp() * F.softplus(alpha + dt_bias)  # megatron's decay; alpha is fp32 already
        return kernels.chunk_gated_delta_rule(
            q,
            k,
            v,
            g=g,
            beta=beta_logit.sigmoid(),
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=False,
            cu_seqlens=cu,
        )[0]

    results, seconds = {}, {}
    calls = {
        "causal_conv1d": (conv, leaves("conv_x_1TD", "conv_weight_DW"), inputs["conv_grad_1TD"]),
        "l2norm": (norm, leaves("qk_1THK"), inputs["qk_grad_1THK"]),
        "chunk_gated_delta_rule": (
            chunk,
            leaves("q_1THK", "k_1THK", "v_1THV", "alpha_1TH", "beta_logit_1TH", "A_log", "dt_bias"),
            inputs["o_grad_1THV"],
        ),
    }
    for kernel, (fn, args, grad_out) in calls.items():
        results[kernel], seconds[kernel] = _timed_grad(fn, args, grad_out)
    return {**results, "seconds": seconds}


def layer_inputs(layer, seed: int = 1) -> dict:
    """The layer's parameters, and a packed row of ``LENGTHS`` (x and the output's gradient, [T, 1, hidden])."""
    gen = torch.Generator().manual_seed(seed)
    shape = (sum(LENGTHS), 1, layer.config.hidden_size)
    return {
        "params": {n: p.detach().clone() for n, p in layer.named_parameters()},
        "x_T1C": torch.randn(*shape, generator=gen),
        "out_grad_T1C": torch.randn(*shape, generator=gen),
    }


def run_layer(layer, inputs: dict) -> dict:
    """Load ``inputs["params"]``, run forward and backward on the packed row: {"out", "dx", "d<param>"...,
    "seconds"} (the kernels' dtype is the layer's: the inputs are cast to it)."""
    from gdn_layer import packed_params

    dtype = next(layer.parameters()).dtype
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(inputs["params"][name])
    x = inputs["x_T1C"].detach().clone().to(dtype).requires_grad_()
    start = time.perf_counter()
    out, _ = layer(x, attention_mask=None, packed_seq_params=packed_params(LENGTHS))
    out.backward(inputs["out_grad_T1C"].to(dtype))
    seconds = time.perf_counter() - start
    grads = {f"d{name}": p.grad.detach().clone() for name, p in layer.named_parameters()}
    return {"out": out.detach(), "dx": x.grad, **grads, "seconds": seconds}
