"""The torch chunked gated-delta-rule kernel of ``megatron.cpu`` against ``transformers``' torch
implementation, on the same inputs (fp32, CPU): time (median of repetitions) and max difference.

    python -m examples.multimodal_dev.benchmarks.bench_gdn [--heads 16 --dk 128 --dv 128 --reps 9]

Forward alone, and forward + backward (max difference over the output and the gradients of all
five inputs). Two inputs, both Qwen3.5 head sizes: "unpacked", a batch of equal-length rows; "packed", one
THD row of several samples of different lengths with ``cu_seqlens`` (transformers' kernel has
no ``cu_seqlens``, so it runs each sample separately, which is what it would have to do).
Both run in one process after ``megatron.cpu.activate()``, the host set-up training runs under
(which includes keeping freed memory in the allocator, see ``device_compat``).
"""

from __future__ import annotations

import argparse

import torch


def _inputs(batch: int, length: int, heads: int, dk: int, dv: int, seed: int = 0):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, length, heads, dk, generator=g), dim=-1)
    k = F.normalize(torch.randn(batch, length, heads, dk, generator=g), dim=-1)
    v = torch.randn(batch, length, heads, dv, generator=g)
    decay = -torch.rand(batch, length, heads, generator=g)
    beta = torch.rand(batch, length, heads, generator=g)
    return q, k, v, decay, beta


def _with_backward(fn, inputs):
    """fn's output after a backward pass of sum(o^2), and the input gradients it produced."""

    def step():
        for t in inputs:
            t.grad = None
        out = fn()
        out.square().sum().backward()
        return torch.cat([out.detach().flatten()] + [t.grad.flatten() for t in inputs])

    return step


def _row(name: str, what: str, times: dict, out: dict) -> dict:
    """One result row: both kernels' median seconds and the max abs difference of what they returned."""
    return {
        "input": name,
        "pass": what,
        "ours_s": times["ours"],
        "ref_s": times["ref"],
        "max_diff": (out["ours"] - out["ref"]).abs().max().item(),
    }


def run(heads: int = 16, dk: int = 128, dv: int = 128, reps: int = 9) -> list[dict]:
    """Rows of (input, pass, seconds of each, max abs difference of outputs and, for the backward
    rows, of the gradients of q, k, v, g and beta)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    import megatron.cpu
    from examples.multimodal_dev.benchmarks.timing import alternating_medians
    from megatron.cpu.gdn_kernels import chunk_gated_delta_rule

    megatron.cpu.activate()  # the host set-up training runs under (allocator included), for both

    lengths = [700, 64, 333, 1200, 45, 250]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    cases = [
        ("unpacked 2 x 1024", _inputs(2, 1024, heads, dk, dv), None),
        (
            f"packed THD {len(lengths)} samples, {sum(lengths)} tokens",
            _inputs(1, sum(lengths), heads, dk, dv, seed=1),
            cu,
        ),
    ]
    rows = []
    for name, inputs, cu_seqlens in cases:

        def ours(x=inputs, cu=cu_seqlens):
            return chunk_gated_delta_rule(*x, cu_seqlens=cu)[0]

        def ref(x=inputs, cu=cu_seqlens):  # no cu_seqlens in transformers: packed runs sample by sample
            if cu is None:
                return torch_chunk_gated_delta_rule(*x)[0]
            bounds = cu.tolist()
            return torch.cat(
                [torch_chunk_gated_delta_rule(*(t[:, a:b] for t in x))[0] for a, b in zip(bounds[:-1], bounds[1:])],
                dim=1,
            )

        with torch.no_grad():
            times, out = alternating_medians({"ours": ours, "ref": ref}, reps)
        rows.append(_row(name, "forward", times, out))
        for t in inputs:
            t.requires_grad_(True)
        times, out = alternating_medians(
            {"ours": _with_backward(ours, inputs), "ref": _with_backward(ref, inputs)}, reps
        )
        for t in inputs:
            t.requires_grad_(False)
        rows.append(_row(name, "forward + backward", times, out))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    rows = run(args.heads, args.dk, args.dv, args.reps)
    print(
        f"gated delta rule, fp32 CPU, {torch.get_num_threads()} threads, {args.heads} heads, dk {args.dk}, "
        f"dv {args.dv}, median of {args.reps}"
    )
    print("| input | pass | megatron.cpu (s) | transformers (s) | speed ratio (ours faster when > 1) | max abs diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['input']} | {r['pass']} | {r['ours_s']:.3f} | {r['ref_s']:.3f} | {r['ref_s'] / r['ours_s']:.2f}x "
            f"| {r['max_diff']:.2e} |"
        )


if __name__ == "__main__":
    main()
