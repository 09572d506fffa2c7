"""Mock provider (deterministic, varied, conversation-shaped; with videos: every frame a vision
run), the sample contract's errors for images and videos, and the budget rule: truncate only after
the last image, otherwise skip with a count."""

import pytest
import torch

from examples.multimodal_dev.data import mock_video
from examples.multimodal_dev.data.mock import ASSISTANT, IM_END, TIMESTAMP, MockConversations, build_datasets
from examples.multimodal_dev.data.mock_video import VideoProfile
from examples.multimodal_dev.data.sample import IGNORE_INDEX, BadSample, VisionTokens, fit_to_budget, validate_sample
from examples.multimodal_dev.data.skipping import LINES_PER_REASON

TOKENS = VisionTokens(8000, 8001, 8002, 8003, 2)
PATCH_DIM = 1536


def _mock(seed=5):
    return MockConversations(TOKENS, 8192, PATCH_DIM, seed=seed)


def test_mock_is_deterministic_and_varied():
    a, b = _mock(), _mock()
    for i in (0, 7, 123):
        x, y = a(i), b(i)
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert not torch.equal(_mock(seed=6)(0)["input_ids"], a(0)["input_ids"])
    samples = [a(i) for i in range(48)]
    n_images = {s["image_grid_thw"].shape[0] for s in samples}
    assert n_images == {0, 1, 2}
    assert len({s["input_ids"].numel() for s in samples}) > 30
    grids = torch.cat([s["image_grid_thw"] for s in samples])
    assert bool((grids[:, 1] != grids[:, 2]).any()), "want non-square images"
    for s in samples:
        validate_sample(s, TOKENS, PATCH_DIM)


def test_mock_loss_mask_is_the_answer():
    s = _mock()(3)
    ids, labels, mask = s["input_ids"], s["labels"], s["loss_mask"]
    answer_start = int(torch.nonzero(ids == ASSISTANT).max()) + 2  # after "assistant \n"
    trained = torch.nonzero(mask).flatten()
    assert trained[0] == answer_start - 1 and trained[-1] == ids.numel() - 2
    assert torch.equal(labels[trained], ids[answer_start:])
    assert labels[trained][-1] == IM_END and bool((labels[mask == 0] == IGNORE_INDEX).all())


@pytest.mark.parametrize(
    "field,change,message",
    [
        ("input_ids", lambda s: s["input_ids"].int(), "'input_ids' must be a 1-D torch.int64"),
        ("pixel_values", lambda s: s["pixel_values"][1:], "'pixel_values' has"),
        ("labels", lambda s: s["labels"][:-1], "same length"),
        ("input_ids", lambda s: torch.where(s["input_ids"] == 8000, 20, s["input_ids"]), "image tokens"),
    ],
)
def test_contract_errors_name_the_field(field, change, message):
    sample = next(s for s in (_mock()(i) for i in range(20)) if s["image_grid_thw"].shape[0])
    sample[field] = change(sample)
    with pytest.raises(ValueError, match=message):
        validate_sample(sample, TOKENS, PATCH_DIM)


def _video_sample():
    mock = MockConversations(TOKENS, 8192, PATCH_DIM, seed=5, profile=VideoProfile())
    return next(s for s in (mock(i) for i in range(40)) if int(s["video_grid_thw"][:, 0].sum()) > 1)


@pytest.mark.parametrize(
    "field,change,message",
    [
        ("pixel_values_videos", lambda s: s["pixel_values_videos"][1:], "'pixel_values_videos' has"),
        ("video_grid_thw", lambda s: s["video_grid_thw"].int(), "'video_grid_thw' must be a 2-D torch.int64"),
        ("input_ids", lambda s: torch.where(s["input_ids"] == TOKENS.video, 20, s["input_ids"]), "video tokens"),
        (
            "input_ids",
            lambda s: torch.where(s["input_ids"] == TOKENS.vision_start, 20, s["input_ids"]),
            "vision_start tokens for",
        ),
    ],
)
def test_video_contract_errors_name_the_field(field, change, message):
    sample = _video_sample()
    validate_sample(sample, TOKENS, PATCH_DIM)
    sample[field] = change(sample)
    with pytest.raises(ValueError, match=message):
        validate_sample(sample, TOKENS, PATCH_DIM)


