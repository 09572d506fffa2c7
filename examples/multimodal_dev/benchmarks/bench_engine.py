"""Per-iteration time of the default CPU run (``tiny``, mock data, packed) through megatron.training,
optionally against another checkout of the playground (a peer: e.g. the last commit that trained
with the hand-written CPU loop), both launched the same way in one invocation, alternately.

    python -m examples.multimodal_dev.benchmarks.bench_engine [--iterations 30] [--repeats 2] \
        [--peer-checkout /path/to/other/checkout]

Each run is ``bash run_qwen35_vl.sh`` with log interval 1; the figure is the median of the logged
"elapsed time per iteration" over iterations 4..N (the first ones build kernels and caches).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ITERATION_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")
WARMUP = 3


def per_iteration_ms(checkout: str, iterations: int, env: dict) -> float:
    proc = subprocess.run(
        ["bash", os.path.join(checkout, "run_qwen35_vl.sh")],
        cwd=checkout,
        text=True,
        capture_output=True,
        env={**os.environ, **env, "TRAIN_ITERS": str(iterations)},
    )
    if proc.returncode != 0:
        raise SystemExit(f"bench_engine: the run in {checkout} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    times = {int(i): float(ms) for i, ms in ITERATION_MS.findall(proc.stdout + proc.stderr)}
    steady = [ms for i, ms in sorted(times.items()) if i > WARMUP]
    if not steady:
        raise SystemExit(f"bench_engine: no iteration times after iteration {WARMUP} in the log of {checkout}")
    return statistics.median(steady)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each contender, alternating")
    parser.add_argument("--peer-checkout", default=None, help="another checkout to time the same way")
    args = parser.parse_args(argv)
    if args.iterations <= WARMUP:
        parser.error(f"--iterations {args.iterations}: must exceed the {WARMUP} warm-up iterations")
    # one interpreter for both, so only the training code differs
    env = {"PYTHON": os.environ.get("PYTHON", sys.executable), "MODEL_VARIANT": "tiny"}
    contenders = {"this checkout (megatron.training)": ROOT}
    if args.peer_checkout:
        contenders[f"peer {args.peer_checkout}"] = os.path.abspath(args.peer_checkout)
    results = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, checkout in contenders.items():
            results[name].append(per_iteration_ms(checkout, args.iterations, env))
            print(f"{name}: {results[name][-1]:.1f} ms per iteration", file=sys.stderr, flush=True)
    print("| contender | ms per iteration (median of runs) |\n|---|---|")
    medians = {name: statistics.median(v) for name, v in results.items()}
    for name, ms in medians.items():
        print(f"| {name} | {ms:.1f} |")
    if args.peer_checkout:
        ours, peer = medians.values()
        print(f"\nthis checkout / peer time per iteration: {ours / peer:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
