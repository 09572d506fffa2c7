"""Dataset providers and the collate. ``DATASET_PROVIDERS`` maps ``--dataset-provider`` to a
``build_datasets(tokens, vocab_size, patch_dim, seq_length, num_samples, **options)`` that
returns (train, valid, test) map-style datasets of contract samples (see ``sample.py``), or objects
with their own ``build_iterator`` (energon: an iterable that shards by rank itself, ``loader.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from examples.multimodal_dev.megatron_changes.applier import load

DATASET_PROVIDERS = {
    "mock": ".mock.build_datasets",
    "mock_mix": ".mock_mix.build_datasets",
    "mock_video": ".mock_video.build_datasets",
    "cord_v2": ".cord_v2.build_datasets",
    "jsonl": ".jsonl.build_datasets",
    "energon": ".energon.build_datasets",
}


def get_dataset_provider(name: str) -> Callable[..., Any]:
    if name not in DATASET_PROVIDERS:
        raise KeyError(f"unknown --dataset-provider {name!r}; valid: {', '.join(sorted(DATASET_PROVIDERS))}")
    module_name, _, fn = DATASET_PROVIDERS[name].rpartition(".")
    return cast(Callable[..., Any], load(f"{__name__}{module_name}:{fn}"))