def test_video_mock_frames_and_describe():
    """Each frame of a video is its own vision run behind a timestamp; describe() (no pixels) gives
    the sample's length and its image and video grids, which token-budget packing prices."""
    sample = _video_sample()
    frames = int(sample["video_grid_thw"][:, 0].sum())
    runs = int((sample["input_ids"] == TOKENS.vision_start).sum())
    assert runs == sample["image_grid_thw"].shape[0] + frames
    assert int((sample["input_ids"] == TIMESTAMP).sum()) == frames
    (train,) = mock_video.build_datasets(
        tokens=TOKENS, vocab_size=8192, patch_dim=PATCH_DIM, seq_length=4096, num_samples=(12,)
    )
    for i in range(12):
        s = train[i]
        assert train.describe(i) == (
            s["input_ids"].numel(),
            s["image_grid_thw"].tolist() + s["video_grid_thw"].tolist(),
        )


def test_budget_truncates_after_images_and_skips_otherwise():
    sample = next(s for s in (_mock()(i) for i in range(40)) if s["image_grid_thw"].shape[0])
    last_vision = int(torch.nonzero(sample["input_ids"] == TOKENS.vision_end).max())
    length = sample["input_ids"].numel()
    cut = fit_to_budget(sample, TOKENS, length - 1)
    assert cut["input_ids"].numel() == length - 1 and torch.equal(cut["pixel_values"], sample["pixel_values"])
    with pytest.raises(BadSample) as err:
        fit_to_budget(sample, TOKENS, last_vision)
    assert err.value.reason == "over_budget"
    assert fit_to_budget(sample, TOKENS, length) is sample


def test_skipping_dataset_counts_and_replaces(caplog):
    train, _, _ = build_datasets(TOKENS, 8192, PATCH_DIM, seq_length=120, num_samples=(16, 0, 0), seed=2)
    lengths = [train.produce(i)["input_ids"].numel() for i in range(16)]
    with caplog.at_level("WARNING"):
        got = [train[i] for i in range(16)]
    assert all(s["input_ids"].numel() <= 120 for s in got)
    over = sum(n > 120 for n in lengths)
    assert over > 0 and sum(train.skip_counts.values()) >= 1
    # each skip told in a line, at most LINES_PER_REASON of them (data/skipping.py's rule); the run's
    # total is the main process's line (add_run_skips), not the dataset's
    told = caplog.text.count(": skipped sample ")
    assert 1 <= told <= min(LINES_PER_REASON, sum(train.skip_counts.values())), caplog.text


def test_realistic_mix_has_the_shape_of_an_sft_mix():
    """``mock_mix``: deterministic by seed; a log-normal length mix with a long tail within the
    budget; 0-4 images a document with most documents carrying one; image grids from 224^2 to
    1344^2 pixels at 16-pixel patches with aspect ratios up to 3:1; every sample valid."""
    from examples.multimodal_dev.data import get_dataset_provider
    from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant

    shape = get_variant("tiny")
    common = dict(
        tokens=VisionTokens.from_shape(shape),
        vocab_size=shape.text.vocab_size,
        patch_dim=shape.vision.patch_dim,
        seq_length=4096,
        num_samples=(80, 0, 0),
    )
    train = get_dataset_provider("mock_mix")(seed=1234, **common)[0]
    again = get_dataset_provider("mock_mix")(seed=1234, **common)[0]
    other = get_dataset_provider("mock_mix")(seed=99, **common)[0]
    samples = [train[i] for i in range(80)]
    assert all(torch.equal(samples[i]["input_ids"], again[i]["input_ids"]) for i in (0, 7, 79))
    assert not torch.equal(samples[0]["input_ids"], other[0]["input_ids"])
    lengths = sorted(len(s["input_ids"]) for s in samples)
    images = [len(s["image_grid_thw"]) for s in samples]
    grids = torch.cat([s["image_grid_thw"] for s in samples if len(s["image_grid_thw"])])
    assert lengths[-1] <= 4096 and lengths[len(lengths) // 2] < 1000 < lengths[-1]  # short mostly, long tail
    assert max(images) >= 3 and images.count(1) > images.count(0) > 0
    sides = grids[:, 1:].float() * 16
    assert sides.min() <= 224 and sides.max() >= 1344
    assert (grids[:, 1:].max(1).values / grids[:, 1:].min(1).values).max() >= 2.9  # aspect up to 3:1
    assert (grids[:, 1:] % 2 == 0).all()  # whole 2x2 merged patches
