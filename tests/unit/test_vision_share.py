"""The vision tower's share of the work (``tools/vision_share.py``): the README's table is what the
tool prints, the share follows the data mix, and the first stage's language FLOPs are the model's
cut by the planned split (the stages add up to the whole)."""

import os

import pytest

from examples.multimodal_dev.models.qwen35_vl.configuration import VARIANTS
from examples.multimodal_dev.planner.layout_mix import Mix
from examples.multimodal_dev.planner.pipeline_layout import LAYOUTS, stage_layers
from examples.multimodal_dev.tools import vision_share as tool

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


@pytest.fixture(scope="module")
def shares():
    return {s.name: s for s in tool.table()}


def test_readme_table_is_what_the_tool_prints(shares):
    with open(README) as f:
        readme = f.read()
    assert tool.HEADER in readme
    lines = set(readme.splitlines())
    for s in shares.values():
        assert s.row() in lines, f"README lacks the row (rerun tools/vision_share --readme-table)\n{s.row()}"


def test_the_share_follows_the_mix():
    """The same conversations without their images leave the tower nothing; with a second copy of
    each image its share grows. A tool that ignored the mix's grids would fail both."""
    shape = VARIANTS["9b"]
    images = [(3000, [(1, 32, 32)]), (1000, [])] * 8
    doubled = [(n, grids * 2) for n, grids in images]
    text = [(n, []) for n, _ in images]
    share = {
        name: tool.vision_share("9b", shape, Mix.from_documents(shape, 4096, docs))
        for name, docs in (("images", images), ("doubled", doubled), ("text", text))
    }
    assert share["text"].share == 0 and share["text"].first_stage == 0
    assert 0 < share["images"].share < share["doubled"].share < 1
    assert share["images"].first_stage < share["doubled"].first_stage


@pytest.mark.parametrize("variant", list(LAYOUTS))
def test_the_stages_add_up_to_the_model(shares, variant):
    """Every stage's language FLOPs by the planned split, plus the tower's, are the model's forward;
    and the first stage's ratio is the tool's column."""
    shape, lay = VARIANTS[variant], LAYOUTS[variant]
    mix = tool.mixes([variant], 4096, 512)[variant]
    fb = tool.total_flops(shape, mix.rows)
    tp, pp, vp, cp, ep, etp, first, last, gpus = lay
    stages = stage_layers(shape.text.num_layers, pp, vp, first, last)
    per_stage = [
        tool.stage_language_flops(shape, fb, [i for c in chunks for i in c], p == pp - 1)
        for p, chunks in enumerate(stages)
    ]
    assert sum(per_stage) + fb.vision == pytest.approx(fb.forward, rel=1e-12)
    assert fb.vision / per_stage[0] == pytest.approx(tool.vision_share(variant, shape, mix).first_stage, rel=1e-12)
    assert shares[variant].layout.startswith(f"TP={tp} PP={pp} CP={cp}: {sum(map(len, stages[0]))} of ")


def test_a_single_stage_holds_the_whole_language_model(shares):
    """Without a planned layout the first stage is the model: vision / language = share / (1 - share)."""
    s = shares["0.8b"]
    assert s.first_stage == pytest.approx(s.share / (1 - s.share), rel=1e-9)
