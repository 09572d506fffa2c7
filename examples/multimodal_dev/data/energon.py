"""Megatron-Energon datasets (``--dataset-provider energon``): WebDataset tar shards prepared by
energon (``.nv-meta``), as ``tools/jsonl_to_energon.py`` writes them, read with energon's own loader.

    --data-path     a prepared dataset folder, or an energon metadataset YAML blending several
                    (energon blends them by its weights; splits "train", "val", "test")

A shard sample is one conversation (``<key>.json`` in the transformers "parts" form whose media
parts name the sample's own members, ``<key>.img0.png``, ``<key>.vid0.mp4``, ...). It is cooked
from energon's ``CrudeSample`` into a ``Conversation`` and turned into a contract sample by the
jsonl provider's ``JsonlConversations.conversation_sample``, so the same conversation gives the
same ids, labels and pixels from either provider (the media reach it as ``data:`` URIs).

Iteration: energon's loader is an iterable that already holds this data-parallel rank's share
(``WorkerConfig(rank=DP rank, world_size=DP size, num_workers)``), so a split here is not a
map-style dataset but an ``EnergonSplit`` with ``build_iterator(...)``; ``data/loader.py``'s
``build_iterator`` hands over to it. Its micro-batches are energon batches of ``--micro-batch-size``
conversations that the task encoder's ``batch`` turns into the project's collated batch (in the
loader's workers, as torch's DataLoader runs the collate). The train split repeats (energon's
shuffle over shards and within a buffer); validation restarts its pass when it ends.

Bad samples are skipped (energon's ``SkipSample``) with a warning naming the conversation's
JSONL origin and shard key; counts reach the run's total through the batches like the map-style
providers' (``loader.SKIPS_KEY``). ``--strict-data`` stops at the first one.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections import Counter

from megatron.energon import (Cooker, DefaultTaskEncoder, Sample, SkipSample, WorkerConfig, basic_sample_keys,
                              get_loader, get_savable_loader, get_train_dataset, get_val_dataset, stateless)
from megatron.energon.edataclass import edataclass
from megatron.energon.errors import reraise_exception

from .loader import SKIPS_KEY, summing_skips
from .sample import BadSample, DataError, fit_to_budget, validate_sample
from .skipping import RunSkipTotals, format_counts

log = logging.getLogger(__name__)

SPLIT_PARTS = ("train", "val", "test")
DEFAULT_SHUFFLE_BUFFER = 100
DEFAULT_MAX_SAMPLES_PER_SEQUENCE = 100
PART_KEYS = {"image": "image", "video": "video"}


def check_energon_path(value: str | None, flag: str = "--data-path") -> str:
    """A prepared dataset folder or a metadataset YAML file; a ``DataError`` naming ``flag`` otherwise.
    Reads no shard: cheap enough to call before launch."""
    if not value or not value.strip():
        raise DataError(f"{flag} is required for --dataset-provider energon (a folder prepared by energon, e.g. by "
                        "tools/jsonl_to_energon.py, or an energon metadataset .yaml)")
    if os.path.isdir(value):
        if not os.path.isfile(os.path.join(value, ".nv-meta", "split.yaml")):
            raise DataError(f"{flag} {value!r}: no .nv-meta/split.yaml: not a prepared energon dataset (run "
                            "'energon prepare' or tools/jsonl_to_energon.py)")
    elif os.path.isfile(value):
        if not value.endswith((".yaml", ".yml")):
            raise DataError(f"{flag} {value!r}: a file here must be an energon metadataset .yaml")
    else:
        raise DataError(f"{flag} {value!r}: no such file or directory")
    return value


def available_splits(path: str) -> set[str]:
    """The split parts ``path`` holds with at least one shard (metadataset: the splits it names)."""
    import yaml

    if os.path.isdir(path):
        with open(os.path.join(path, ".nv-meta", "split.yaml")) as f:
            parts = (yaml.safe_load(f) or {}).get("split_parts") or {}
        return {name for name, shards in parts.items() if shards}
    with open(path) as f:
        meta = yaml.safe_load(f) or {}
    return set((meta.get("splits") or {}) if isinstance(meta, dict) else ())


@edataclass
class Conversation(Sample):
    """A cooked shard sample: the ``<key>.json`` record and the sample's other members' bytes."""

    text: str
    media: dict


@stateless
def cook_conversation(raw: dict) -> Conversation:
    if "json" not in raw:
        raise DataError(f"energon sample {raw.get('__key__')!r} has no .json member: not a conversation shard "
                        "(tools/jsonl_to_energon.py writes them)")
    media = {k: v for k, v in raw.items() if not k.startswith("__") and k != "json"}
    return Conversation(**basic_sample_keys(raw), text=raw["json"].decode(), media=media)


class ConversationEncoder(DefaultTaskEncoder):
    """Conversation -> contract sample (``produce``: a ``JsonlConversations``), a micro-batch's
    samples -> ``collate_fn(samples)``. Without ``produce`` the cooked conversations pass as they are."""

    decoder = None  # members stay bytes: images and videos are decoded as the jsonl provider does
    cookers = (Cooker(cook_conversation),)

    def __init__(self, produce=None, tokens=None, seq_length=None, patch_dim=None, collate_fn=None,
                 name="energon"):
        super().__init__()
        self.produce, self.tokens, self.seq_length, self.patch_dim = produce, tokens, seq_length, patch_dim
        self.collate_fn, self.name = collate_fn, name
        self.skip_counts, self._handed_over = Counter(), Counter()

    @stateless
    def encode_sample(self, sample):
        if self.produce is None:
            return sample
        try:
            return conversation_sample(self.produce, sample, self.tokens, self.seq_length, self.patch_dim)
        except BadSample as bad:
            self.skip_counts[bad.reason] += 1
            log.warning("%s: skipped a conversation (%s); skipped so far in this process: %s", self.name, bad,
                        format_counts(self.skip_counts))
            raise SkipSample() from None

    @stateless
    def batch(self, samples):
        if self.collate_fn is None:
            return samples
        batch = self.collate_fn(samples)
        stats = batch.get("stats") if isinstance(batch, dict) else None
        if isinstance(stats, dict):  # this worker's new skips, summed in the main process (loader.py)
            delta = self.skip_counts - self._handed_over
            self._handed_over = Counter(self.skip_counts)
            stats[SKIPS_KEY] = dict(delta)
        return batch


def conversation_sample(produce, conversation, tokens, seq_length: int, patch_dim: int | None) -> dict:
    """The contract sample of a cooked ``Conversation``, through the jsonl provider's own code."""
    record = json.loads(conversation.text)
    where = f"{record.get('source', '?')} (energon sample {conversation.__key__})"
    for message in record.get("messages") or ():
        for part in message.get("content") if isinstance(message.get("content"), list) else ():
            key = PART_KEYS.get(part.get("type")) if isinstance(part, dict) else None
            if key and isinstance(part.get(key), str):
                data = conversation.media.get(part[key])
                if data is None:
                    raise BadSample(f"missing_{key}", f"{where}: no member {part[key]!r} in the shard sample")
                part[key] = "data:application/octet-stream;base64," + base64.b64encode(data).decode()
    sample = produce.conversation_sample(json.dumps(record), "", where)
    return validate_sample(fit_to_budget(sample, tokens, seq_length), tokens, patch_dim)


