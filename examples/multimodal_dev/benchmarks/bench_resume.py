"""Resuming token-budget packing at step K: the plan state a checkpoint stores against replaying.

    python -m examples.multimodal_dev.benchmarks.bench_resume [--steps 200] [--rows 16] [--dp 2]

A run resumed at step K needs the rows of step K. Without a stored state every rank replays the
plan from step 0, describing every conversation consumed so far (``describe()``: lengths only, no
pixels); with one (``checkpoint/plan_state.py``) it describes the conversations carried over and
the stream from the stored position on. Both are timed to the rows of step K on ``mock_mix``
(priced by ``models/qwen35_vl/flops.py``, as the engine does), and the rows are checked to be the same.
"""

from __future__ import annotations

import argparse
import json
import time

from examples.multimodal_dev.data import mock_mix
from examples.multimodal_dev.data.sample import VisionTokens
from examples.multimodal_dev.data.token_budget import plan_factory
from examples.multimodal_dev.models import default_model

get_variant = default_model().shape_fn


class Counted:
    """A dataset's ``describe()``, counting the conversations it reads."""

    def __init__(self, dataset):
        self.dataset, self.read = dataset, 0
        self.patch_budget = dataset.patch_budget  # the plan closes rows under the dataset's own

    def __len__(self):
        return len(self.dataset)

    def describe(self, index: int):
        self.read += 1
        return self.dataset.describe(index)


def timed_plan(plans, dataset, step: int, state: dict | None):
    """(the rows of ``step``, conversations described, seconds) from a fresh plan, restored from
    ``state`` when given, else replayed from step 0."""
    counted = Counted(dataset)
    start = time.perf_counter()
    plan = plans(counted, False)
    if state is not None and (why := plan.restore(state)) is not None:
        raise SystemExit(f"bench_resume.py: the state did not restore: {why}")
    rows = plan.step(step)
    return rows, counted.read, time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="K: the step a run resumes at")
    parser.add_argument("--rows", type=int, default=16, help="rows a step (the global batch)")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--variant", default="tiny")
    args = parser.parse_args(argv)
    for flag in ("steps", "rows", "dp", "budget"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)} must be a positive integer")
    shape = get_variant(args.variant, mtp=False)
    # enough conversations for K + 1 steps: a row holds ~3 of mock_mix's on average at 2048 tokens
    needed = (args.steps + 2) * args.rows * max(4, 8 * args.budget // 2048)
    dataset = mock_mix.build_datasets(
        tokens=VisionTokens.from_shape(shape),
        vocab_size=shape.text.vocab_size,
        patch_dim=shape.vision.patch_dim,
        seq_length=args.budget,
        num_samples=(needed, 0, 0),
        seed=1234,
    )[0]
    plans = plan_factory(shape, args.budget, args.rows, args.dp)
    saved = plans(dataset, False)
    saved.step(args.steps)
    state = json.loads(json.dumps(saved.state(args.steps)))  # as read back from the checkpoint
    replayed, replay_read, replay_s = timed_plan(plans, dataset, args.steps, None)
    restored, restore_read, restore_s = timed_plan(plans, dataset, args.steps, state)
    if replayed is None or restored is None or replayed.ranks != restored.ranks:
        raise SystemExit("bench_resume.py: the restored plan's rows differ from the replayed plan's")
    result = {
        "steps": args.steps,
        "replay_s": replay_s,
        "restore_s": restore_s,
        "replay_read": replay_read,
        "restore_read": restore_read,
        "speedup": replay_s / restore_s,
    }
    print(
        f"mock_mix, {args.variant}, {args.rows} rows of {args.budget} tokens a step, DP={args.dp}: the rows of "
        f"step {args.steps} (equal both ways)"
    )
    print("| resume by | conversations described | seconds |\n|---|---|---|")
    print(f"| replaying steps 0-{args.steps - 1} | {replay_read} | {replay_s:.3f} |")
    print(f"| the checkpoint's plan state | {restore_read} | {restore_s:.3f} |")
    print(
        f"plan state: {result['speedup']:.0f}x faster to the first step ({len(state['carried'])} conversations "
        "carried over)"
    )
    return result


if __name__ == "__main__":
    main()
