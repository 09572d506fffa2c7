"""Vision patch limits in packing (``data/token_budget.py``): a row closes before a conversation whose
patches would take it past the limit, in the token-budget plan and in energon's first-fit rows; with
no limit the plan is the plan of before; a plan's state restores into the same limit only."""

import pytest

from examples.multimodal_dev.data import mock_mix, token_budget
from examples.multimodal_dev.data.patch_budget import patches
from examples.multimodal_dev.data.sample import VisionTokens
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant

SHAPE = get_variant("tiny", moe=False, mtp=False)
TOKENS = VisionTokens.from_shape(SHAPE)
ROW = 2048


def _mock(build, n, **options):
    return build(
        tokens=TOKENS,
        vocab_size=SHAPE.text.vocab_size,
        patch_dim=SHAPE.vision.patch_dim,
        seq_length=ROW,
        num_samples=(n, 0, 0),
        **options,
    )[0]


def _plan(describe, n, max_patches, rows=8, dp=2, **kwargs):
    cost = lambda tokens, grids: float(tokens + patches(grids))  # noqa: E731  (vision work moves the balance)
    return token_budget.TokenBudgetPlan(describe, n, ROW, rows, dp, cost=cost, max_patches=max_patches, **kwargs)


def _every_step(plan, first=0):
    s, steps = first, []
    while (step := plan.step(s)) is not None:
        steps.append(step)
        s += 1
    return steps


@pytest.mark.parametrize("limit", [4096, 6000])
def test_rows_stay_under_the_patch_limit_after_the_swaps(limit):
    """The realistic mix at DP=2 (swaps between ranks and with the carried buffer): a row holds at
    most ``limit`` patches unless one conversation over it alone holds them (with text-only ones, as
    tokens cannot fill it); every index is placed once."""
    n = 300
    dataset = _mock(mock_mix.build_datasets, n)
    each = [patches(dataset.describe(i)[1]) for i in range(n)]
    unlimited = [row for st in _every_step(_plan(dataset.describe, n, 0)) for rk in st.ranks for row in rk]
    assert max(sum(each[i] for i in row) for row in unlimited) > limit  # the limit binds
    plan = _plan(dataset.describe, n, limit)
    rows = [row for st in _every_step(plan) for rk in st.ranks for row in rk]
    placed = [i for row in rows for i in row]
    assert all(sum(each[i] for i in row) <= limit or sum(1 for i in row if each[i]) == 1 for row in rows)
    assert sorted(placed + plan.unplaced) == list(range(n)) and len(placed) == len(set(placed))


def test_a_patch_heavy_conversation_closes_the_row_even_with_tokens_to_spare():
    # 12 conversations of 100 tokens (rows of ROW tokens could hold all of them), 3000 patches each
    describe = lambda i: (100, [(1, 50, 60)])  # noqa: E731
    rows = [row for st in _every_step(_plan(describe, 12, 6000, rows=6, dp=1)) for rk in st.ranks for row in rk]
    assert rows and all(len(row) == 2 for row in rows)
    assert [len(row) for row in token_budget.first_fit_rows([100] * 12, ROW, [3000] * 12, 6000)] == [2] * 6
    assert token_budget.first_fit_rows([100] * 12, ROW) == [list(range(12))]  # tokens alone: one row
    # no limit: the plan is the plan of before (and its settings, so older states restore)
    plain = _plan(describe, 12, 0, rows=1, dp=1)
    assert plain.step(0).ranks == [[list(range(12))]] and "max_patches" not in plain.settings()


def test_a_limited_plan_restores_into_the_same_limit_only():
    dataset = _mock(mock_mix.build_datasets, 400)
    steps = _every_step(_plan(dataset.describe, 400, 4096))
    saved = _plan(dataset.describe, 400, 4096)
    saved.step(4)
    state = saved.state(3)
    assert state["carried"] and state["settings"]["max_patches"] == 4096
    resumed = _plan(dataset.describe, 400, 4096)
    assert resumed.restore(state) is None
    assert [s.ranks for s in _every_step(resumed, 3)] == [s.ranks for s in steps[3:]]
    assert _plan(dataset.describe, 400, 0).restore(state) == "it was planned with other settings: max_patches"
