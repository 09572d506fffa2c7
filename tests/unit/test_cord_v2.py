"""CORD-V2 provider on an in-process dataset (PIL images, saved with ``datasets``) and a tiny
Qwen-style processor: answer-only loss masks (decoded), image token counts, skipping of
corrupt images / empty answers / over-budget samples, and start-up processor checks."""

import json

import pytest
import torch
from tiny_processor import SPECIALS, build_cord_dataset, build_processor, png_bytes, receipt

from examples.multimodal_dev.data.cord_v2 import build_datasets, load_split
from examples.multimodal_dev.data.processor import load_processor

ROWS = [
    (png_bytes((96, 64), (200, 10, 10)), receipt([("Coffee", "3.50"), ("Bagel", "2.25")], "5.75")),
    (b"\x89PNG\r\n\x1a\n this is not an image", receipt([("Tea", "2.00")], "2.00")),
    (png_bytes((64, 96), (10, 200, 10)), receipt([], "")),
    (png_bytes((250, 250), (10, 10, 200)), receipt([("Soup of the day", "7.00")] * 6, "42.00")),
    (png_bytes((128, 64), (90, 90, 10)), receipt([("Water", "1.00")], "1.00")),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("cord")
    return str(build_processor(str(root / "processor"))), build_cord_dataset(str(root / "cord"), ROWS)


def _datasets(paths, seq_length=400, n=5):
    processor_path, data_path = paths
    return build_datasets(
        seq_length=seq_length,
        num_samples=(n, 2, 0),
        data_path=data_path,
        hf_processor_path=processor_path,
        min_pixels=32 * 32,
        max_pixels=128 * 128,
    )


def test_answer_only_loss_mask_and_image_tokens(paths):
    processor, info = load_processor(paths[0])
    train, valid, test = _datasets(paths)
    assert test is None and len(valid) == 2
    sample = train[0]
    trained = sample["labels"][sample["loss_mask"] > 0]
    expected = json.dumps(json.loads(ROWS[0][1])["gt_parse"]) + "<|im_end|>"
    assert processor.tokenizer.decode(trained) == expected
    prompt = processor.tokenizer.decode(sample["input_ids"][: int(torch.nonzero(sample["loss_mask"])[0]) + 1])
    assert prompt.endswith("<|im_start|>assistant\n") and "Extract" in prompt
    n_image_tokens = int((sample["input_ids"] == info.tokens.image).sum())
    assert n_image_tokens * 4 == int(sample["image_grid_thw"].prod(-1).sum()) == sample["pixel_values"].shape[0]


def test_bad_rows_are_skipped_and_counted(paths):
    processor, _ = load_processor(paths[0])
    train, _, _ = _datasets(paths, seq_length=150)
    got = [train[i] for i in range(5)]
    assert train.skip_counts["bad_image"] >= 1 and train.skip_counts["empty_answer"] >= 1
    # Index 1 (corrupt) is replaced by the next usable row, deterministically.
    assert torch.equal(got[1]["input_ids"], train[1]["input_ids"])
    # Row 3's long answer is cut after its image: the image survives, the answer is a prefix.
    long_row = got[3]
    answer = json.dumps(json.loads(ROWS[3][1])["gt_parse"])
    trained = processor.tokenizer.decode(long_row["labels"][long_row["loss_mask"] > 0])
    assert long_row["input_ids"].numel() == 150 and answer.startswith(trained) and len(trained) > 10
    assert int((long_row["input_ids"] == processor.image_token_id).sum()) * 4 == long_row["pixel_values"].shape[0]


def test_budget_that_would_cut_images_skips_everything_with_a_clear_error(paths):
    train, _, _ = _datasets(paths, seq_length=12)
    # Every row is skipped: one line with the count per reason, never a loop over the same rows.
    with pytest.raises(
        ValueError,
        match=r"^--data-path '.*': every one of the 5 rows of cord_v2\[train\] was "
        r"skipped \(bad_image=1, empty_answer=1, over_budget=3\)",
    ):
        train[0]
    assert train.skip_counts["over_budget"] > 0


def test_max_pixels_bounds_the_grid(paths):
    small, _, _ = _datasets(paths)
    processor_path, data_path = paths
    big, _, _ = build_datasets(
        seq_length=2000,
        num_samples=(5, 0, 0),
        data_path=data_path,
        hf_processor_path=processor_path,
        min_pixels=32 * 32,
        max_pixels=256 * 256,
    )

    def patches(ds):  # the 250x250 receipt
        return int(ds.produce(3)["image_grid_thw"].prod())

    assert patches(small) * 16**2 <= 128 * 128 < patches(big) * 16**2


def test_parquet_files_load(paths, tmp_path):
    ds = load_split(paths[1], "train")
    ds.to_parquet(str(tmp_path / "train-00000-of-00001.parquet"))
    again = load_split(str(tmp_path), "train")
    assert again.num_rows == len(ROWS) and again[0]["ground_truth"] == ROWS[0][1]


def test_unusable_processor_fails_at_startup(tmp_path):
    no_image = [t for t in SPECIALS if t != "<|image_pad|>"]
    path = build_processor(str(tmp_path / "p"), specials=no_image)
    with pytest.raises(ValueError, match="no image token"):
        load_processor(path)
    with pytest.raises(ValueError, match="--hf-processor-path is required"):
        load_processor(None)


def test_cord_batch_feeds_the_model_packed_equals_padded(paths, mcore):
    """The processor's token ids drive the model shape (as ``resolve_shape`` does); a packed
    CORD-V2 micro-batch gives the padded batch's per-token loss."""
    from tiny_processor import tiny_shape_for

    from examples.multimodal_dev.data.collate import Collator
    from examples.multimodal_dev.forward_step import batch_loss
    from examples.multimodal_dev.models.qwen35_vl.factory import build_model

    _, info = load_processor(paths[0])
    t = info.tokens
    shape = tiny_shape_for(paths[0])
    torch.manual_seed(0)
    model = build_model(shape).eval()
    train, _, _ = _datasets(paths)
    samples = [train[0], train[4]]
    losses = []
    with torch.no_grad():
        for collate in (Collator(t, packed=True, pad_multiple=4), Collator(t, packed=False)):
            batch = collate(samples)
            loss_sum, n_tokens, _ = batch_loss(model, batch)
            losses.append((loss_sum / n_tokens).item())
    assert abs(losses[0] - losses[1]) < 1e-5 and 5.0 < losses[0] < 12.0


def test_a_missing_split_gives_no_iterator(paths):
    """The saved dataset has train and validation only: asking for test samples gives None."""
    processor_path, data_path = paths
    train, valid, test = build_datasets(
        seq_length=400,
        num_samples=(2, 2, 2),
        data_path=data_path,
        hf_processor_path=processor_path,
        min_pixels=32 * 32,
        max_pixels=128 * 128,
    )
    assert train is not None and valid is not None and test is None


def test_mistyped_local_paths_fail_at_once_without_the_hub(paths, monkeypatch):
    """A path that does not exist is "no such file or directory" at once, never a Hub lookup;
    the Hub is used only for an ``hf://`` name."""
    import socket

    from examples.multimodal_dev.data.sources import resolve

    def no_network(*_args, **_kwargs):
        raise AssertionError("a local path reached for the network")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    with pytest.raises(ValueError, match=r"--data-path 'nothing_rel': no such file or directory .*hf://nothing_rel"):
        load_split("nothing_rel", "train")
    with pytest.raises(ValueError, match=r"--hf-processor-path 'data/proc_typo': no such file or directory"):
        load_processor("data/proc_typo")
    assert resolve("hf://naver-clova-ix/cord-v2", "--data-path") == ("naver-clova-ix/cord-v2", True)
    assert resolve(paths[1], "--data-path") == (paths[1], False)


def test_describe_matches_the_sample_without_decoding(paths):
    """Token-budget packing plans with ``describe``: the image's header, the two resizes
    computed. It must agree with the processed sample, through skips and truncation."""
    for max_pixels in (128 * 128, 48 * 48):
        processor_path, data_path = paths
        train = build_datasets(
            seq_length=300,
            num_samples=(len(ROWS), 0, 0),
            data_path=data_path,
            hf_processor_path=processor_path,
            min_pixels=32 * 32,
            max_pixels=max_pixels,
        )[0]
        for i in range(len(ROWS)):
            sample = train[i]
            assert train.describe(i) == (sample["input_ids"].numel(), sample["image_grid_thw"].tolist()), i


def test_with_qwen35s_template_receipts_are_trained_in_the_format_generation_asks_for(tmp_path):
    """Qwen3.5's generation prompt opens a think block. A receipt is trained as the template renders a
    finished turn (after an empty, closed think block), and generation's prompt (thinking off,
    ``answer_spans.generation_prompt``) is exactly the text before the answer."""
    import re

    from tiny_processor import QWEN35_CHAT_TEMPLATE

    from examples.multimodal_dev.data.answer_spans import generation_prompt
    from examples.multimodal_dev.data.conversations import Media, Turn
    from examples.multimodal_dev.data.cord_v2 import INSTRUCTION

    processor_path = build_processor(str(tmp_path / "processor"), chat_template=QWEN35_CHAT_TEMPLATE)
    data_path = build_cord_dataset(str(tmp_path / "cord"), ROWS[:1])
    train, _, _ = build_datasets(
        seq_length=400,
        num_samples=(1, 0, 0),
        data_path=data_path,
        hf_processor_path=processor_path,
        min_pixels=32 * 32,
        max_pixels=128 * 128,
    )
    processor, _ = load_processor(processor_path)
    sample = train[0]
    answer = json.dumps(json.loads(ROWS[0][1])["gt_parse"])
    assert processor.tokenizer.decode(sample["labels"][sample["loss_mask"] > 0]) == answer + "<|im_end|>"
    first_target = int(torch.nonzero(sample["loss_mask"])[0]) + 1
    context = processor.tokenizer.decode(sample["input_ids"][:first_target])
    context = re.sub(r"(<\|image_pad\|>)+", "<|image_pad|>", context)  # the prompt's one placeholder, expanded
    user = [Turn("user", (Media("image", "receipt"), INSTRUCTION))]
    assert context == generation_prompt(processor, user)
    assert context.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": INSTRUCTION}]}]
    thinking = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert thinking.endswith("<think>\n") and context != thinking  # what CORD-V2 samples used to be trained after
