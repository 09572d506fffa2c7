"""What each GPU of a launch layout holds: parameters and GiB of weights, gradients and optimizer
state of representative ranks, every rank built on the meta device in this process (no GPU).

    python -m examples.multimodal_dev.tools.rank_memory [VARIANT ...] [--layout "TP=2 PP=8 ..."]
                                                        [--check] [--lora-rank R]

VARIANT: released variants with a recommended layout (default: all of them). ``--layout`` builds
another layout instead (keys TP PP VP CP EP ETP FIRST LAST GPUS; unset ones as in
``pipeline_layout.LAYOUTS``' defaults: 1, FIRST / LAST / VP none). Rows are Markdown, the
table of docs/planner.md. Representative ranks: the first rank of the first, a middle and the last
pipeline stage, and an expert-parallel rank other than 0 (``meta_builds.representative_ranks``).
Assumptions (``meta_builds``): bf16 weights, fp32 gradient buffers, distributed optimizer (fp32
main parameters + two Adam moments) sharded over each parameter's data-parallel group.
``--lora-rank R``: a LoRA run (the default targets): the base frozen, gradients and optimizer
state for the adapters alone.

``--check`` also builds every main-replica rank of the layout and checks that their checkpoint
shards cover the converter's mapping exactly once (``planner/mapping_coverage.py``), and prints
the whole model's total and active parameters against the published figures; ~1.5 minutes for
all five variants on two CPU cores.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from math import prod

HEADER = (
    "| variant | layout | rank | parameters | weights GiB | gradients GiB | optimizer GiB | total GiB |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- |"
)


def parse_layout(text: str, where: str = "rank_memory: --layout"):
    from examples.multimodal_dev.planner.launch_layout import Layout

    try:
        layout = Layout.parse(text)
    except ValueError as err:
        raise SystemExit(f"{where} {err}")
    if layout.fsdp:  # the builds count the distributed optimizer's shards; FSDP's are the planner's alone
        raise SystemExit(
            f"{where} {text}: FSDP=1 is not built here (the meta builds shard as the distributed optimizer "
            "does); plan_layout --layout costs it"
        )
    return layout


def table_rows(name, shape, layout, build=None, lora=None) -> list[str]:
    """docs/planner.md's table rows of one variant: its representative ranks (``build(rank)``: a
    ``RankBuild``, by default built here; ``lora``: ``lora.targets.LoraSettings``, a LoRA run)."""
    from examples.multimodal_dev.planner.meta_builds import GIB, rank_build, rank_memory, representative_ranks

    build = build or (lambda rank: rank_build(shape, layout, rank, shards=False, lora=lora))
    described = layout.describe() + (f", {lora.describe()}" if lora else "")
    rows = []
    for label, rank in representative_ranks(layout).items():
        mem = rank_memory(build(rank), layout)
        rows.append(
            f"| `{name}` | {described} | {rank} ({label}) | {mem.params / 1e9:.2f} B | "
            f"{mem.weight_bytes / GIB:.1f} | {mem.grad_bytes / GIB:.1f} | {mem.optimizer_bytes / GIB:.1f} | "
            f"{mem.total_bytes / GIB:.1f} |"
        )
    return rows


def _check(name, shape, layout) -> bool:
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    from examples.multimodal_dev.planner.mapping_coverage import (
        PUBLISHED,
        coverage_errors,
        expected_keys,
        parameter_counts,
        within_published_rounding,
    )
    from examples.multimodal_dev.planner.meta_builds import main_replica_ranks, rank_build

    start = time.perf_counter()
    expected = expected_keys(shape)
    ranks = main_replica_ranks(layout)
    builds = [rank_build(shape, layout, r) for r in ranks]
    errors = coverage_errors(expected, builds, layout)
    seconds = time.perf_counter() - start
    counts = parameter_counts(shape, expected)
    main = sum(
        prod(sh.local_shape) for b in builds for c in b.chunks for sh in c.shards if is_main_replica(sh.replica_id)
    )
    line = (
        f"{name}: {len(ranks)} ranks built, {len(expected)} checkpoint keys: "
        + ("covered exactly once" if not errors else f"{len(errors)} errors, first: {errors[0]}")
        + f" ({seconds:.0f} s). Parameters: {counts.total / 1e9:.2f} B total, {counts.active / 1e9:.2f} B active "
        f"(without the MTP head's {counts.mtp / 1e9:.2f} B; vision tower {counts.vision / 1e9:.2f} B included); "
        f"main replicas of all ranks hold {main / 1e9:.2f} B with the MTP head"
    )
    ok = not errors and main == counts.with_mtp
    if name in PUBLISHED:
        total, active = PUBLISHED[name]
        match = within_published_rounding(counts.total, total) and within_published_rounding(counts.active, active)
        line += f"; published {total} B / {active} B: {'match' if match else 'MISMATCH'}"
        ok = ok and match
    print(line, flush=True)
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.multimodal_dev.tools.rank_memory", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("variants", nargs="*", metavar="VARIANT")
    parser.add_argument("--layout", help='another layout, e.g. "TP=4 PP=2 GPUS=16" (default: the recommended one)')
    parser.add_argument("--check", action="store_true", help="check every rank's shards against the mapping")
    parser.add_argument("--lora-rank", type=int, default=0, help="a LoRA run: adapters of this rank, the base frozen")
    args = parser.parse_args(argv)
    if args.lora_rank < 0:
        raise SystemExit(f"rank_memory: --lora-rank {args.lora_rank}: must be 0 (off) or a positive rank")
    from examples.multimodal_dev.lora.targets import LoraSettings
    from examples.multimodal_dev.models import default_model
    from examples.multimodal_dev.planner.pipeline_layout import LAYOUTS

    lora = LoraSettings(args.lora_rank) if args.lora_rank else None
    VARIANTS = default_model().variants
    names = args.variants or list(LAYOUTS)
    valid = list(VARIANTS) if args.layout else list(LAYOUTS)
    bad = [n for n in names if n not in valid]
    if bad:
        raise SystemExit(f"rank_memory: unknown variant {bad[0]!r}; valid: {', '.join(valid)}")
    layout = parse_layout(args.layout) if args.layout else None

    # megatron-core logs a deprecation warning for every GPTModel built; hundreds of builds here
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    from examples.multimodal_dev.planner.launch_layout import Layout

    print(HEADER, flush=True)
    ok = True
    for name in names:
        chosen = layout or Layout.recommended(name)
        try:
            chosen.check(VARIANTS[name])
        except ValueError as err:
            raise SystemExit(f"rank_memory: {name} at {args.layout or 'its layout'}: {err}")
        for row in table_rows(name, VARIANTS[name], chosen, lora=lora):
            print(row, flush=True)
    if args.check:
        for name in names:
            try:
                ok = _check(name, VARIANTS[name], layout or Layout.recommended(name)) and ok
            except RuntimeError as err:
                raise SystemExit(f"rank_memory --check: {name}: {err}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
