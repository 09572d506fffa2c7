"""Token-budget packing (``data/token_budget.py``) on the realistic mock mix: rows never exceed
the budget and never split an image, every conversation of the epoch appears exactly once
across ranks and steps, a resumed sampler sees exactly the rows of the straight one, plans are
deterministic by seed, the ranks' work is balanced and padding small, a budget row's per-token
loss equals the padded loss of the same conversations (1e-5), and bad settings are refused by
flag name."""

import json
from argparse import Namespace

import pytest
import torch

from examples.multimodal_dev.checkpoint import plan_state
from examples.multimodal_dev.data import mock_mix, token_budget
from examples.multimodal_dev.data.collate import Collator
from examples.multimodal_dev.data.sample import VisionTokens
from examples.multimodal_dev.data.token_budget import TokenBudgetPlan, TokenBudgetSampler, check_packing_args, deal_rows
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.models.qwen35_vl.flops import micro_batch_flops

SHAPE = get_variant("tiny", moe=False, mtp=False)
TOKENS = VisionTokens.from_shape(SHAPE)
BUDGET = 2048


def _cost(tokens, grids):
    return micro_batch_flops(SHAPE, [tokens], grids).training


def _mix(n, seed=1234):
    return mock_mix.build_datasets(
        tokens=TOKENS,
        vocab_size=SHAPE.text.vocab_size,
        patch_dim=SHAPE.vision.patch_dim,
        seq_length=BUDGET,
        num_samples=(n, 0, 0),
        seed=seed,
    )[0]


def _plan(dataset, rows=8, dp=2, **kwargs):
    return TokenBudgetPlan(dataset.describe, len(dataset), BUDGET, rows, dp, cost=_cost, **kwargs)


def _steps(plan, first=0):
    s, out = first, []
    while (step := plan.step(s)) is not None:
        out.append(step)
        s += 1
    return out


def test_rows_fit_the_budget_and_every_conversation_appears_once():
    dataset = _mix(300)
    plan = _plan(dataset)
    steps = _steps(plan)
    seen = []
    for step in steps:
        assert [len(rows) for rows in step.ranks] == [4, 4]
        for rows in step.ranks:
            for row in rows:
                assert row and sum(dataset.describe(i)[0] for i in row) <= BUDGET
                seen += row
    print(f"{len(steps)} steps hold {len(seen)} conversations; {len(plan.unplaced)} left for a partial step")
    assert len(steps) >= 8 and len(seen) == len(set(seen))
    assert sorted(seen + plan.unplaced) == list(range(300))


def test_a_budget_row_is_one_static_shape_and_splits_no_image():
    dataset = _mix(120)
    row = next(r for r in _plan(dataset).step(0).ranks[0] if any(dataset.describe(i)[1] for i in r))
    samples = [dataset[i] for i in row]
    batch = Collator(TOKENS, row_length=BUDGET)(samples)
    ids, grids = batch.tokens[0], batch.image_grid_thw
    assert ids.shape == (BUDGET,) and batch.stats.padded_tokens == BUDGET
    assert batch.stats.real_tokens == sum(s["input_ids"].numel() for s in samples)
    assert int(batch.cu_seqlens_padded[-1]) == BUDGET and bool(batch.padding_mask[0, -1])
    starts = torch.nonzero(ids == TOKENS.vision_start).flatten().tolist()
    ends = torch.nonzero(ids == TOKENS.vision_end).flatten().tolist()
    assert len(starts) == len(ends) == grids.shape[0] > 0
    for (t, h, w), a, b in zip(grids.tolist(), starts, ends):  # each image whole, in order, in one run
        assert b - a - 1 == t * h * w // TOKENS.spatial_merge**2
        assert bool((ids[a + 1 : b] == TOKENS.image).all())
    assert batch.pixel_values.shape[0] == int(grids.prod(-1).sum())


def test_a_resumed_sampler_sees_exactly_the_same_rows():
    dataset = _mix(400)
    straight = [list(TokenBudgetSampler(_plan(dataset), 0, rank)) for rank in (0, 1)]
    resumed = [list(TokenBudgetSampler(_plan(dataset), 3 * 8, rank)) for rank in (0, 1)]
    assert all(len(s) >= 24 for s in straight)
    assert resumed == [s[3 * 4 :] for s in straight]
    assert not set(map(tuple, straight[0])) & set(map(tuple, straight[1]))
    with pytest.raises(ValueError, match="consumed samples 12 is not a whole number of steps of 8 rows"):
        TokenBudgetSampler(_plan(dataset), 12, 0)


