"""The torch GatedDeltaNet kernels against the token-by-token recurrence and transformers'.

Tolerance 1e-5 abs (fp32): the chunked form reorders sums (WY transform, triangular solves);
measured ~2e-7 on these sizes.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.cpu.gdn_kernels import (
    causal_conv1d,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule_reference,
)

TOL = 1e-5


def _inputs(batch, length, heads=3, dk=16, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(batch, length, heads, dk, generator=g))
    k = l2norm(torch.randn(batch, length, heads, dk, generator=g))
    v = torch.randn(batch, length, heads, dv, generator=g)
    decay = -torch.rand(batch, length, heads, generator=g)
    beta = torch.rand(batch, length, heads, generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("length,chunk", [(100, 16), (64, 64), (7, 64)])
def test_chunked_equals_recurrence(length, chunk):
    q, k, v, g, beta = _inputs(2, length)
    out, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)
    diff = (out - recurrent_gated_delta_rule_reference(q, k, v, g, beta)).abs().max().item()
    print(f"chunked vs recurrence (T={length}, C={chunk}): max abs diff {diff:.2e}")
    assert diff < TOL


def test_matches_transformers_reference():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta = _inputs(2, 90)
    ours, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    ref, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta)
    diff = (ours - ref).abs().max().item()
    print(f"ours vs transformers chunked: max abs diff {diff:.2e}")
    assert diff < TOL


def test_packed_sequences_reset_state():
    bounds = [0, 37, 100, 150]
    q, k, v, g, beta = _inputs(1, 150, seed=1)
    cu = torch.tensor(bounds, dtype=torch.int32)
    packed, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    pieces = [
        recurrent_gated_delta_rule_reference(*(t[:, a:b] for t in (q, k, v, g, beta)))
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    diff = (packed - torch.cat(pieces, dim=1)).abs().max().item()
    print(f"packed vs per-sequence: max abs diff {diff:.2e}")
    assert diff < TOL
    # The same tokens without the boundaries give a different answer: the reset matters.
    unpacked, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    assert (unpacked - packed)[:, 37:].abs().max() > 1e-3


def test_l2norm_and_qk_norm_in_kernel():
    q, k, v, g, beta = _inputs(1, 20)
    raw_q, raw_k = 3 * q, 2 * k
    a, _ = chunk_gated_delta_rule(raw_q, raw_k, v, g, beta, use_qk_l2norm_in_kernel=True)
    b, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    assert (a - b).abs().max() < TOL
    assert torch.allclose(l2norm(raw_q).norm(dim=-1), torch.ones(1, 20, 3), atol=1e-5)


def test_causal_conv1d_resets_at_boundaries():
    bounds = [0, 5, 33, 40]
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(1, 40, 6, generator=g), torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    out, _ = causal_conv1d(x, w, bias, activation="silu", cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
    ref = [
        F.silu(F.conv1d(x[:, a:b].transpose(1, 2), w[:, None], bias, padding=3, groups=6)[..., : b - a]).transpose(1, 2)
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    diff = (out - torch.cat(ref, dim=1)).abs().max().item()
    print(f"packed conv1d vs per-sequence: max abs diff {diff:.2e}")
    assert diff < TOL


def test_causal_conv1d_is_its_definition():
    """out[b, t, d] = bias[d] + sum_i x[b, t - (W - 1) + i, d] * w[d, i], with x = 0 before the row."""
    g = torch.Generator().manual_seed(1)
    x, w, bias = torch.randn(2, 9, 5, generator=g), torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    out, _ = causal_conv1d(x, w, bias)
    ref = torch.zeros_like(x) + bias
    for t in range(9):
        for i in range(4):
            if t - 3 + i >= 0:
                ref[:, t] += x[:, t - 3 + i] * w[:, i]
    diff = (out - ref).abs().max().item()
    print(f"causal conv1d vs its definition: max abs diff {diff:.2e}")
    assert diff < TOL


def test_conv_state_carry_is_refused():
    x, w = torch.randn(1, 8, 2), torch.randn(2, 4)
    with pytest.raises(NotImplementedError, match="initial_state"):
        causal_conv1d(x, w, output_final_state=True)


def test_packed_initial_and_final_states_and_gradients_match_per_sequence():
    """Sequences of 1, 3 and 2 chunks with their own initial states:
    outputs, final states and input gradients equal running each sequence alone."""
    bounds = [0, 40, 190, 300]
    q, k, v, g, beta = (t.requires_grad_() for t in _inputs(1, 300, seed=2))
    init = torch.randn(3, 3, 16, 8, generator=torch.Generator().manual_seed(3))
    cu = torch.tensor(bounds, dtype=torch.int32)
    packed, finals = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=init, output_final_state=True, cu_seqlens=cu
    )
    grads = torch.autograd.grad(packed.square().sum(), (q, v, g))
    outs, states = [], []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        o, s = chunk_gated_delta_rule(
            *(t[:, a:b] for t in (q, k, v, g, beta)), initial_state=init[i : i + 1], output_final_state=True
        )
        outs.append(o)
        states.append(s)
    alone = torch.cat(outs, dim=1)
    ref_grads = torch.autograd.grad(alone.square().sum(), (q, v, g))
    diffs = [(packed - alone).abs().max().item(), (finals - torch.cat(states)).abs().max().item()]
    diffs += [(a - b).abs().max().item() for a, b in zip(grads, ref_grads)]
    print(f"packed vs alone: output, final state, grads q/v/g max abs diff {diffs}")
    assert max(diffs) < TOL


def test_unpacked_rows_carry_state_across_a_split():
    """Rows of a batch: running the first 70 tokens, then the rest from the returned final states,
    equals running all 150 at once (outputs and final states)."""
    q, k, v, g, beta = _inputs(2, 150, seed=4)
    whole, final = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    first, mid = chunk_gated_delta_rule(*(t[:, :70] for t in (q, k, v, g, beta)), output_final_state=True)
    rest, final_split = chunk_gated_delta_rule(
        *(t[:, 70:] for t in (q, k, v, g, beta)), initial_state=mid, output_final_state=True
    )
    diffs = [(torch.cat([first, rest], 1) - whole).abs().max().item(), (final_split - final).abs().max().item()]
    print(f"split vs whole: output, final state max abs diff {diffs}")
    assert max(diffs) < TOL


def test_a_micro_batchs_segments_are_laid_out_once_from_its_host_copy():
    """Every GDN layer of a micro-batch shares one chunk layout, made from the batch's host copy of
    the bounds: the second layer reads nothing back, and the result is the plain layout's."""
    from examples.multimodal_dev.benchmarks.op_counter import StepTally
    from examples.multimodal_dev.models.common.batch_memo import to_device

    q, k, v, g, beta = _inputs(1, 150, seed=1)
    plain, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 37, 100, 150], dtype=torch.int32))
    cu = to_device(torch.tensor([0, 37, 100, 150], dtype=torch.int32), "cpu")
    tally = StepTally()
    with tally.counting():
        first, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
        ops_first = sum(tally.ops.values())
        second, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    assert not tally.syncs, tally.summary()["syncs"]
    assert sum(tally.ops.values()) - ops_first < ops_first  # the second layer builds no layout
    assert torch.equal(first, plain) and torch.equal(second, plain)


