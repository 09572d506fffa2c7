"""The vision tower's own layout: which ranks run it with which TP / DP, its process groups written
out by hand for the small layouts (and equal to megatron-core's own rank enumeration), and every
impossible setting refused naming the flag and the value."""

import os
import subprocess
import sys

import pytest

from examples.multimodal_dev.vision_ranks.layout import plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (world, tp, cp, pp, vtp, vnproc) -> vision TP groups, vision DP groups, language first-stage TP groups, table
LAYOUTS = [
    (
        (2, 2, 1, 1, 1, 0),
        [[0], [1]],
        [[0, 1]],
        [[0, 1]],
        [
            "ranks 0-1  vision tower    TP=1 DP=2 (on the language model's ranks)",
            "ranks 0-1  language model  TP=2 CP=1 DP=1 PP=1",
        ],
    ),
    (
        (4, 2, 2, 1, 1, 0),
        [[0], [1], [2], [3]],
        [[0, 1, 2, 3]],
        [[0, 1], [2, 3]],
        [
            "ranks 0-3  vision tower    TP=1 DP=4 (on the language model's ranks)",
            "ranks 0-3  language model  TP=2 CP=2 DP=1 PP=1",
        ],
    ),
    (
        (4, 2, 1, 2, 1, 0),
        [[0], [1]],
        [[0, 1]],
        [[0, 1]],
        [
            "ranks 0-1  vision tower    TP=1 DP=2 (on the language model's first-stage ranks)",
            "ranks 0-3  language model  TP=2 CP=1 DP=1 PP=2",
        ],
    ),
    (
        (3, 2, 1, 1, 1, 1),
        [[0]],
        [[0]],
        [[1, 2]],
        ["ranks 0    vision tower    TP=1 DP=1", "ranks 1-2  language model  TP=2 CP=1 DP=1 PP=1"],
    ),
    (
        (4, 2, 1, 1, 2, 2),
        [[0, 1]],
        [[0], [1]],
        [[2, 3]],
        ["ranks 0-1  vision tower    TP=2 DP=1", "ranks 2-3  language model  TP=2 CP=1 DP=1 PP=1"],
    ),
    (
        (4, 2, 1, 1, 1, 2),
        [[0], [1]],
        [[0, 1]],
        [[2, 3]],
        ["ranks 0-1  vision tower    TP=1 DP=2", "ranks 2-3  language model  TP=2 CP=1 DP=1 PP=1"],
    ),
    (
        (3, 1, 1, 1, 1, 1),
        [[0]],
        [[0]],
        [[1], [2]],
        ["ranks 0    vision tower    TP=1 DP=1", "ranks 1-2  language model  TP=1 CP=1 DP=2 PP=1"],
    ),
]


@pytest.mark.parametrize("sizes, vision_tp, vision_dp, language_tp, table", LAYOUTS, ids=lambda v: str(v))
def test_small_layouts_have_the_hand_written_groups_and_table(sizes, vision_tp, vision_dp, language_tp, table):
    world, tp, cp, pp, vtp, vnproc = sizes
    layout = plan(world, tp, cp, pp, vtp, vnproc, vision_heads=2)
    groups = layout.groups()
    assert (groups.vision_tp, groups.vision_dp, groups.language_tp) == (vision_tp, vision_dp, language_tp)
    assert layout.table() == table
    assert layout.colocated == (vnproc == 0)
    vision = sorted(r for group in vision_tp for r in group)
    assert list(layout.vision_ranks) == vision == sorted(r for group in vision_dp for r in group)
    assert list(layout.language_first_stage_ranks) == sorted(r for group in language_tp for r in group)
    assert layout.language_ranks == range(vnproc, world)
    if not layout.colocated:  # the two modules share no rank
        assert not set(layout.vision_ranks) & set(layout.language_ranks)


