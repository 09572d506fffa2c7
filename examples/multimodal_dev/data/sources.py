"""Where data and processors come from: local paths, or the Hugging Face Hub only when asked.

A value that is not prefixed ``hf://`` is a local path and must exist: a typo fails at once with
"no such file or directory" instead of being retried against the Hub for minutes. ``hf://NAME``
(e.g. ``hf://naver-clova-ix/cord-v2``, ``hf://Qwen/Qwen3.5-0.8B``) asks for the Hub (or its
local cache) explicitly.
"""

from __future__ import annotations

import glob
import os

from .sample import DataError

HUB_PREFIX = "hf://"


def resolve(value: str, flag: str) -> tuple[str, bool]:
    """(local path or Hub name, whether it is a Hub name); ValueError naming ``flag`` for a local
    path (or glob) that matches nothing."""
    if value.startswith(HUB_PREFIX):
        name = value[len(HUB_PREFIX) :]
        if not name:
            raise ValueError(f"{flag} {value!r}: no Hub name after {HUB_PREFIX}")
        return name, True
    exists = glob.glob(value) if glob.has_magic(value) else os.path.exists(value)
    if not exists:
        raise ValueError(
            f"{flag} {value!r}: no such file or directory (a Hugging Face Hub name needs the "
            f"{HUB_PREFIX} prefix, e.g. {HUB_PREFIX}{value.strip('/')})"
        )
    return value, False


# --------------------------------------------------------------------------------------------
# Splits of a local or Hub dataset. A split comes only from its own files: a folder holding
# train files alone has no validation or test data (never the train rows again, which would
# measure evaluation loss on training data).

SPLIT_NAMES = ("train", "validation", "test")
EXPECTED_SOURCES = (
    "a datasets.save_to_disk folder (dataset_dict.json or dataset_info.json), parquet files "
    "named by split (train-*.parquet, validation-*.parquet) or hf://NAME"
)


def load_split(data_path: str, split: str, flag: str = "--data-path"):
    """The ``split`` of ``data_path`` as a ``datasets.Dataset``; None for a validation or test
    split the source does not have or that has no rows. A train split must exist and have rows."""
    import datasets

    path, from_hub = resolve(data_path, flag)
    if from_hub:
        ds = datasets.load_dataset(path, split=split)
    elif os.path.isfile(os.path.join(path, "dataset_dict.json")):
        ds = _saved_split(path, split, flag)
    elif os.path.isfile(os.path.join(path, "dataset_info.json")):
        # One saved Dataset: it is the train split and nothing else.
        ds = _saved_dataset(path) if split == "train" else None
    else:
        ds = _parquet_split(path, split, flag)
    if ds is not None and ds.num_rows == 0:
        ds = None
    if ds is None and split == "train":
        raise DataError(f"{flag} {data_path!r}: the train split has no rows")
    return ds


def _saved_split(path: str, split: str, flag: str):
    """One split of a saved DatasetDict, loaded on its own (an empty sibling split makes
    ``datasets.load_from_disk`` of the whole dict fail with an IndexError)."""
    import json

    with open(os.path.join(path, "dataset_dict.json")) as f:
        splits = json.load(f).get("splits", [])
    if split not in splits:
        if split == "train":
            raise DataError(f"{flag} {path!r} has no train split (it has {sorted(splits)})")
        return None
    return _saved_dataset(os.path.join(path, split))


def _saved_dataset(path: str):
    import json

    import datasets

    with open(os.path.join(path, "state.json")) as f:
        if not json.load(f).get("_data_files"):
            return None  # saved with no rows: no arrow file to load
    return datasets.load_from_disk(path)


def _parquet_split(path: str, split: str, flag: str):
    import datasets

    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "**", "*.parquet"), recursive=True))
        if not files:
            raise DataError(
                f"{flag} {path!r} holds no dataset files (found {_listing(path)}); expected {EXPECTED_SOURCES}"
            )
    elif glob.has_magic(path) or path.endswith(".parquet"):
        files = sorted(f for f in glob.glob(path) if f.endswith(".parquet"))
        if not files:
            raise DataError(f"{flag} {path!r} matches no parquet files; expected {EXPECTED_SOURCES}")
    else:
        raise DataError(f"{flag} {path!r} is not a dataset (a file of another kind); expected {EXPECTED_SOURCES}")
    root = path if os.path.isdir(path) else None
    named = {f: _split_named(os.path.relpath(f, root) if root else os.path.basename(f)) for f in files}
    if not any(named.values()):
        # Files that name no split (e.g. receipts.parquet) are training data only.
        named = dict.fromkeys(files, "train")
    split_files = [f for f, s in named.items() if s == split]
    if not split_files and split == "train":
        raise DataError(
            f"{flag} {path!r} has no train parquet files (found {sorted({s for s in named.values() if s is not None})} "
            "splits); name them train-*.parquet"
        )
    split_files = [f for f in split_files if _parquet_rows(f)]  # datasets refuses files of no rows
    return datasets.load_dataset("parquet", data_files=split_files, split="train") if split_files else None


def _parquet_rows(file: str) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(file).metadata.num_rows


def _split_named(relative: str) -> str | None:
    """The split a parquet file belongs to by its name (hub layout ``train-00000-of-00001.parquet``)
    or a folder below ``--data-path`` (``validation/part-0.parquet``)."""
    parts = os.path.normpath(relative).split(os.sep)
    for split in SPLIT_NAMES:
        if parts[-1].startswith(split) or split in parts[:-1]:
            return split
    return None


def _listing(path: str, limit: int = 6) -> str:
    names = sorted(os.listdir(path))
    shown = ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
    return shown or "nothing"
