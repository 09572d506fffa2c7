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
shuffle over shards and within a buffer); validation restarts its pass when it ends. Under
``--packing tokens`` a micro-batch is one row that energon's packing stage fills from a buffer of
conversations (``ConversationEncoder.select_samples_to_pack``).

Resume: the training loader's state goes into each checkpoint per DP rank
(``checkpoint/loader_state.py``, as JSON: ``energon_state.py``) and comes back through
``EnergonSplit.restore_state``, so a resumed run reads what the straight run would have read.

A dataset is data: ``energon_configs`` refuses any of its YAML that names code (energon's typed
converter would import and call it) before energon reads it, and guards energon's resolver too.

Bad samples are skipped (energon's ``SkipSample``) with a warning naming the conversation's
JSONL origin and shard key (one over a vision patch budget too, ``patch_budget.py``); counts
reach the run's total through the batches like the map-style providers'
(``loader.hand_over_skips``), under their rule (``skipping.SkipLog``: a few lines per reason, and a
stop after ``MAX_SKIPS_IN_A_ROW`` in a row). ``--strict-data`` stops at the first one.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import os
from collections import Counter

from megatron.energon import (
    Cooker,
    DefaultTaskEncoder,
    Sample,
    SkipSample,
    WorkerConfig,
    basic_sample_keys,
    get_loader,
    get_savable_loader,
    get_train_dataset,
    get_val_dataset,
    stateless,
)
from megatron.energon.edataclass import edataclass
from megatron.energon.errors import reraise_exception

from ..megatron_changes import apply
from . import energon_state
from .energon_configs import check_dataset, read_config
from .loader import exit_with_parent, hand_over_skips, summing_skips
from .patch_budget import PatchBudget, patches
from .sample import BadSample, DataError, fit_to_budget, validate_sample
from .skipping import RunSkipTotals, SkipLog
from .token_budget import first_fit_rows

log = logging.getLogger(__name__)

SPLIT_PARTS = ("train", "val", "test")
DEFAULT_SHUFFLE_BUFFER = 100
DEFAULT_MAX_SAMPLES_PER_SEQUENCE = 100
DEFAULT_PACKING_BUFFER = 64
RESTORE_KEY = "__restore_key__"  # energon's name for it in a dict sample


def check_energon_path(value: str | None, flag: str = "--data-path") -> str:
    """A prepared dataset folder or a metadataset YAML file whose configs name no code
    (``energon_configs``); a ``DataError`` naming ``flag`` or the file otherwise. Reads no shard:
    cheap enough to call before launch."""
    if not value or not value.strip():
        raise DataError(
            f"{flag} is required for --dataset-provider energon (a folder prepared by energon, e.g. by "
            "tools/jsonl_to_energon.py, or an energon metadataset .yaml)"
        )
    if os.path.isdir(value):
        if not os.path.isfile(os.path.join(value, ".nv-meta", "split.yaml")):
            raise DataError(
                f"{flag} {value!r}: no .nv-meta/split.yaml: not a prepared energon dataset (run "
                "'energon prepare' or tools/jsonl_to_energon.py)"
            )
    elif os.path.isfile(value):
        if not value.endswith((".yaml", ".yml")):
            raise DataError(f"{flag} {value!r}: a file here must be an energon metadataset .yaml")
    else:
        raise DataError(f"{flag} {value!r}: no such file or directory")
    check_dataset(value)
    return value


def available_splits(path: str) -> set[str]:
    """The split parts ``path`` holds with at least one shard (metadataset: the splits it names);
    ``DataError`` naming the file where it does not say."""
    if os.path.isdir(path):
        file = os.path.join(path, ".nv-meta", "split.yaml")
        parts = _mapping(_mapping(read_config(file), file, "the file").get("split_parts") or {}, file, "split_parts")
        return {name for name, shards in parts.items() if shards}
    return set(_mapping(_mapping(read_config(path), path, "the file").get("splits") or {}, path, "splits"))


def _mapping(value, file: str, what: str) -> dict:
    if not isinstance(value, dict):
        raise DataError(f"energon config {file}: {what} must be a mapping, got {type(value).__name__}")
    return value


@contextlib.contextmanager
def energon_metadata_errors(path: str):
    """energon's own errors on a dataset's metadata (a tampered split.yaml, .info.json or
    dataset.yaml: KeyError, TypeError, its JsonValueError, ...) as one line naming the dataset."""
    try:
        yield
    except DataError:
        raise
    except (KeyError, TypeError, AttributeError, AssertionError, ValueError) as err:
        raise DataError(
            f"--data-path {path}: energon cannot read this dataset's metadata ({type(err).__name__}: {err})"
        ) from None


@edataclass
class Conversation(Sample):
    """A cooked shard sample: the ``<key>.json`` record and the sample's other members' bytes."""

    text: str
    media: dict


@stateless
def cook_conversation(raw: dict) -> Conversation:
    if "json" not in raw:
        raise DataError(
            f"energon sample {raw.get('__key__')!r} has no .json member: not a conversation shard "
            "(tools/jsonl_to_energon.py writes them)"
        )
    media = {k: v for k, v in raw.items() if not k.startswith("__") and k != "json"}
    return Conversation(**basic_sample_keys(raw), text=raw["json"].decode(), media=media)


class ConversationEncoder(DefaultTaskEncoder):
    """Conversation -> contract sample (``produce``: a ``JsonlConversations``), a micro-batch's
    samples -> ``collate_fn(samples)``. Without ``produce`` the cooked conversations pass as they are.

    Token-budget packing (``row_tokens``): energon's packing stage hands a buffer of encoded
    conversations to ``select_samples_to_pack``, which fills rows of at most ``row_tokens`` tokens
    first-fit decreasing (lengths padded to ``pad_multiple``), and of at most ``max_patches`` vision
    patches when that is set (``patch_budget.py``); a micro-batch is one such row."""

    decoder = None  # members stay bytes: images and videos are decoded as the jsonl provider does
    cookers = (Cooker(cook_conversation),)

    def __init__(
        self,
        produce=None,
        tokens=None,
        seq_length=None,
        patch_dim=None,
        collate_fn=None,
        name="energon",
        row_tokens: int | None = None,
        pad_multiple: int = 1,
        max_patches: int = 0,
    ):
        super().__init__()
        self.produce, self.tokens, self.seq_length, self.patch_dim = produce, tokens, seq_length, patch_dim
        self.collate_fn, self.name = collate_fn, name
        self.row_tokens, self.pad_multiple, self.max_patches = row_tokens, pad_multiple, max_patches
        self.skips = SkipLog(name)  # the providers' one rule: a few lines per reason, a stop after many in a row
        self.skip_counts, self._handed_over = self.skips.counts, Counter()

    @stateless
    def encode_sample(self, sample):
        if self.produce is None:
            return sample
        try:
            encoded = conversation_sample(self.produce, sample, self.tokens, self.seq_length, self.patch_dim)
        except BadSample as bad:
            self.skips.skipped(bad, "a conversation")
            raise SkipSample() from None
        self.skips.usable()
        # energon finds a buffered sample again by this key when its loader state is restored
        return {**encoded, RESTORE_KEY: sample.__restore_key__}

    @stateless
    def select_samples_to_pack(self, samples):
        lengths = [-(-s["input_ids"].numel() // self.pad_multiple) * self.pad_multiple for s in samples]
        counts = [patches(s["image_grid_thw"].tolist()) + patches(s["video_grid_thw"].tolist()) for s in samples]
        rows = first_fit_rows(lengths, self.row_tokens, counts, self.max_patches)
        return [[samples[i] for i in row] for row in rows]

    @stateless
    def pack_selected_samples(self, samples):
        return PackedRow(samples)

    @stateless
    def batch(self, samples):
        if self.collate_fn is None:
            return samples
        conversations = [c for s in samples for c in (s.samples if isinstance(s, PackedRow) else [s])]
        batch = self.collate_fn([{k: v for k, v in c.items() if k != RESTORE_KEY} for c in conversations])
        # this worker's new skips, summed in the main process (loader.py)
        if hand_over_skips(batch, dict(self.skip_counts - self._handed_over)):
            self._handed_over = Counter(self.skip_counts)
        return batch


class PackedRow:
    """The conversations of one token-budget row, as energon's packing stage yields it."""

    def __init__(self, samples: list):
        self.samples = samples


def conversation_sample(produce, conversation, tokens, seq_length: int, patch_dim: int | None) -> dict:
    """The contract sample of a cooked ``Conversation``, through the jsonl provider's own code. Every
    image and video it names, in whatever format and key, is one of the sample's own members: a
    shard never reaches a host path or URL."""
    try:
        record = json.loads(conversation.text)
        source = record.get("source", "?") if isinstance(record, dict) else "?"
    except (ValueError, RecursionError):
        source = "?"  # the jsonl provider's own parse names the fault
    where = f"{source} (energon sample {conversation.__key__})"

    def member(media) -> str:
        data = conversation.media.get(media.ref)
        if data is None:
            raise BadSample(f"missing_{media.kind}", f"no member {media.ref!r} in the shard sample")
        return "data:application/octet-stream;base64," + base64.b64encode(data).decode()

    sample = produce.conversation_sample(conversation.text, "", where, locate_media=member)
    return validate_sample(fit_to_budget(sample, tokens, seq_length), tokens, patch_dim)


def worker_config(dp_rank: int, dp_size: int, num_workers: int, seed: int = 0):
    """energon's per-rank settings; errors other than skips propagate (energon's default would log
    them and carry on for up to 100 samples)."""
    return WorkerConfig(
        rank=dp_rank,
        world_size=dp_size,
        num_workers=num_workers,
        seed_offset=seed,
        global_error_handler=reraise_exception,
    )


def open_dataset(
    path: str,
    split: str,
    config,
    encoder,
    batch_size: int | None,
    training: bool,
    shuffle_buffer_size: int | None = DEFAULT_SHUFFLE_BUFFER,
    max_samples_per_sequence: int | None = DEFAULT_MAX_SAMPLES_PER_SEQUENCE,
    repeat: bool = True,
    packing_buffer_size: int | None = None,
):
    """energon's dataset over ``split`` of ``path`` for one rank: training shuffles and (``repeat``) loops;
    ``packing_buffer_size``: rows packed by ``encoder`` from that many conversations at a time."""
    apply("energon-refuses-code")
    with energon_metadata_errors(path):
        if training:
            return get_train_dataset(
                path,
                split_part=split,
                worker_config=config,
                batch_size=batch_size,
                shuffle_buffer_size=shuffle_buffer_size,
                max_samples_per_sequence=max_samples_per_sequence,
                task_encoder=encoder,
                repeat=repeat,
                packing_buffer_size=packing_buffer_size,
            )
        return get_val_dataset(
            path,
            split_part=split,
            worker_config=config,
            batch_size=batch_size,
            task_encoder=encoder,
            packing_buffer_size=packing_buffer_size,
        )


class EnergonSplit(RunSkipTotals):
    """One split for ``loader.build_iterator``: what it needs to open energon's loader on a rank.

    Resume: ``save_state()`` is this rank's loader state with the settings it was read with
    (``energon_state``: JSON, no pickle); a run resumed with the same settings hands it to
    ``restore_state`` before ``build_iterator`` and continues exactly where the saved run stopped.
    energon cannot move a state to other settings (another DP size or worker count deals the
    shards differently): ``stream_settings`` says what must match."""

    def __init__(
        self,
        path: str,
        split: str,
        produce,
        tokens,
        seq_length: int,
        patch_dim: int,
        seed: int,
        shuffle_buffer_size: int | None,
        max_samples_per_sequence: int | None,
        name: str,
        packing_buffer_size: int = DEFAULT_PACKING_BUFFER,
        max_patches: int = 0,
    ):
        self.path, self.split, self.produce, self.tokens = path, split, produce, tokens
        self.seq_length, self.patch_dim, self.seed, self.name = seq_length, patch_dim, seed, name
        self.shuffle_buffer_size, self.max_samples_per_sequence = shuffle_buffer_size, max_samples_per_sequence
        self.packing_buffer_size = packing_buffer_size
        self.max_patches = max_patches  # --max-vision-patches-per-micro-batch: packed rows close under it
        self.row_tokens, self.pad_multiple = None, 1  # pack_rows
        self.run_skip_counts: Counter = Counter()
        self.loader = None  # energon's loader once an iterator is built
        self._settings, self._restore = None, None

    def pack_rows(self, row_tokens: int, pad_multiple: int) -> None:
        """Token-budget packing: each micro-batch one row of at most ``row_tokens`` tokens (and of at most
        ``max_patches`` vision patches, the split's micro-batch patch budget, when set), filled from
        ``packing_buffer_size`` conversations at a time on this rank (rows are not dealt across ranks
        by cost, as the map-style plan does: each rank reads its own stream)."""
        self.row_tokens, self.pad_multiple = row_tokens, pad_multiple

    def encoder(self, collate_fn):
        return ConversationEncoder(
            self.produce,
            self.tokens,
            self.seq_length,
            self.patch_dim,
            collate_fn,
            self.name,
            self.row_tokens,
            self.pad_multiple,
            self.max_patches,
        )

    def stream_settings(self, micro_batch_size: int, dp_rank: int, dp_size: int, num_workers: int) -> dict:
        """Everything that decides which conversations this rank's loader yields, in which order."""
        return dict(
            path=os.path.abspath(self.path),
            split=self.split,
            seed=self.seed,
            shuffle_buffer_size=self.shuffle_buffer_size,
            max_samples_per_sequence=self.max_samples_per_sequence,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            num_workers=num_workers,
            row_tokens=self.row_tokens,
            pad_multiple=self.pad_multiple,
            packing_buffer_size=self.packing_buffer_size if self.row_tokens else None,
            # a budget closes rows elsewhere; unset, the settings are what a run before budgets saved
            **({"max_patches": self.max_patches} if self.row_tokens and self.max_patches else {}),
        )

    def save_state(self) -> dict | None:
        """This rank's position (JSON-ready), or None before a training iterator exists."""
        if self.loader is None or self._settings is None:
            return None
        try:
            return {"settings": self._settings, "loader": energon_state.dumps(self.loader.save_state_rank())}
        except energon_state.StateFormatError as err:
            log.warning(
                "%s: the loader state is not saved, a run resumed from this checkpoint restarts the stream (%s)",
                self.name,
                err,
            )
            return None

    def restore_state(self, saved: dict) -> None:
        """Continue from ``saved`` (``save_state``'s, same settings) when the training iterator is built;
        ``energon_state.StateFormatError`` for a state that does not read back."""
        self._restore = energon_state.loads(saved["loader"])

    def build_iterator(
        self,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        collate_fn,
        num_workers: int = 0,
        cyclic: bool = False,
        plan_fn=None,
    ):
        if plan_fn is not None:  # pretrain's datasets_provider calls pack_rows for a stream instead
            raise ValueError("an energon split packs its own rows (EnergonSplit.pack_rows), it takes no plan_fn")
        config = worker_config(dp_rank, dp_size, num_workers, self.seed)
        training = self.split == "train"
        dataset = open_dataset(
            self.path,
            self.split,
            config,
            self.encoder(collate_fn),
            micro_batch_size,
            training,
            self.shuffle_buffer_size,
            self.max_samples_per_sequence,
            packing_buffer_size=self.packing_buffer_size if self.row_tokens else None,
        )
        if training:
            self.loader = _as_ranks_need(get_savable_loader(dataset))
            self._settings = self.stream_settings(micro_batch_size, dp_rank, dp_size, num_workers)
            if self._restore is not None:
                self.loader.restore_state_rank(self._restore)
                return summing_skips(
                    self._restored(
                        lambda: self.build_iterator(
                            consumed_samples, micro_batch_size, dp_rank, dp_size, collate_fn, num_workers
                        )
                    ),
                    self,
                )
            if consumed_samples:
                log.warning(
                    "%s: resuming after %d samples without a loader state: energon's stream starts again "
                    "from its beginning",
                    self.name,
                    consumed_samples,
                )
            return summing_skips(iter(self.loader), self)
        self.loader = _as_ranks_need(get_loader(dataset))
        return summing_skips(_passes(self.loader, self.name) if cyclic else iter(self.loader), self)

    def _restored(self, restart):
        """The restored loader's batches; when its first draw fails with what energon raises on
        positions the dataset does not have (a state edited, checksum recomputed: IndexError in a
        worker), the stream restarts from its beginning, as for any unusable state."""
        batches = iter(self.loader)
        try:
            first = next(batches)
        except DataError:
            raise
        except (IndexError, KeyError, ValueError, TypeError, AssertionError) as err:
            log.warning(
                "%s: the saved loader state does not fit this dataset (%s: %s); the stream restarts from its beginning",
                self.name,
                type(err).__name__,
                str(err).splitlines()[0] if str(err) else "",
            )
            self._restore = None
            batches = restart()
            first = next(batches)
        yield first
        yield from batches


def _as_ranks_need(loader):
    """energon's loader, whose workers also exit when their rank is killed (``loader.exit_with_parent``)
    and which draws nothing from torch's global generator: torch's DataLoader draws its workers' base
    seed from it when an iterator starts (energon seeds its workers itself), and a resumed run builds
    its iterators after megatron restored that generator, so its dropout would drift from the
    straight run's (``loader.build_iterator`` gives torch's loaders a generator of their own too)."""
    import torch

    loader.generator = torch.Generator().manual_seed(0)
    if loader.num_workers:
        loader.worker_init_fn = functools.partial(_init_worker, loader.worker_init_fn)
    return loader


def _init_worker(energon_init, worker_id: int) -> None:
    exit_with_parent()
    if energon_init is not None:
        energon_init(worker_id)


def _passes(loader, name: str):
    """Pass after pass over a finite loader (evaluation draws as many batches as it is asked for)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise DataError(
                f"{name}: this data-parallel rank's share of the split is empty; fewer shards or samples than ranks"
            )


def energon_sizes(
    shuffle_buffer_size: int | None, max_samples_per_sequence: int | None, packing_buffer_size: int | None
) -> tuple[int, int, int]:
    """The ``--energon-*`` sizes, None replaced by this module's defaults; a ``DataError`` naming the
    flag for one below 1 (cheap: checked before launch too)."""
    sizes = []
    for name, value, default in (
        ("shuffle-buffer-size", shuffle_buffer_size, DEFAULT_SHUFFLE_BUFFER),
        ("max-samples-per-sequence", max_samples_per_sequence, DEFAULT_MAX_SAMPLES_PER_SEQUENCE),
        ("packing-buffer-size", packing_buffer_size, DEFAULT_PACKING_BUFFER),
    ):
        if value is not None and value < 1:
            raise DataError(f"--energon-{name} {value}: must be a positive integer")
        sizes.append(default if value is None else value)
    shuffle, per_sequence, packing = sizes
    return shuffle, per_sequence, packing


def build_datasets(
    seq_length: int,
    num_samples: tuple[int, int, int],
    data_path: str | None = None,
    hf_processor_path: str | None = None,
    seed: int = 0,
    strict_data: bool = False,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    energon_shuffle_buffer_size: int | None = None,
    energon_max_samples_per_sequence: int | None = None,
    energon_packing_buffer_size: int | None = None,
    **options,
):
    """(train, valid, test) ``EnergonSplit``s of ``data_path``'s "train", "val" and "test" split
    parts; None for a split it does not hold or no samples asked for. The ``energon_*`` sizes
    (None: this module's defaults) must be positive."""
    from .jsonl import JsonlConversations
    from .jsonl_media import media_settings
    from .processor import load_processor

    path = check_energon_path(data_path)
    sizes = energon_sizes(energon_shuffle_buffer_size, energon_max_samples_per_sequence, energon_packing_buffer_size)
    splits = available_splits(path)
    if "train" not in splits:
        raise DataError(f"--data-path {path!r}: no shard in its train split")
    processor, info = load_processor(hf_processor_path, min_pixels, max_pixels)
    sizing, videos = media_settings(processor, info, min_pixels, max_pixels, options)
    patch_budget = PatchBudget.from_options(options)
    out = []
    for split, n in zip(SPLIT_PARTS, num_samples):
        if not n or split not in splits:
            out.append(None)
            continue
        source = f"--data-path {path!r} [{split}]"
        produce = JsonlConversations(
            None,
            processor,
            info,
            sizing,
            seq_length,
            source,
            strict=strict_data,
            videos=videos,
            patch_budget=patch_budget,
        )
        out.append(_energon_split(path, split, produce, info, seq_length, seed, sizes, patch_budget))
    return tuple(out)


def _energon_split(
    path: str,
    split: str,
    produce,
    info,
    seq_length: int,
    seed: int,
    sizes: tuple[int, int, int],
    patch_budget: PatchBudget,
) -> EnergonSplit:
    """The ``EnergonSplit`` of one split part; ``sizes`` as ``energon_sizes`` gives them."""
    return EnergonSplit(
        path,
        split,
        produce,
        info.tokens,
        seq_length,
        info.patch_dim,
        seed,
        *sizes[:2],
        f"energon[{split}]",
        packing_buffer_size=sizes[2],
        max_patches=patch_budget.per_micro_batch,
    )