def worker_config(dp_rank: int, dp_size: int, num_workers: int, seed: int = 0):
    """energon's per-rank settings; errors other than skips propagate (energon's default would log
    them and carry on for up to 100 samples)."""
    return WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=num_workers, seed_offset=seed,
                        global_error_handler=reraise_exception)


def open_dataset(path: str, split: str, config, encoder, batch_size: int | None, training: bool,
                 shuffle_buffer_size: int | None = DEFAULT_SHUFFLE_BUFFER,
                 max_samples_per_sequence: int | None = DEFAULT_MAX_SAMPLES_PER_SEQUENCE, repeat: bool = True):
    """energon's dataset over ``split`` of ``path`` for one rank: training shuffles and (``repeat``) loops."""
    if training:
        return get_train_dataset(path, split_part=split, worker_config=config, batch_size=batch_size,
                                 shuffle_buffer_size=shuffle_buffer_size,
                                 max_samples_per_sequence=max_samples_per_sequence, task_encoder=encoder,
                                 repeat=repeat)
    return get_val_dataset(path, split_part=split, worker_config=config, batch_size=batch_size, task_encoder=encoder)


class EnergonSplit(RunSkipTotals):
    """One split for ``loader.build_iterator``: what it needs to open energon's loader on a rank."""

    def __init__(self, path: str, split: str, produce, tokens, seq_length: int, patch_dim: int, seed: int,
                 shuffle_buffer_size: int | None, max_samples_per_sequence: int | None, name: str):
        self.path, self.split, self.produce, self.tokens = path, split, produce, tokens
        self.seq_length, self.patch_dim, self.seed, self.name = seq_length, patch_dim, seed, name
        self.shuffle_buffer_size, self.max_samples_per_sequence = shuffle_buffer_size, max_samples_per_sequence
        self.run_skip_counts: Counter = Counter()
        self.loader = None  # energon's loader once an iterator is built

    def encoder(self, collate_fn):
        return ConversationEncoder(self.produce, self.tokens, self.seq_length, self.patch_dim, collate_fn, self.name)

    def build_iterator(self, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, collate_fn,
                       num_workers: int = 0, cyclic: bool = False, plan_fn=None):
        if plan_fn is not None:
            raise DataError("--packing tokens plans over a map-style dataset; --dataset-provider energon streams its "
                            "shards: use --packing samples (energon's own packing is not wired here)")
        config = worker_config(dp_rank, dp_size, num_workers, self.seed)
        training = self.split == "train"
        dataset = open_dataset(self.path, self.split, config, self.encoder(collate_fn), micro_batch_size, training,
                               self.shuffle_buffer_size, self.max_samples_per_sequence)
        if training:
            self.loader = get_savable_loader(dataset, worker_config=config)
            if consumed_samples:
                log.warning("%s: resuming after %d samples: energon's stream starts again from its beginning "
                            "(the loader state is not in the checkpoint)", self.name, consumed_samples)
            return summing_skips(iter(self.loader), self)
        self.loader = get_loader(dataset, worker_config=config)
        return summing_skips(_passes(self.loader, self.name) if cyclic else iter(self.loader), self)


