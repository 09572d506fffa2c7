"""How much of each released variant's work is the vision tower's, on the layout planner's mix.

    python -m examples.multimodal_dev.tools.vision_share [--seq-len 4096] [--samples 4096] [--docs-table]

Rows of ``--seq-len`` tokens packed from ``--samples`` conversations of ``mock_mix``'s profile
(``planner/layout_mix.py``, the planner's mix); FLOPs (``models/qwen35_vl/flops.py``) summed over
the rows. Columns:

  vision tower parameters   the whole tower, from the shape (``planner/rank_params.py``)
  vision share of FLOPs     the tower's FLOPs over the model's (``Mix.vision_share``)
  planned layout            ``pipeline_layout.LAYOUTS``: TP, PP, CP and the layers of the first
                            stage; a variant without one is shown on one stage
  vision / first stage      the tower's FLOPs over the language model's on the first pipeline stage
                            (its layers, and the output layer and MTP head when it is also the last):
                            in the ordinary layout both are split over the stage's TP x CP ranks, so
                            it is also the ratio per GPU, what the tower adds to that stage's work
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields

VARIANT_NAMES = ("0.8b", "2b", "4b", "9b", "27b", "35b_a3b", "122b_a10b", "397b_a17b")
HEADER = (
    "| variant | vision tower parameters | vision share of FLOPs | planned layout: first stage "
    "| vision / first stage's language FLOPs |\n| --- | --- | --- | --- | --- |"
)


@dataclass
class Share:
    name: str
    vision_params: int
    share: float  # vision FLOPs / model FLOPs over the mix
    layout: str
    first_stage: float  # vision FLOPs / the first stage's language FLOPs

    def row(self) -> str:
        return (
            f"| `{self.name}` | {self.vision_params / 1e6:.0f} M | {100 * self.share:.1f} % | {self.layout} "
            f"| {100 * self.first_stage:.0f} % |"
        )


def total_flops(shape, rows):
    """``micro_batch_flops`` of every row, summed part by part (a ``FlopsBreakdown``)."""
    from examples.multimodal_dev.models import default_model

    FlopsBreakdown = default_model().flops_breakdown
    micro_batch_flops = default_model().micro_batch_flops

    parts = [micro_batch_flops(shape, r.lengths, r.grids) for r in rows]
    return FlopsBreakdown(**{f.name: sum(getattr(p, f.name) for p in parts) for f in fields(FlopsBreakdown)})


def stage_language_flops(shape, fb, layers, last: bool) -> float:
    """The language model's share of ``fb`` on a stage holding decoder ``layers``, with the output
    layer and the MTP head on the last stage."""
    from examples.multimodal_dev.planner.layout_cost import decoder_layer_flops

    return decoder_layer_flops(shape, fb, layers) + (fb.output + fb.mtp if last else 0.0)


def vision_share(name, shape, mix) -> Share:
    from examples.multimodal_dev.planner.launch_layout import Layout
    from examples.multimodal_dev.planner.pipeline_layout import LAYOUTS, stage_layers
    from examples.multimodal_dev.planner.rank_params import stage_params

    n, lay = shape.text.num_layers, Layout.recommended(name) if name in LAYOUTS else Layout()
    first = [i for chunk in stage_layers(n, lay.pp, lay.vp, lay.first, lay.last)[0] for i in chunk]
    fb = total_flops(shape, mix.rows)
    where = f"TP={lay.tp} PP={lay.pp} CP={lay.cp}" if name in LAYOUTS else "none (one stage)"
    return Share(
        name,
        stage_params(shape, Layout(), 0).vision,
        mix.vision_share(),
        f"{where}: {len(first)} of {n} layers",
        fb.vision / stage_language_flops(shape, fb, first, lay.pp == 1),
    )


def mixes(names, seq_len: int, samples: int) -> dict:
    """The planner's mix for each variant. ``mock_mix`` reads the shape only for its spatial merge,
    so the rows are drawn once for each merge size and costed for each variant."""
    from examples.multimodal_dev.models import default_model

    VARIANTS = default_model().variants
    from examples.multimodal_dev.planner import layout_mix

    drawn, out = {}, {}
    for name in names:
        shape, merge = VARIANTS[name], VARIANTS[name].vision.spatial_merge_size
        if merge not in drawn:
            drawn[merge] = layout_mix.Mix.mock_mix(shape, seq_len, draw=samples)
        out[name] = layout_mix.Mix(shape, seq_len, drawn[merge].rows, drawn[merge].name)
    return out


def table(seq_len: int = 4096, samples: int | None = None, names=VARIANT_NAMES) -> list[Share]:
    from examples.multimodal_dev.models import default_model

    VARIANTS = default_model().variants
    from examples.multimodal_dev.planner.layout_mix import DRAW

    return [vision_share(n, VARIANTS[n], mix) for n, mix in mixes(names, seq_len, samples or DRAW).items()]


def main(argv=None) -> int:
    from examples.multimodal_dev.planner.layout_mix import DRAW

    parser = argparse.ArgumentParser(
        prog="python -m examples.multimodal_dev.tools.vision_share", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens of a packed row [4096, the planner's]")
    parser.add_argument(
        "--samples", type=int, default=DRAW, help=f"conversations drawn for the rows [{DRAW}, the planner's draw]"
    )
    parser.add_argument(
        "--docs-table", "--readme-table", action="store_true", help="docs/parallelism.md's Markdown table"
    )
    args = parser.parse_args(argv)
    from examples.multimodal_dev.planner.layout_plan import MIN_CP_TOKENS

    for flag, value, low in (("--seq-len", args.seq_len, MIN_CP_TOKENS // 8), ("--samples", args.samples, 1)):
        if value < low:  # the planner's bound on the row length
            raise SystemExit(f"vision_share: {flag} {value}: must be at least {low}")
    try:
        shares = table(args.seq_len, args.samples)
    except ValueError as err:  # no row of seq_len tokens in the draw
        raise SystemExit(f"vision_share: {err}")
    if args.docs_table:
        print(HEADER)
    for s in shares:
        print(
            s.row()
            if args.docs_table
            else f"{s.name:<10} vision tower {s.vision_params / 1e6:3.0f} M | {100 * s.share:4.1f} % of the FLOPs | "
            f"{s.layout:<34} | vision / first stage's language FLOPs {100 * s.first_stage:3.0f} %"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
