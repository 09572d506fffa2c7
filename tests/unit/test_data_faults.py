"""User-reported data faults, each on data built here (tiny parquet / ``save_to_disk`` folders,
PIL images, the tiny processor): splits are never reused for one another, empty parses and
extreme aspect ratios are counted skips, a missing validation split turns megatron's evaluation
off, empty / unusable data stops with one line naming --data-path, and skip counts are the
run's total over DataLoader workers."""

import json
from argparse import Namespace

import datasets
import pytest
import torch
from tiny_processor import build_cord_dataset, build_processor, png_bytes, receipt

from examples.multimodal_dev.data.cord_v2 import build_datasets, load_split
from examples.multimodal_dev.data.loader import build_iterator
from examples.multimodal_dev.data.sample import BadSample, VisionTokens, build_sft_sample
from examples.multimodal_dev.data.skipping import SkippingDataset

GOOD = receipt([("Coffee", "3.50")], "3.50")
ROWS = [(png_bytes((96, 64), (200, 10, 10)), GOOD), (png_bytes((64, 96), (10, 200, 10)), GOOD)]


@pytest.fixture(scope="module")
def processor_path(tmp_path_factory):
    return build_processor(str(tmp_path_factory.mktemp("processor")))


def _build(processor_path, data_path, num_samples=(2, 2, 2), seq_length=400):
    return build_datasets(
        seq_length=seq_length,
        num_samples=num_samples,
        data_path=data_path,
        hf_processor_path=processor_path,
        min_pixels=32 * 32,
        max_pixels=128 * 128,
    )


# A. A split comes only from its own files.


def test_parquet_train_files_alone_give_no_validation_or_test(processor_path, tmp_path):
    saved = build_cord_dataset(str(tmp_path / "saved"), ROWS, splits=("train",))
    folder = tmp_path / "parquet"
    folder.mkdir()
    load_split(saved, "train").to_parquet(str(folder / "train-00000-of-00001.parquet"))
    train, valid, test = _build(processor_path, str(folder))
    assert len(train) == 2 and valid is None and test is None
    # A validation file is used for validation only, and train keeps its own rows.
    one_row = load_split(saved, "train").select([0])
    one_row.to_parquet(str(folder / "validation-00000-of-00001.parquet"))
    assert load_split(str(folder), "validation").num_rows == 1 and load_split(str(folder), "train").num_rows == 2
    # Files that name no split are training data, never validation.
    plain = tmp_path / "receipts.parquet"
    load_split(saved, "train").to_parquet(str(plain))
    assert load_split(str(plain), "train").num_rows == 2 and load_split(str(plain), "validation") is None


def test_one_saved_dataset_is_the_train_split_only(tmp_path):
    saved = build_cord_dataset(str(tmp_path / "saved"), ROWS, splits=("train",))
    single = str(tmp_path / "single")
    datasets.load_from_disk(saved)["train"].save_to_disk(single)  # a Dataset, not a DatasetDict
    assert load_split(single, "train").num_rows == 2
    assert load_split(single, "validation") is None and load_split(single, "test") is None


# B. An answer of nothing but empty values is an empty answer.


@pytest.mark.parametrize("parse", [{"text": ""}, {"menu": [{"nm": " "}], "total": {}}, {"text": None}])
def test_empty_parse_is_a_counted_empty_answer(processor_path, tmp_path, parse):
    empty = json.dumps({"gt_parse": parse})
    data = build_cord_dataset(str(tmp_path / "cord"), [(ROWS[0][0], empty), ROWS[1]], splits=("train",))
    train = _build(processor_path, data)[0]
    with pytest.raises(BadSample, match="empty_answer"):
        train.produce(0)
    assert torch.equal(train[0]["input_ids"], train.produce(1)["input_ids"])
    assert dict(train.skip_counts) == {"empty_answer": 1}


def test_a_parse_with_a_value_is_kept(processor_path, tmp_path):
    data = build_cord_dataset(
        str(tmp_path / "cord"), [(ROWS[0][0], json.dumps({"gt_parse": {"total": "0"}}))], splits=("train",)
    )
    train = _build(processor_path, data)[0]
    train[0]
    assert not train.skip_counts


# C. An image over Qwen's aspect-ratio limit (200) is skipped, when training and when planning.


