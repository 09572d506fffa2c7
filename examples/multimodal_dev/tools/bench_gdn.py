"""The torch chunked gated-delta-rule kernel of ``megatron.cpu`` against ``transformers``' torch
implementation, on the same inputs (fp32, CPU): time (median of repetitions) and max difference.

    python examples/multimodal_dev/tools/bench_gdn.py [--heads 16 --dk 128 --dv 128 --reps 9]

Two inputs, both Qwen3.5 head sizes: "unpacked", a batch of equal-length rows; "packed", one
THD row of several samples of different lengths with ``cu_seqlens`` (transformers' kernel has
no ``cu_seqlens``, so it runs each sample separately, which is what it would have to do).
Both run in one process after ``megatron.cpu.activate()``, the host set-up training runs under
(which includes keeping freed memory in the allocator, see ``device_compat``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(_HERE), os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def _inputs(batch: int, length: int, heads: int, dk: int, dv: int, seed: int = 0):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, length, heads, dk, generator=g), dim=-1)
    k = F.normalize(torch.randn(batch, length, heads, dk, generator=g), dim=-1)
    v = torch.randn(batch, length, heads, dv, generator=g)
    decay = -torch.rand(batch, length, heads, generator=g)
    beta = torch.rand(batch, length, heads, generator=g)
    return q, k, v, decay, beta


def run(heads: int = 16, dk: int = 128, dv: int = 128, reps: int = 9) -> list[dict]:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    import megatron.cpu
    from megatron.cpu.gdn_kernels import chunk_gated_delta_rule
    from tools.timing import alternating_medians

    megatron.cpu.activate()  # the host set-up training runs under (allocator included), for both

    def paired(ours, ref):
        times, out = alternating_medians({"ours": ours, "ref": ref}, reps)
        return times["ours"], times["ref"], out["ours"], out["ref"]

    rows = []
    with torch.no_grad():
        q, k, v, g, beta = _inputs(2, 1024, heads, dk, dv)
        t_ours, t_ref, ours, ref = paired(lambda: chunk_gated_delta_rule(q, k, v, g, beta)[0],
                                          lambda: torch_chunk_gated_delta_rule(q, k, v, g, beta)[0])
        rows.append({"input": "unpacked 2 x 1024", "ours_s": t_ours, "ref_s": t_ref,
                     "max_diff": (ours - ref).abs().max().item()})

        lengths = [700, 64, 333, 1200, 45, 250]
        q, k, v, g, beta = _inputs(1, sum(lengths), heads, dk, dv, seed=1)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)

        def per_sample():
            return torch.cat([torch_chunk_gated_delta_rule(*(x[:, a:b] for x in (q, k, v, g, beta)))[0]
                              for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)

        t_ours, t_ref, ours, ref = paired(lambda: chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)[0], per_sample)
        rows.append({"input": f"packed THD {len(lengths)} samples, {sum(lengths)} tokens", "ours_s": t_ours,
                     "ref_s": t_ref, "max_diff": (ours - ref).abs().max().item()})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    rows = run(args.heads, args.dk, args.dv, args.reps)
    print(f"gated delta rule, fp32 CPU, {torch.get_num_threads()} threads, {args.heads} heads, dk {args.dk}, "
          f"dv {args.dv}, median of {args.reps}")
    print("| input | megatron.cpu (s) | transformers (s) | speed ratio (ours faster when > 1) | max abs diff |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['input']} | {r['ours_s']:.3f} | {r['ref_s']:.3f} | {r['ref_s'] / r['ours_s']:.2f}x "
              f"| {r['max_diff']:.2e} |")


if __name__ == "__main__":
    main()
