"""Vision patch budgets (``data/patch_budget.py``): a conversation with an image or a video over its
budget, or over the micro-batch's in total, is a skip named by reason whose message gives the count,
the flag and its value (jsonl, from the media's headers before anything is decoded; the mocks; energon;
``--strict-data`` stops instead); token-budget rows and energon's packed rows never exceed the
micro-batch budget while every conversation under it is still read once; with no budget nothing
changes; bad settings are refused by flag and value. Images, clips and JSONL files are made here."""

import argparse
import os
import re

import pytest
import torch
from test_jsonl import BUDGET, VIDEO_OPTIONS, as_placeholder, train_split, write_images, write_jsonl
from tiny_media import write_video
from tiny_processor import QWEN35_CHAT_TEMPLATE, build_processor

from examples.multimodal_dev.arguments import PATCH_BUDGET_OPTIONS, add_multimodal_args
from examples.multimodal_dev.data import jsonl, mock, mock_mix, mock_video, token_budget, video
from examples.multimodal_dev.data.patch_budget import FLAGS, PatchBudget, check_patch_budget_args, patches
from examples.multimodal_dev.data.sample import BadSample, DataError, VisionTokens
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant

SHAPE = get_variant("tiny", moe=False, mtp=False)
TOKENS = VisionTokens.from_shape(SHAPE)
ROW = 2048


def _patches(sample) -> int:
    return patches(sample["image_grid_thw"].tolist()) + patches(sample["video_grid_thw"].tolist())


# --- flags -------------------------------------------------------------------------------------------


def _args(**overrides):
    base = dict(packing="samples", micro_batch_size=1, **{name: 0 for name in PATCH_BUDGET_OPTIONS})
    return argparse.Namespace(**{**base, **overrides})