def _passes(loader, name: str):
    """Pass after pass over a finite loader (evaluation draws as many batches as it is asked for)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise DataError(f"{name}: this data-parallel rank's share of the split is empty; fewer shards or "
                            "samples than ranks")


def build_datasets(seq_length: int, num_samples: tuple[int, int, int], data_path: str | None = None,
                   hf_processor_path: str | None = None, seed: int = 0, strict_data: bool = False,
                   min_pixels: int | None = None, max_pixels: int | None = None,
                   energon_shuffle_buffer_size: int | None = DEFAULT_SHUFFLE_BUFFER,
                   energon_max_samples_per_sequence: int | None = DEFAULT_MAX_SAMPLES_PER_SEQUENCE,
                   **options):
    """(train, valid, test) ``EnergonSplit``s of ``data_path``'s "train", "val" and "test" split
    parts; None for a split it does not hold or no samples asked for."""
    from .jsonl import JsonlConversations
    from .jsonl_media import media_settings
    from .processor import load_processor

    path = check_energon_path(data_path)
    splits = available_splits(path)
    if "train" not in splits:
        raise DataError(f"--data-path {path!r}: no shard in its train split")
    processor, info = load_processor(hf_processor_path, min_pixels, max_pixels)
    sizing, videos = media_settings(processor, info, min_pixels, max_pixels, options)
    out = []
    for split, n in zip(SPLIT_PARTS, num_samples):
        if not n or split not in splits:
            out.append(None)
            continue
        source = f"--data-path {path!r} [{split}]"
        produce = JsonlConversations(None, processor, info, sizing, seq_length, source, strict=strict_data,
                                     videos=videos)
        out.append(EnergonSplit(path, split, produce, info.tokens, seq_length, info.patch_dim, seed,
                                energon_shuffle_buffer_size, energon_max_samples_per_sequence, f"energon[{split}]"))
    return tuple(out)