@pytest.mark.parametrize("chunk", [8, 4], ids=["solved for u and w", "solved for the inverse"])
def test_scan_gradients_are_the_derivatives_of_its_outputs(chunk):
    """The hand-written backward of the chunk scan, in float64 against finite differences: packed
    sequences of 3, 17, 1 and 19 tokens (sequences end at different steps), their own initial
    states, and both outputs, o and the final states, in the loss; chunks wider than K + V and
    narrower (the model's shapes: K = V = 128, chunks of 64)."""
    q, k, v, g, beta = (t.double() for t in _inputs(1, 40, heads=2, dk=4, dv=3, seed=5))
    init = torch.randn(4, 2, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    cu = torch.tensor([0, 3, 20, 21, 40])

    def run(*inputs):
        return chunk_gated_delta_rule(
            *inputs[:5], initial_state=inputs[5], output_final_state=True, cu_seqlens=cu, chunk_size=chunk
        )

    assert torch.autograd.gradcheck(run, tuple(t.requires_grad_() for t in (q, k, v, g, beta, init)))


def test_a_chunk_step_costs_the_host_six_ops():
    """Forward and backward of a step of the chunk scan dispatch three ops each (GPU launches where the
    torch kernel runs on one): doubling a sequence's chunks adds no more than that per step."""
    from examples.multimodal_dev.benchmarks.op_counter import StepTally

    def ops(length):
        q, k, v, g, beta = (t.requires_grad_() for t in _inputs(1, length, seed=7))
        tally = StepTally()
        with tally.counting():
            out, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16)
            out.sum().backward()
        return sum(tally.ops.values())

    per_step = (ops(64 * 16) - ops(32 * 16)) / 32
    print(f"ops per chunk step, forward and backward: {per_step}")
    assert per_step <= 6
