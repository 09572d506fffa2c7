"""How evenly the vision tower's work splits over context-parallel ranks on a realistic mix.

    python -m examples.multimodal_dev.benchmarks.bench_vision_cp [--variant 9b] [--row 8192] [--cp 2 4 8]

``models/common/vision_context_parallel.py`` deals each micro-batch's images to the CP ranks by
their vision FLOPs (whole images). On ``mock_mix`` conversations packed into rows of ``--row``
tokens, this prints the busiest rank's share of a row's vision FLOPs (every rank did all of it
before the split: 1.0; the ideal is 1/CP) and how many rows have fewer images than ranks (those
are encoded on every rank).
"""

from __future__ import annotations

import argparse

from examples.multimodal_dev.data import mock_mix
from examples.multimodal_dev.data.sample import VisionTokens
from examples.multimodal_dev.models import default_model
from examples.multimodal_dev.models.common.work_deal import deal

get_variant = default_model().shape_fn
vision_flops = default_model().vision_flops


def rows_of_grids(conversations: int, row: int) -> list[list]:
    """The vision grids of each row of consecutive mock_mix conversations up to ``row`` tokens."""
    tiny = get_variant("tiny", mtp=False)  # the token ids only: the mix's grids do not depend on them
    dataset = mock_mix.build_datasets(
        tokens=VisionTokens.from_shape(tiny),
        vocab_size=tiny.text.vocab_size,
        patch_dim=tiny.vision.patch_dim,
        seq_length=row,
        num_samples=(conversations, 0, 0),
    )[0]
    rows, grids, used = [], [], 0
    for i in range(conversations):
        tokens, conversation_grids = dataset.describe(i)
        if used + tokens > row and grids:
            rows.append(grids)
            grids, used = [], 0
        grids, used = grids + conversation_grids, used + tokens
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="9b", help="prices the images with this model's vision tower")
    parser.add_argument("--row", type=int, default=8192, help="tokens a packed row")
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args(argv)
    if args.row < 1 or args.conversations < 1 or any(cp < 2 for cp in args.cp):
        parser.error("--row and --conversations must be positive and every --cp at least 2")
    shape = get_variant(args.variant, mtp=False)
    rows = rows_of_grids(args.conversations, args.row)
    print(f"mock_mix, {len(rows)} rows of up to {args.row} tokens, images priced for {args.variant}")
    print(
        "| CP | busiest rank's share of a row's vision FLOPs (mean) | ideal | before | rows with fewer images "
        "than ranks |\n|---|---|---|---|---|"
    )
    results = []
    for cp in args.cp:
        shares, fewer = [], 0
        for grids in rows:
            costs = [vision_flops(shape.vision, shape.text.hidden_size, [g]) for g in grids]
            if len(grids) < cp:
                fewer += 1
                continue
            shares.append(max(sum(costs[i] for i in items) for items in deal(costs, cp)) / sum(costs))
        mean = sum(shares) / max(len(shares), 1)
        results.append({"cp": cp, "busiest_share": mean, "fewer_images_than_ranks": fewer})
        print(f"| {cp} | {mean:.3f} | {1 / cp:.3f} | 1.000 | {fewer} of {len(rows)} |")
    return results


if __name__ == "__main__":
    main()