def test_the_flags_default_to_no_budget_and_reach_the_providers_by_their_names():
    args = add_multimodal_args(argparse.ArgumentParser()).parse_args(["--max-vision-patches-per-video", "5000"])
    assert tuple(FLAGS) == PATCH_BUDGET_OPTIONS  # the names the training script hands every provider
    assert PatchBudget.from_options(vars(args)) == PatchBudget(per_video=5000)
    unset = PatchBudget.from_options({"max_vision_patches_per_image": None})  # a provider called without the flags
    assert not unset and unset == PatchBudget.from_options({}) == PatchBudget(0, 0, 0)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(max_vision_patches_per_image=-1), "--max-vision-patches-per-image -1: must be 0 (no budget) or a"),
        (dict(max_vision_patches_per_video=-8), "--max-vision-patches-per-video -8: must be 0 (no budget) or a"),
        (dict(max_vision_patches_per_micro_batch=-2), "--max-vision-patches-per-micro-batch -2: must be 0"),
        (
            dict(max_vision_patches_per_micro_batch=4096, micro_batch_size=2),
            "--max-vision-patches-per-micro-batch 4096 with --micro-batch-size 2: under --packing samples a "
            "micro-batch is that many conversations whatever their patches; use --packing tokens",
        ),
    ],
)
def test_settings_refused_by_flag_and_value(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_patch_budget_args(_args(**overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(max_vision_patches_per_image=20000, max_vision_patches_per_micro_batch=4096),  # larger is fine
        dict(max_vision_patches_per_micro_batch=4096, packing="tokens"),
        dict(max_vision_patches_per_image=100, max_vision_patches_per_video=100, micro_batch_size=4),
    ],
)
def test_settings_that_can_be_honoured_pass(overrides):
    check_patch_budget_args(_args(**overrides))


# --- the mocks: every provider of SkippingDataset -----------------------------------------------------


def _mock(build, n, **options):
    return build(
        tokens=TOKENS,
        vocab_size=SHAPE.text.vocab_size,
        patch_dim=SHAPE.vision.patch_dim,
        seq_length=ROW,
        num_samples=(n, 0, 0),
        **options,
    )[0]


def _first_usable(index, over, n):
    """The source row ``SkippingDataset[index]`` reads: the first from ``index`` on (wrapping) not in ``over``."""
    return next((index + k) % n for k in range(n) if (index + k) % n not in over)


def _tries_of_bad_rows(over, n):
    """Skips counted when every index 0..n-1 is read once: each tries its run of bad rows first."""
    return sum((_first_usable(i, over, n) - i) % n for i in range(n))


@pytest.mark.parametrize(
    "build,option,reason,field,budget",
    [
        (mock.build_datasets, "max_vision_patches_per_image", "image_over_patch_budget", "image_grid_thw", 100),
        (mock_video.build_datasets, "max_vision_patches_per_video", "video_over_patch_budget", "video_grid_thw", 200),
        (mock_video.build_datasets, "max_vision_patches_per_micro_batch", "over_micro_batch_patch_budget", None, 300),
    ],
)
def test_a_mock_conversation_over_a_budget_is_skipped_by_name(build, option, reason, field, budget, caplog):
    """The largest image / video / conversation of each read sample is within the budget, one under it
    is read unchanged, and each skip is counted and logged with its reason, the flag and the value."""
    n = 40
    plain, bounded = _mock(build, n), _mock(build, n, **{option: budget})

    def largest(sample) -> int:
        return max((patches([g]) for g in sample[field].tolist()), default=0) if field else _patches(sample)

    over = {i for i in range(n) if largest(plain.produce(i)) > budget}
    assert 0 < len(over) < n / 2, len(over)  # the budget binds on some conversations, not most
    for i in range(n):
        sample = bounded[i]
        assert largest(sample) <= budget, i
        assert torch.equal(sample["input_ids"], plain[_first_usable(i, over, n)]["input_ids"]), i
    assert bounded.skip_counts == {reason: _tries_of_bad_rows(over, n)}
    assert f"({reason}: " in caplog.text and f"> {FLAGS[option]} {budget}" in caplog.text


def test_with_no_budget_a_mock_sample_is_unchanged():
    plain, zero = (
        _mock(mock_video.build_datasets, 12),
        _mock(mock_video.build_datasets, 12, **{name: 0 for name in PATCH_BUDGET_OPTIONS}),
    )
    for i in range(12):
        for field in ("input_ids", "pixel_values", "pixel_values_videos", "video_grid_thw"):
            assert torch.equal(plain[i][field], zero[i][field])
    assert not zero.skip_counts


# --- jsonl: named, from headers, strict ---------------------------------------------------------------


@pytest.fixture(scope="module")
def processor_path(tmp_path_factory):
    return build_processor(str(tmp_path_factory.mktemp("processor")), chat_template=QWEN35_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """A JSONL of: the red image, the wide blue one, red and green together, a clip, text only."""
    folder = str(tmp_path_factory.mktemp("patch_budget"))
    write_images(folder)
    write_video(os.path.join(folder, "clip.mp4"), 8, 64, 48, fps=4)
    qa = [("user", "<image>Colour?"), ("assistant", "Red.")]
    lines = [
        as_placeholder(qa, ["red.png"]),
        as_placeholder(qa, ["pics/blue.png"]),
        as_placeholder([("user", "<image><image>Colours?"), ("assistant", "Red, green.")], ["red.png", "green.png"]),
        {"messages": [{"role": "user", "content": "<video>Moves?"}, {"role": "assistant", "content": "A bar."}]}
        | {"videos": ["clip.mp4"]},
        {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]},
    ]
    return write_jsonl(os.path.join(folder, "data.jsonl"), lines)


def _split(processor_path, records, **budgets):
    return train_split(processor_path, records, n=5, seq_length=2000, **VIDEO_OPTIONS, **budgets)


def test_jsonl_conversations_over_a_budget_are_skipped_before_decoding(processor_path, records, monkeypatch):
    plain = _split(processor_path, records)
    counts = [_patches(plain.produce(i)) for i in range(5)]
    red, blue, both, clip, text = counts
    assert blue > red and both > red and clip and not text, counts  # the records as described
    opened, decoded = [], []
    monkeypatch.setattr(jsonl, "open_image", lambda location: opened.append(location))
    monkeypatch.setattr(video, "load_video", lambda *a: decoded.append(a))
    cases = [  # (flag's dest, value, record, reason, the message's start)
        ("max_vision_patches_per_image", red, 1, "image_over_patch_budget", f"image 1 of 1 is {blue} patches"),
        ("max_vision_patches_per_video", clip - 1, 3, "video_over_patch_budget", f"video 1 of 1 is {clip} patches"),
        (
            "max_vision_patches_per_micro_batch",
            both - 1,
            2,
            "over_micro_batch_patch_budget",
            f"its images and videos are {both} patches",
        ),
    ]
    for option, value, line, reason, said in cases:
        budget, flag = {option: value}, FLAGS[option]
        split = _split(processor_path, records, **budget)
        for make in (split.produce, split.produce.describe):  # the plan skips it with the same message
            with pytest.raises(BadSample) as bad:
                make(line)
            assert bad.value.reason == reason, bad.value
            assert str(bad.value).startswith(f"{reason}: {records}:{line + 1}: {said}"), bad.value
            assert f"> {flag} {value}" in str(bad.value)
        assert not opened and not decoded  # counted from the headers: nothing was decoded to skip it
        strict = _split(processor_path, records, strict_data=True, **budget)
        with pytest.raises(DataError, match=f"{reason}: .*> {flag} {value}.*--strict-data stops at the first"):
            strict.produce(line)


def test_jsonl_rows_under_the_budget_are_read_and_the_skips_counted(processor_path, records):
    plain = _split(processor_path, records)
    red = _patches(plain.produce(0))
    bounded = _split(processor_path, records, max_vision_patches_per_micro_batch=red)
    over = {i for i in range(5) if _patches(plain.produce(i)) > red}
    assert over == {1, 2, 3}  # the blue image, both images, the clip: each over one red image's patches
    for i in range(5):
        sample = bounded[i]
        assert _patches(sample) <= red
        assert torch.equal(sample["input_ids"], plain.produce(_first_usable(i, over, 5))["input_ids"]), i
    assert bounded.skip_counts == {"over_micro_batch_patch_budget": _tries_of_bad_rows(over, 5)}


# --- packing: rows close under the micro-batch budget -------------------------------------------------


def _plan(describe, n, max_patches, rows=8, dp=2, **kwargs):
    cost = lambda tokens, grids: float(tokens + patches(grids))  # noqa: E731  (vision work moves the balance)
    return token_budget.TokenBudgetPlan(describe, n, ROW, rows, dp, cost=cost, max_patches=max_patches, **kwargs)


def _every_step(plan, first=0):
    s, steps = first, []
    while (step := plan.step(s)) is not None:
        steps.append(step)
        s += 1
    return steps


def test_token_budget_rows_never_exceed_the_patch_budget_and_read_every_conversation_once():
    """The realistic mix, conversations over the budget on their own skipped by the dataset: each
    row stays under the budget (after the swaps that balance the ranks), the plan places every
    index once, and every usable conversation is read, none over the budget; the budget binds
    (rows without it go over)."""
    budget, n = 4096, 300
    plain = _mock(mock_mix.build_datasets, n)
    bounded = _mock(mock_mix.build_datasets, n, max_vision_patches_per_micro_batch=budget)
    unbounded = _every_step(token_budget.plan_factory(SHAPE, ROW, 8, 2)(plain, False))
    unbounded_rows = [
        sum(patches(plain.describe(i)[1]) for i in row) for st in unbounded for rk in st.ranks for row in rk
    ]
    assert max(unbounded_rows) > budget

    plan = token_budget.plan_factory(SHAPE, ROW, 8, 2)(bounded, False)
    assert plan.max_patches == budget  # the dataset's own budget
    steps = _every_step(plan)
    rows = [row for st in steps for rk in st.ranks for row in rk]
    row_patches = [sum(patches(bounded.describe(i)[1]) for i in row) for row in rows]
    row_tokens = [sum(bounded.describe(i)[0] for i in row) for row in rows]
    over = {j for j in range(n) if _patches(bounded.produce.describe(j)) > budget}
    usable = {j for j in range(n) if _usable(bounded, j)}
    placed = [i for row in rows for i in row]
    read = {_first_usable(i, set(range(n)) - usable, n) for i in placed + plan.unplaced}
    for name, planned, per_row in (("no budget", unbounded, unbounded_rows), (f"{budget}", steps, row_patches)):
        print(
            f"{name}: {len(planned)} steps of 8 rows; patches a row: max {max(per_row)}, mean "
            f"{sum(per_row) / len(per_row):.0f}; padding {sum(s.pad_fraction for s in planned) / len(planned):.3f}, "
            f"DP imbalance {sum(s.imbalance for s in planned) / len(planned):.4f}"
        )
    print(f"{len(over)} of {n} conversations over {budget} patches, skipped")
    assert len(steps) >= 8 and max(row_patches) <= budget and max(row_tokens) <= ROW
    assert sorted(placed + plan.unplaced) == list(range(n)) and len(placed) == len(set(placed))
    assert over and not over & usable and read == usable  # every usable conversation, none over the budget


def _usable(dataset, j) -> bool:
    """Whether source row ``j`` of ``dataset`` is read rather than skipped (for any reason)."""
    try:
        dataset.describe(j, skip=False)
    except BadSample:
        return False
    return True


@pytest.mark.parametrize("limit", [4096, 6000])
def test_the_plan_alone_keeps_rows_under_the_limit_after_the_swaps(limit):
    """The planner without the dataset's skips (DP=2: swaps between ranks and with the carried
    buffer): a row holds at most ``limit`` patches unless one conversation over it alone holds them
    (with text-only ones, as tokens cannot fill it); every index is placed once."""
    n = 300
    dataset = _mock(mock_mix.build_datasets, n)
    each = [patches(dataset.describe(i)[1]) for i in range(n)]
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
    # no budget: the plan is the plan of before (and its settings, so older states restore)
    plain = _plan(describe, 12, 0, rows=1, dp=1)
    assert plain.step(0).ranks == [[list(range(12))]] and "max_patches" not in plain.settings()


def test_a_budgeted_plan_restores_into_the_same_budget_only():
    dataset = _mock(mock_mix.build_datasets, 400, max_vision_patches_per_micro_batch=4096)
    straight = _plan(dataset.describe, 400, 4096)
    steps = _every_step(straight)
    saved = _plan(dataset.describe, 400, 4096)
    saved.step(4)
    state = saved.state(3)
    assert state["carried"] and state["settings"]["max_patches"] == 4096
    resumed = _plan(dataset.describe, 400, 4096)
    assert resumed.restore(state) is None
    assert [s.ranks for s in _every_step(resumed, 3)] == [s.ranks for s in steps[3:]]
    assert _plan(dataset.describe, 400, 0).restore(state) == "it was planned with other settings: max_patches"


def test_energon_rows_close_under_the_budget_and_skip_by_name(example_data, caplog):
    from examples.multimodal_dev.data.energon import build_datasets
    from examples.multimodal_dev.data.loader import build_iterator

    _, out, _, processor = example_data
    options = dict(BUDGET, **VIDEO_OPTIONS, energon_packing_buffer_size=8)

    def rows(n, **budget):
        train, _, _ = build_datasets(
            4096, (1, 0, 0), data_path=str(out), hf_processor_path=processor, **options, **budget
        )
        train.pack_rows(1024, 4)
        collate = lambda samples: {"patches": [_patches(s) for s in samples], "stats": {}}  # noqa: E731
        batches = build_iterator(train, 0, 1, 0, 1, collate)
        return [next(batches)["patches"] for _ in range(n)], train

    plain, _ = rows(6)
    single = sorted({p for row in plain for p in row if p})
    budget = single[-1]  # the largest conversation fits alone; rows of several go over without the budget
    assert max(map(sum, plain)) > budget, plain
    bounded, _ = rows(6, max_vision_patches_per_micro_batch=budget)
    print("patches per conversation, per row:", plain, "->", bounded)
    assert max(map(sum, bounded)) <= budget and max(map(len, bounded)) > 1

    skipped, train = rows(4, max_vision_patches_per_micro_batch=single[0])
    assert all(sum(row) <= single[0] for row in skipped)
    assert "over_micro_batch_patch_budget" in train.run_skip_counts
    assert f"> --max-vision-patches-per-micro-batch {single[0]}" in caplog.text