@pytest.mark.parametrize(
    "sizes",
    [(8, 4, 1, 2, 2, 0), (16, 2, 2, 2, 1, 0), (6, 2, 1, 1, 2, 4), (12, 2, 1, 2, 1, 4), (8, 4, 1, 1, 4, 4)],
    ids=str,
)
def test_groups_are_megatron_core_rank_enumeration(sizes):
    """megatron-core's RankGenerator (order tp-cp-ep-dp-pp, offset by the vision ranks) gives the same
    groups: the language TP groups on its first pipeline stage, and the vision grid [VISION_TP, DP]."""
    from megatron.core.parallel_state import RankGenerator

    world, tp, cp, pp, vtp, vnproc = sizes
    layout = plan(world, tp, cp, pp, vtp, vnproc, vision_heads=16)
    groups = layout.groups()
    language = RankGenerator(tp=tp, ep=1, dp=layout.dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp", rank_offset=vnproc)
    first_stage = set(layout.language_first_stage_ranks)
    assert groups.language_tp == [g for g in language.get_ranks("tp") if set(g) <= first_stage]
    assert sorted(g[0] for g in language.get_ranks("pp")) == sorted(first_stage)  # every pipeline's stage 0
    vision = RankGenerator(tp=vtp, ep=1, dp=layout.vdp, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    assert groups.vision_tp == vision.get_ranks("tp") and groups.vision_dp == vision.get_ranks("dp")
    if layout.colocated:  # every vision TP group sits inside one language TP group
        assert all(any(set(v) <= set(t) for t in groups.language_tp) for v in groups.vision_tp)


def test_vision_tp_equal_to_tp_is_the_language_models_own_grid():
    layout = plan(8, 2, 2, 2, 2, 0, vision_heads=16)
    assert layout.vdp == 2 and layout.groups().vision_tp == layout.groups().language_tp == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(world=2, tp=2, vtp=0), "--vision-tensor-parallel-size 0: must be a positive integer"),
        (dict(world=2, tp=0, vtp=0), "--tensor-model-parallel-size 0: must be a positive integer"),
        (dict(world=0), "the world size 0: must be a positive integer"),
        (dict(world=2, tp=2, vp=0), "--num-virtual-stages-per-pipeline-rank 0: must be a positive integer"),
        (dict(world=2, vnproc=-1), "--vision-nproc -1: must not be negative"),
        (dict(world=2, tp=2, vtp=3), "--vision-tensor-parallel-size 3 does not divide the 16 vision attention heads"),
        (
            dict(world=4, tp=2, vtp=2, vnproc=2, heads=3),
            "--vision-tensor-parallel-size 2 does not divide the 3 vision attention heads",
        ),
        (
            dict(world=3, tp=2),
            "the world size 3 is not divisible by --tensor-model-parallel-size 2 \\* "
            "--context-parallel-size 1 \\* --pipeline-model-parallel-size 1 = 2",
        ),
        (dict(world=4, tp=2, vtp=4), "--vision-tensor-parallel-size 4 does not divide --tensor-model-parallel-size 2"),
        (
            dict(world=4, tp=2, cp=2, vtp=4),
            "--vision-tensor-parallel-size 4 does not divide --tensor-model-parallel-size 2",
        ),
        (dict(world=2, vnproc=2), "--vision-nproc 2 leaves no ranks for the language model \\(the world size 2\\)"),
        (dict(world=3, tp=2, vtp=2, vnproc=1), "--vision-nproc 1 is not divisible by --vision-tensor-parallel-size 2"),
        (
            dict(world=4, tp=2, vnproc=1),
            "the world size 4 with --vision-nproc 1 leaves 3 ranks to the language model, "
            "not divisible by --tensor-model-parallel-size 2",
        ),
        (
            dict(world=5, tp=2, cp=2, vnproc=1),
            "--context-parallel-size 2 with --vision-nproc 1: megatron-core 0.19.2's bridge",
        ),
        (
            dict(world=5, tp=2, pp=2, vp=2, vnproc=1),
            "--num-virtual-stages-per-pipeline-rank 2 with --vision-nproc 1: "
            "only the non-interleaved pipeline schedule",
        ),
        (
            dict(world=5, vnproc=3),
            "--vision-nproc 3 / --vision-tensor-parallel-size 1 = 3 vision data-parallel ranks and 2 "
            "language data-parallel ranks: one must divide the other",
        ),
        (
            dict(world=10, tp=2, vtp=2, vnproc=6),
            "--vision-nproc 6 / --vision-tensor-parallel-size 2 = 3 vision data-parallel ranks and 2 language",
        ),
    ],
)
def test_impossible_layouts_are_refused_by_name(args, message):
    sizes = dict(tp=1, cp=1, pp=1, vtp=1, vnproc=0, heads=16, vp=1) | args
    with pytest.raises(ValueError, match=message):
        plan(
            sizes["world"],
            sizes["tp"],
            sizes["cp"],
            sizes["pp"],
            sizes["vtp"],
            sizes["vnproc"],
            sizes["heads"],
            vp=sizes["vp"],
        )


def test_data_parallel_sizes_dividing_one_another_either_way_are_accepted():
    assert (plan(5, 1, 1, 1, 1, 1, 2).vdp, plan(5, 1, 1, 1, 1, 1, 2).dp) == (1, 4)
    assert (plan(6, 1, 1, 1, 1, 4, 2).vdp, plan(6, 1, 1, 1, 1, 4, 2).dp) == (4, 2)


def test_command_line_prints_the_table_or_one_line_naming_the_variable():
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "examples.multimodal_dev.vision_ranks.layout", *map(str, args)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )

    proc = run("table", 3, 2, 1, 1, 1, 1, 1, 2)
    assert proc.returncode == 0 and proc.stdout.splitlines() == [
        "# ranks 0    vision tower    TP=1 DP=1",
        "# ranks 1-2  language model  TP=2 CP=1 DP=1 PP=1",
    ], proc.stderr
    proc = run("table", 3, 2, 2, 1, 1, 1, 1, 2)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        "vision_ranks/layout.py: NPROC=3 with VISION_NPROC=1 leaves 2 ranks to the language "
        "model, not divisible by TP=2 * CP=2 * PP=1 = 4"
    )
    proc = run("table", 4, 2, 1, 1, 1, 3, 0, 16)
    assert (
        proc.returncode == 2
        and proc.stderr.strip() == "vision_ranks/layout.py: VISION_TP=3 does not divide the 16 vision attention heads"
    )
    assert run("table", 2).returncode != 0 and "usage: vision_ranks/layout.py table" in run("table", 2).stderr