def test_extreme_aspect_ratio_is_a_counted_skip(processor_path, tmp_path):
    import io

    from PIL import Image

    wide = io.BytesIO()
    Image.new("RGB", (5000, 1), (9, 9, 9)).save(wide, format="PNG")
    data = build_cord_dataset(str(tmp_path / "cord"), [(wide.getvalue(), GOOD), ROWS[1]], splits=("train",))
    train = _build(processor_path, data)[0]
    for produce in (train.produce, train.produce.describe):
        with pytest.raises(BadSample, match=r"aspect_ratio: image aspect ratio over 200"):
            produce(0)
    sample = train[0]
    assert torch.equal(sample["input_ids"], train.produce(1)["input_ids"])
    assert dict(train.skip_counts) == {"aspect_ratio": 1}
    assert train.describe(0) == (sample["input_ids"].numel(), sample["image_grid_thw"].tolist())


# D. A missing validation split: no iterator, and megatron.training does not evaluate.


def _megatron_args(**overrides):
    args = dict(
        iteration=0,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        train_samples=None,
        train_iters=4,
        eval_interval=2,
        eval_iters=2,
        start_eval_at_iter=None,
        global_batch_size=2,
        full_validation=False,
        skip_train=False,
        phase_transition_iterations=None,
        perform_rl_step=False,
        multiple_validation_sets=False,
        dataloader_type="external",
        rank=0,
    )
    return Namespace(**{**args, **overrides})


def test_saved_train_split_alone_turns_megatron_evaluation_off(processor_path, tmp_path, monkeypatch):
    """megatron.training 0.19.2 sets ``do_valid`` from ``[valid]`` (a list, never None) and
    ``--eval-iters``: the real decision, run on the provider's iterators."""
    from megatron.training import global_vars
    from megatron.training import training as megatron_training

    from examples.multimodal_dev.data.collate import Collator
    from examples.multimodal_dev.data.processor import load_processor
    from examples.multimodal_dev.dataset_provider import _no_validation

    data = build_cord_dataset(str(tmp_path / "cord"), ROWS, splits=("train",))
    train, valid, test = _build(processor_path, data)
    assert valid is None and test is None
    tokens = load_processor(processor_path)[1].tokens
    common = dict(micro_batch_size=1, dp_rank=0, dp_size=1, collate_fn=Collator(tokens, packed=True))

    args = _megatron_args()

    def provider(num_samples):  # what dataset_provider.datasets_provider does with these splits
        if valid is None:
            _no_validation(args)
        return (
            build_iterator(train, 0, **common),
            build_iterator(valid, 0, cyclic=True, **common),
            build_iterator(test, 0, **common),
        )

    provider.is_distributed = True
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *a, **k: None)  # one process, no group
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, device=None, **k: real_tensor(*a, **k))  # its 'cuda' flags
    train_it, valid_it, test_it = megatron_training.build_train_valid_test_data_iterators(provider)
    assert train_it is not None and valid_it is None and test_it is None
    assert not args.do_valid and not args.do_test and args.do_train and args.eval_iters == 0


# E. An empty train split is refused in one line.


def test_empty_train_split_is_refused_in_one_line(processor_path, tmp_path):
    data = build_cord_dataset(str(tmp_path / "cord"), [], splits=("train", "validation"))
    with pytest.raises(ValueError, match=rf"^--data-path '{data}': the train split has no rows$"):
        _build(processor_path, data)
    folder = tmp_path / "parquet"
    folder.mkdir()
    load_split(build_cord_dataset(str(tmp_path / "one"), ROWS[:1], splits=("train",)), "train").select([]).to_parquet(
        str(folder / "train-0.parquet")
    )
    with pytest.raises(ValueError, match=r"^--data-path '.*parquet': the train split has no rows$"):
        load_split(str(folder), "train")


def test_an_empty_validation_split_is_no_data(processor_path, tmp_path):
    data = build_cord_dataset(str(tmp_path / "cord"), ROWS, splits=("train",))
    empty_validation = datasets.load_from_disk(data)["train"].select([])
    dd = datasets.DatasetDict({"train": datasets.load_from_disk(data)["train"], "validation": empty_validation})
    dd.save_to_disk(str(tmp_path / "both"))
    train, valid, _ = _build(processor_path, str(tmp_path / "both"))
    assert len(train) == 2 and valid is None


# F. One line naming --data-path for wrong columns and for a folder that is not a dataset.


def test_wrong_columns_name_expected_and_found(tmp_path):
    table = datasets.Dataset.from_dict({"img": [b"x"], "text": ["y"]})
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(
        ValueError,
        match=r"^--data-path '.*d' \(train\): expected columns \['image', "
        r"'ground_truth'\], found \['img', 'text'\]$",
    ):
        load_split(str(tmp_path / "d"), "train")