def test_a_plan_restored_from_a_checkpoint_continues_without_replaying(tmp_path):
    """The state of step 3, through the checkpoint file, puts a fresh plan at step 3 with the
    same rows as the straight plan, reading only the conversations from there on."""
    dataset = _mix(400)
    steps = _steps(_plan(dataset))
    checkpoint = tmp_path / "iter_0000003"
    checkpoint.mkdir()
    saved = _plan(dataset)
    saved.step(5)  # the loader runs a step or two ahead of the save
    assert plan_state.write_state(str(checkpoint), saved, 3 * 8)
    state = saved.state(3)
    assert state["step"] == 3 and state["carried"]  # something to carry makes the test meaningful
    read = []
    resumed = _plan(dataset)
    resumed.describe = lambda i: read.append(i) or dataset.describe(i)
    assert (
        plan_state.resume(resumed, str(tmp_path), 3, 3 * 8)
        == f"token-budget plan: continues at step 3 from {checkpoint / plan_state.PLAN_FILE}"
    )
    assert [s.ranks for s in _steps(resumed, first=3)] == [s.ranks for s in steps[3:]]
    # only the carried conversations (checked) and the stream from the saved cursor on are read
    assert sorted(i for i in read if i < state["cursor"]) == sorted(i for i, _, _ in state["carried"])

    # the plan keeps the starting state of its last steps only
    far = _plan(dataset)
    far.step(3 + token_budget.STATES_KEPT)
    assert far.state(3) is None and not plan_state.write_state(str(tmp_path), far, 3 * 8)
    assert not plan_state.write_state(str(tmp_path / "iter_0000009"), saved, 3 * 8)  # no such directory
    # a checkpoint planned with other settings, for another step or without the file: replay, saying why
    other = _plan(dataset, rows=4, dp=1)
    assert plan_state.resume(other, str(tmp_path), 3, 6 * 4) == (
        f"token-budget plan: replaying 6 steps from the start ({plan_state.PLAN_FILE} is for step 3, the run "
        "resumes at step 6)"
    )
    assert plan_state.resume(other, str(tmp_path), 3, 3 * 4) == (
        "token-budget plan: replaying 3 steps from the start (it was planned with other settings: dp_size, "
        "rows_per_step)"
    )
    assert plan_state.resume(_plan(dataset), str(tmp_path), 2, 2 * 8) == (
        f"token-budget plan: replaying 2 steps from the start ({tmp_path / 'iter_0000002'} has no "
        f"{plan_state.PLAN_FILE})"
    )
    assert plan_state.resume(_plan(dataset), None, 0, 0) is None
    (checkpoint / plan_state.PLAN_FILE).write_text('{"step": 3, "settings": ')
    assert "(token_budget_plan.json is not a plan state: JSONDecodeError: " in plan_state.resume(
        _plan(dataset), str(tmp_path), 3, 3 * 8
    )
    # another dataset whose carried conversations have other lengths
    assert "has another length in this dataset" in _plan(_mix(400, seed=7)).restore(state)


@pytest.mark.parametrize("tamper", ["cursor moved", "carried index out of range", "carried list emptied"])
def test_an_edited_plan_file_is_replayed_not_trusted(tmp_path, tamper):
    """A plan file that is still valid JSON but not what the run wrote trains other rows if trusted:
    its checksum sends the resume back to replaying, saying why; a state that checks out but does not
    describe this dataset is refused by restore() itself."""
    dataset = _mix(400)
    checkpoint = tmp_path / "iter_0000003"
    checkpoint.mkdir()
    saved = _plan(dataset)
    saved.step(5)
    assert plan_state.write_state(str(checkpoint), saved, 3 * 8)
    path = checkpoint / plan_state.PLAN_FILE
    state = json.loads(path.read_text())
    edit = {
        "cursor moved": lambda s: s.update(cursor=s["cursor"] + 5),
        "carried index out of range": lambda s: s["carried"][0].__setitem__(0, 999999999),
        "carried list emptied": lambda s: s.update(carried=[]),
    }[tamper]
    edit(state)
    path.write_text(json.dumps(state))
    line = plan_state.resume(_plan(dataset), str(tmp_path), 3, 3 * 8)
    assert line == (
        "token-budget plan: replaying 3 steps from the start (token_budget_plan.json is not a plan state: "
        "ValueError: its content does not match the checksum written with it (edited or damaged))"
    ), line
    state.pop("sha256")
    if tamper == "carried index out of range":
        assert "are not distinct conversations of this dataset" in _plan(dataset).restore(state)
    if tamper == "cursor moved":
        state["cursor"] = 10**9
        assert "is not a position in this dataset" in _plan(dataset).restore(state)


