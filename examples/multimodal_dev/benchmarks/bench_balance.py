"""Sample-count against token-budget packing, through the engine, at DP=2 on the realistic mix.

    python -m examples.multimodal_dev.benchmarks.bench_balance [--iters 8] [--budget 2048] [--rows 8]

Runs ``run_qwen35_vl.sh`` (tiny, ``DATASET=mock_mix``, NPROC data-parallel ranks) twice:

- samples: ``--micro-batch`` conversations a micro-batch, ``--conversations`` a step (the default
  20 hold about the tokens of 8 rows of 2048 on this mix);
- tokens: one row of ``--budget`` tokens a micro-batch, ``--rows`` rows a step.

Reported over the iterations after the first two (start-up): step time, real tokens per second,
model TFLOP/s per rank (models/qwen35_vl/flops.py), padding, and DP imbalance (max / mean model FLOPs over the
ranks, per step: mean and worst), each from the run's metrics file and log; then the ratio of
tokens per second. The host's cores are shared by the ranks, so on a 2-core machine the
imbalance costs less time than it would on a GPU per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def run(name: str, env: dict, iters: int) -> dict:
    """One training run: per-iteration metrics records and elapsed seconds."""
    with tempfile.TemporaryDirectory(prefix="bench_balance_") as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        full_env = {
            **os.environ,
            "MODEL_VARIANT": "tiny",
            "DATASET": "mock_mix",
            "TRAIN_ITERS": str(iters),
            **{k: str(v) for k, v in env.items()},
        }
        print(f"  {name}: training {iters} iterations ...", file=sys.stderr, flush=True)
        proc = subprocess.run(
            ["bash", os.path.join(ROOT, "run_qwen35_vl.sh"), "--eval-iters", "0", "--metrics-file", metrics],
            env=full_env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(f"bench_balance.py: the {name} run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        with open(metrics) as f:
            records = {r["iteration"]: r for r in map(json.loads, f)}
    seconds = {int(i): float(ms) / 1000 for i, ms in ITERATION.findall(proc.stdout + proc.stderr)}
    return {"records": records, "seconds": seconds}


def summary(result: dict, ranks: int) -> dict:
    its = [i for i in sorted(result["records"]) if i > 2 and i in result["seconds"]]
    if not its:
        raise SystemExit("bench_balance.py: no iteration after the first two was logged; raise --iters")
    recs, secs = [result["records"][i] for i in its], [result["seconds"][i] for i in its]
    total_s = sum(secs)
    return {
        "iterations": f"{its[0]}..{its[-1]}",
        "step_s": statistics.median(secs),
        "tokens_per_step": statistics.mean(r["real_tokens"] for r in recs),
        "tokens_per_s": sum(r["real_tokens"] for r in recs) / total_s,
        "tflops_per_rank": sum(r["model_flops"] for r in recs) / total_s / ranks / 1e12,
        "padding": 1 - sum(r["real_tokens"] for r in recs) / sum(r["padded_tokens"] for r in recs),
        "imbalance_mean": statistics.mean(r["dp_imbalance"] for r in recs),
        "imbalance_worst": max(r["dp_imbalance"] for r in recs),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2, help="data-parallel ranks")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=8, help="token budget: rows a step")
    parser.add_argument("--micro-batch", type=int, default=2, help="sample count: conversations a micro-batch")
    parser.add_argument("--conversations", type=int, default=20, help="sample count: conversations a step")
    args = parser.parse_args(argv)
    for flag, value in vars(args).items():
        if value < 1:
            parser.error(f"--{flag.replace('_', '-')} {value} must be a positive integer")
    if args.iters < 3:
        parser.error(f"--iters {args.iters}: the first two are start-up; need at least 3")
    common = dict(NPROC=args.nproc, SEQ_LEN=args.seq_length)
    results = {
        "samples": summary(
            run(
                "sample count",
                dict(common, PACKING="samples", MBS=args.micro_batch, GBS=args.conversations),
                args.iters,
            ),
            args.nproc,
        ),
        "tokens": summary(
            run(
                "token budget", dict(common, PACKING="tokens", PACKED_SEQ_LENGTH=args.budget, GBS=args.rows), args.iters
            ),
            args.nproc,
        ),
    }
    print(
        f"tiny, mock_mix, DP={args.nproc} on {os.cpu_count()} CPU cores, fp32; iterations "
        f"{results['tokens']['iterations']} (the first two are start-up)"
    )
    print(
        "| packing | real tokens a step | step (s) | tokens/s | model TFLOP/s per rank | padding | "
        "DP imbalance mean | worst step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    labels = {
        "samples": f"sample count ({args.micro_batch} a micro-batch, {args.conversations} a step)",
        "tokens": f"token budget ({args.rows} rows of {args.budget})",
    }
    for key, r in results.items():
        print(
            f"| {labels[key]} | {r['tokens_per_step']:.0f} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['tflops_per_rank']:.4f} | {100 * r['padding']:.1f}% | {r['imbalance_mean']:.3f} | "
            f"{r['imbalance_worst']:.3f} |"
        )
    ratio = results["tokens"]["tokens_per_s"] / results["samples"]["tokens_per_s"]
    print(f"token budget / sample count, real tokens per second: {ratio:.2f}x")
    return results


if __name__ == "__main__":
    main()