def test_a_processor_folder_is_not_a_dataset(processor_path):
    with pytest.raises(ValueError) as err:
        load_split(processor_path, "train")
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"--data-path '{processor_path}' holds no dataset files (found ")
    assert "tokenizer" in line and "expected a datasets.save_to_disk folder" in line and "parquet" in line


# G. Skip counts are the run's total over DataLoader workers; an all-bad split is one line.

TOKENS = VisionTokens(image=90, video=91, vision_start=92, vision_end=93, spatial_merge=2)


class _ForcedBad:
    """Rows 0, 3, 6, ... are bad; the others are a text-only sample."""

    def __init__(self, bad_every: int = 3):
        self.bad_every = bad_every

    def __call__(self, index: int) -> dict:
        if index % self.bad_every == 0:
            raise BadSample("forced", f"row {index}")
        return build_sft_sample(torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.zeros(0, 8), torch.zeros(0, 3))


def _collate(samples):
    return {"input_ids": [s["input_ids"] for s in samples], "stats": {"samples": len(samples)}}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_counts_are_the_runs_total_over_workers(num_workers, caplog):
    dataset = SkippingDataset(_ForcedBad(), num_source=12, length=12, tokens=TOKENS, max_length=64, name="forced")
    batches = list(
        build_iterator(
            dataset, 0, micro_batch_size=2, dp_rank=0, dp_size=1, collate_fn=_collate, num_workers=num_workers
        )
    )
    assert sum(b["stats"]["samples"] for b in batches) == 12
    assert all(set(b["stats"]) == {"samples"} for b in batches)  # the counts do not travel on
    # Rows 0, 3, 6 and 9 are asked for once each and skipped once each, whichever worker asked.
    assert dict(dataset.run_skip_counts) == {"forced": 4}
    assert "forced: 4 samples skipped so far in this run (all workers): forced=4" in caplog.text


def test_an_all_bad_split_stops_in_one_line_from_a_worker():
    dataset = SkippingDataset(
        _ForcedBad(bad_every=1),
        num_source=5,
        length=5,
        tokens=TOKENS,
        max_length=64,
        name="cord_v2[train]",
        source="--data-path 'x'",
    )
    batches = build_iterator(dataset, 0, micro_batch_size=1, dp_rank=0, dp_size=1, collate_fn=_collate, num_workers=2)
    with pytest.raises(ValueError) as err:
        next(batches)
    assert str(err.value) == (
        "--data-path 'x': every one of the 5 rows of cord_v2[train] was skipped (forced=5); "
        "check the data and --seq-length"
    )


def test_a_long_run_of_bad_rows_is_skipped_to_the_next_good_row(caplog):
    """A long run of bad rows (200, fewer than ``MAX_SKIPS_IN_A_ROW``) leads to the good row after
    them, every one counted."""
    bad, forced, good = set(range(900, 1000)) | set(range(100)), _ForcedBad(bad_every=1), _ForcedBad()
    dataset = SkippingDataset(
        lambda i: forced(i) if i in bad else good(1),
        num_source=1000,
        length=10,
        tokens=TOKENS,
        max_length=64,
        name="cord_v2[train]",
        source="--data-path 'x'",
    )
    assert dataset[900]["input_ids"].tolist() == [1, 2, 3, 4, 5]
    assert dataset.skip_counts == {"forced": 200}


def test_a_long_run_of_skips_stops_with_the_count_per_reason(monkeypatch, caplog):
    """The providers' one rule (``SkipLog``): ``MAX_SKIPS_IN_A_ROW`` skips in a row stop the run in one
    line counting each reason, though the split has usable rows further on; each reason's own skip
    line is printed the first few times only."""
    from examples.multimodal_dev.data import skipping
    from examples.multimodal_dev.data.sample import DataError

    monkeypatch.setattr(skipping, "MAX_SKIPS_IN_A_ROW", 10)

    def produce(i):
        raise BadSample("missing_image" if i % 2 else "too_long", f"row {i}")

    data = SkippingDataset(produce, 1000, 1000, TOKENS, 64, name="jsonl[train]", source="--data-path 'x'")
    with pytest.raises(DataError) as err:
        data[0]
    assert str(err.value) == (
        "--data-path 'x': 10 samples in a row of jsonl[train] were skipped (missing_image=5, too_long=5); "
        "check the data and --seq-length"
    )
    lines = [r.getMessage() for r in caplog.records if "skipped sample" in r.getMessage()]
    assert len(lines) == 2 * skipping.LINES_PER_REASON, lines
    assert data.skip_counts == {"missing_image": 5, "too_long": 5}
