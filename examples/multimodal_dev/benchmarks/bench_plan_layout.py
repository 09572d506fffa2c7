"""How long planning a layout takes: every layout of a variant for a GPU count, against the budget
of 10 s, and against building one layout's representative ranks on the meta device (what the
planner's parameter count replaces).

    python -m examples.multimodal_dev.benchmarks.bench_plan_layout [--variants 35b_a3b 397b_a17b]
        [--gpus 16 256 1024] [--reps 3]

Each (variant, GPUs) is planned ``--reps`` times after one warm-up (the mix is drawn once per
variant, as a run of the tool draws it once); the median is printed with the number of layouts
examined and the best one. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

BUDGET_S = 10.0


def plan_seconds(name: str, gpus: int, reps: int):
    from examples.multimodal_dev.models import default_model

    VARIANTS = default_model().variants
    from examples.multimodal_dev.planner.layout_cost import HARDWARE
    from examples.multimodal_dev.planner.layout_mix import Mix
    from examples.multimodal_dev.planner.layout_plan import Request, plan

    start = time.perf_counter()
    mix = Mix.mock_mix(VARIANTS[name], 4096)
    mix_s = time.perf_counter() - start
    request = Request(name, VARIANTS[name], gpus, HARDWARE["h100"], mix, global_batch=max(512, gpus))
    result = plan(request)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        plan(request)
        times.append(time.perf_counter() - start)
    return mix_s, statistics.median(times), result


def meta_build_seconds(name: str) -> float:
    from examples.multimodal_dev.models import default_model

    VARIANTS = default_model().variants
    from examples.multimodal_dev.planner.launch_layout import Layout
    from examples.multimodal_dev.planner.meta_builds import rank_build, representative_ranks

    layout = Layout.recommended(name)
    start = time.perf_counter()
    for rank in representative_ranks(layout).values():
        rank_build(VARIANTS[name], layout, rank, shards=False)
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m examples.multimodal_dev.benchmarks.bench_plan_layout", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--variants", nargs="+", default=["9b", "35b_a3b", "397b_a17b"])
    p.add_argument("--gpus", nargs="+", type=int, default=[16, 256, 1024])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    if args.reps < 1 or any(g < 1 for g in args.gpus):
        raise SystemExit("bench_plan_layout: --reps and --gpus must be positive")
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    from examples.multimodal_dev.planner.pipeline_layout import LAYOUTS
    from examples.multimodal_dev.tools.plan_layout import notes, run_settings

    worst = 0.0
    print(
        "| variant | GPUs | layouts | plan s (median) | mix s | budget / plan | best |\n"
        "| --- | --- | --- | --- | --- | --- | --- |"
    )
    for name in args.variants:
        for gpus in args.gpus:
            mix_s, seconds, result = plan_seconds(name, gpus, args.reps)
            worst = max(worst, seconds + mix_s)
            best = (
                f"{run_settings(result.plans[0], result.request, data=False)} {notes(result.plans[0])}"
                if result.plans
                else "none fits"
            )
            print(
                f"| {name} | {gpus} | {result.examined} | {seconds:.2f} | {mix_s:.2f} | "
                f"{BUDGET_S / (seconds + mix_s):.1f}x "
                f"| {best} |",
                flush=True,
            )
        if name in LAYOUTS:
            build_s = meta_build_seconds(name)
            per_layout = seconds / result.examined
            print(
                f"{name}: building one layout's representative ranks on the meta device takes {build_s:.1f} s; "
                f"the planner costs a layout in {per_layout * 1e3:.2f} ms ({build_s / per_layout:,.0f}x faster)",
                flush=True,
            )
    print(
        f"slowest plan (with its mix): {worst:.2f} s, budget {BUDGET_S:.0f} s: "
        f"{'within' if worst < BUDGET_S else 'OVER'}"
    )
    return 0 if worst < BUDGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