def test_plans_are_deterministic_by_seed():
    first = [s.ranks for s in (_plan(_mix(200)).step(i) for i in range(3))]
    again = [s.ranks for s in (_plan(_mix(200)).step(i) for i in range(3))]
    other = [s.ranks for s in (_plan(_mix(200, seed=99)).step(i) for i in range(3))]
    assert first == again and first != other


def test_ranks_balanced_and_padding_small_on_the_realistic_mix():
    dataset = _mix(10**6)
    plan = _plan(dataset, rows=16)
    steps = [plan.step(s) for s in range(12)]
    imbalance = sum(s.imbalance for s in steps) / len(steps)
    padding = sum(s.pad_fraction for s in steps) / len(steps)
    print(f"mean DP imbalance {imbalance:.4f}, worst {max(s.imbalance for s in steps):.4f}; padding {padding:.4f}")
    assert imbalance < 1.01 and padding < 0.02
    # the plan's costs are what the collate's FLOPs count gives the rank (flops.py, real tokens)
    rows = steps[0].ranks[0]
    measured = sum(
        micro_batch_flops(
            SHAPE, [dataset.describe(i)[0] for i in row], [g for i in row for g in dataset.describe(i)[1]]
        ).training
        for row in rows
    )
    assert measured == pytest.approx(steps[0].rank_costs[0], rel=1e-9)


def test_rows_by_cost_then_swaps_balance_ranks():
    assert sorted(map(sorted, deal_rows([5, 4, 3, 3, 2, 1], 2))) == [[0, 3, 5], [1, 2, 4]]
    with pytest.raises(ValueError, match="6 rows cannot be dealt evenly to 4 ranks"):
        deal_rows([1] * 6, 4)


def test_a_conversation_longer_than_the_budget_gets_a_row_to_itself():
    lengths = [30, 100, 20, 25, 10, 40, 5, 60, 15, 35]
    plan = TokenBudgetPlan(lambda i: (lengths[i], []), len(lengths), 64, 4, 1, pad_multiple=4)
    rows = plan.step(0).ranks[0]
    assert [100] in [[lengths[i] for i in row] for row in rows]
    for row in rows:
        padded = sum(-(-lengths[i] // 4) * 4 for i in row)
        assert padded <= 64 or len(row) == 1


def test_a_cyclic_plan_wraps_around_for_evaluation():
    plan = _plan(_mix(40), cyclic=True)
    indices = [i for s in range(6) for rows in plan.step(s).ranks for row in rows for i in row]
    assert len(indices) > 40 and set(indices) == set(range(40))


def test_budget_row_loss_equals_padded_loss(mcore):
    from examples.multimodal_dev.forward_step import batch_loss
    from examples.multimodal_dev.models.qwen35_vl.factory import build_model

    dataset = _mix(60)
    row = max(_plan(dataset).step(0).ranks[1], key=len)
    samples = [dataset[i] for i in row]
    torch.manual_seed(0)
    model = build_model(SHAPE).eval()
    losses = {}
    with torch.no_grad():
        for name, collate in (
            ("budget row", Collator(TOKENS, row_length=BUDGET)),
            ("padded", Collator(TOKENS, packed=False)),
        ):
            loss_sum, n_tokens, _ = batch_loss(model, collate(samples))
            losses[name] = (loss_sum / n_tokens).item()
    print(f"{len(samples)} conversations: per-token loss {losses}")
    assert len(samples) >= 2 and abs(losses["budget row"] - losses["padded"]) < 1e-5


def _args(**overrides):
    base = dict(
        packing="tokens",
        packed_seq_length=None,
        seq_length=1024,
        use_packed_sequence=True,
        micro_batch_size=1,
        rampup_batch_size=None,
        packing_window=4096,
        context_parallel_size=1,
        tensor_model_parallel_size=1,
        sequence_parallel=False,
    )
    return Namespace(**{**base, **overrides})


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(micro_batch_size=2), "--micro-batch-size 2: with --packing tokens a micro-batch is one row"),
        (dict(use_packed_sequence=False), "cannot be combined with --no-packed-sequence"),
        (dict(packed_seq_length=0), "--packed-seq-length 0 must be a positive integer"),
        (dict(packing_window=0), "--packing-window 0 must be a positive integer"),
        (dict(packed_seq_length=1001, context_parallel_size=2), "--packed-seq-length 1001 must be a multiple of 4"),
        (dict(rampup_batch_size=[1, 1, 8]), "--rampup-batch-size"),
    ],
)
def test_settings_refused_by_flag(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_packing_args(_args(**overrides))


def test_budget_defaults_to_the_sequence_length():
    args = _args()
    check_packing_args(args)
    assert args.packed_seq_length == 1024
