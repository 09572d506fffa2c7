"""Micro-check: ``torch.nn.functional.grouped_mm`` (one kernel for every expert's GEMM) against a
loop of one matmul per expert, on an expert MLP's forward (gate+up GEMM, SwiGLU, down GEMM) with
tokens routed top-k at random, so experts get uneven (some empty) row counts as in training.

GPU (marker gpu, seconds): the 35b_a3b cut's shapes (hidden 2048, expert ffn 512, 256 experts,
top-8; configuration.py), 16384 tokens (4 rows of 4096), bf16. Both are
measured against the loop in fp32; target: grouped RMS error <= 1e-2, as bf16 rounding gives.
CPU (a unit test of the same code, fp32, small shapes): grouped_mm equals the loop to 1e-5.
"""

import pytest
import torch
from gpu_measure import errors, median_ms

CHECK = "grouped_mm"
CUT = dict(hidden=2048, ffn=512, experts=256, top_k=8, tokens=4 * 4096)
BF16_RMS, FP32_REL = 1e-2, 1e-5


def _grouped_mm():
    """torch's grouped GEMM under its public name, else the private one older torch builds have."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return (fn, "torch.nn.functional.grouped_mm") if fn else (torch._grouped_mm, "torch._grouped_mm")


def routed_inputs(hidden, ffn, experts, top_k, tokens, device, dtype, seed=0):
    """(x rows sorted by expert [tokens*top_k, hidden], gate+up weights [E, hidden, 2 ffn], down
    weights [E, ffn, hidden], int32 end offset of each expert's rows [E])."""
    gen = torch.Generator(device=device).manual_seed(seed)
    choice = torch.rand(tokens, experts, device=device, generator=gen).topk(top_k, dim=1).indices.flatten()
    counts = torch.bincount(choice, minlength=experts)
    x = torch.randn(tokens * top_k, hidden, device=device, generator=gen).to(dtype)
    w_in = (torch.randn(experts, hidden, 2 * ffn, device=device, generator=gen) * hidden**-0.5).to(dtype)
    w_out = (torch.randn(experts, ffn, hidden, device=device, generator=gen) * ffn**-0.5).to(dtype)
    return x, w_in, w_out, counts.cumsum(0).to(torch.int32)


def _swiglu(h):
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def expert_mlp_grouped(x, w_in, w_out, offs):
    grouped_mm = _grouped_mm()[0]
    return grouped_mm(_swiglu(grouped_mm(x, w_in, offs=offs)), w_out, offs=offs)


def expert_mlp_loop(x, w_in, w_out, offs):
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([_swiglu(x[a:b] @ w_in[e]) @ w_out[e] for e, (a, b) in enumerate(zip(starts, ends))])


def compare(device, dtype, **shape) -> dict:
    """Errors of grouped_mm and of the loop against the loop in fp32, and the time of each."""
    x, w_in, w_out, offs = routed_inputs(device=device, dtype=dtype, **shape)
    with torch.no_grad():
        ref = expert_mlp_loop(x.float(), w_in.float(), w_out.float(), offs)
        grouped = errors([expert_mlp_grouped(x, w_in, w_out, offs)], {"out": ref})
        loop = errors([expert_mlp_loop(x, w_in, w_out, offs)], {"out": ref})
        grouped_ms = median_ms(lambda: expert_mlp_grouped(x, w_in, w_out, offs), 5, 1, device)
        loop_ms = median_ms(lambda: expert_mlp_loop(x, w_in, w_out, offs), 5, 1, device)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    return {
        "grouped max rel": grouped["rel"],
        "grouped rms": grouped["rms"],
        "loop max rel": loop["rel"],
        "loop rms": loop["rms"],
        "grouped ms": grouped_ms,
        "loop ms": loop_ms,
        "speed-up": loop_ms / grouped_ms,
        "rows": int(offs[-1]),
        "empty experts": int((counts == 0).sum()),
        "max rows/expert": int(counts.max()),
    }


def test_grouped_mm_equals_the_loop_on_cpu():
    """fp32 on CPU at small shapes: the same routing and comparison as the GPU check."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # GEMMs this small only wait on a busy host's other threads
    try:
        m = compare("cpu", torch.float32, hidden=64, ffn=32, experts=16, top_k=4, tokens=96)
    finally:
        torch.set_num_threads(threads)
    assert m["rows"] == 96 * 4 and m["empty experts"] >= 0
    assert m["grouped max rel"] <= FP32_REL and m["loop max rel"] <= FP32_REL, m
    # a fault in the offsets (one row moved between experts) is caught
    x, w_in, w_out, offs = routed_inputs(64, 32, 16, 4, 96, "cpu", torch.float32)
    shifted = offs.clone()
    shifted[0] += 1
    wrong = errors([expert_mlp_grouped(x, w_in, w_out, shifted)], {"out": expert_mlp_loop(x, w_in, w_out, offs)})
    assert wrong["rel"] > 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU checks run on a GPU host")
def test_grouped_mm_at_the_35b_cut_shapes(record):
    m = compare("cuda", torch.bfloat16, **CUT)
    ok = m["grouped rms"] <= BF16_RMS
    note = (
        f"{_grouped_mm()[1]}, bf16, forward of the expert MLP (gate+up, SwiGLU, down); hidden {CUT['hidden']}, "
        f"expert ffn {CUT['ffn']}, {CUT['experts']} experts top-{CUT['top_k']}, {CUT['tokens']} tokens; "
        f"errors against the loop in fp32, target grouped RMS <= {BF16_RMS:g}; "
        "times: median of 5 after one warm-up (CUDA events)"
    )
    record("35b_a3b cut experts", "pass" if ok else "fail", m, note)
    assert ok, f"{m} ({note})"
