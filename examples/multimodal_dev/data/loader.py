"""Data iterators over contract datasets: megatron's pretraining sampler (so a resumed run
continues at ``consumed_samples`` exactly) plus the THD/BSHD collate.

megatron.training's default loader stacks samples with torch's default collate, which cannot
hold variable-length conversations; the playground therefore hands megatron.training
ready-made iterators (``--dataloader-type external``) on every host.

A split without data gives no iterator (None); the training script turns evaluation off when
that is the validation split (``dataset_provider.datasets_provider``).
"""

from __future__ import annotations

import itertools

import torch
from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

from .batch import PackedBatch, PromptBatch
from .sample import DataError
from .token_budget import TokenBudgetSampler

SKIPS_KEY = "skipped"  # a plain collate's batch["stats"][SKIPS_KEY]: a worker's new skip counts


def hand_over_skips(batch, delta: dict) -> bool:
    """Put a worker's new skip counts on ``batch``'s stats: ``PackedBatch.stats.skipped``, or for a
    collate of plain dicts (the tests') its ``"stats"`` dict. False: the batch has no stats to
    carry them."""
    if isinstance(batch, PromptBatch):
        batch.skipped = delta
        return True
    if isinstance(batch, PackedBatch):
        if batch.stats is None:
            return False
        batch.stats.skipped = delta
        return True
    stats = batch.get("stats") if isinstance(batch, dict) else None
    if isinstance(stats, dict):
        stats[SKIPS_KEY] = delta
    return isinstance(stats, dict)


def take_skips(batch) -> dict | None:
    """The skip counts ``hand_over_skips`` put on ``batch``, taken off it (None: there are none)."""
    if isinstance(batch, PromptBatch):
        delta, batch.skipped = batch.skipped, None
        return delta
    if isinstance(batch, PackedBatch):
        delta = batch.stats.skipped if batch.stats is not None else None
        if delta is not None:
            batch.stats.skipped = None
        return delta
    stats = batch.get("stats") if isinstance(batch, dict) else None
    return stats.pop(SKIPS_KEY) if isinstance(stats, dict) and SKIPS_KEY in stats else None


def build_iterator(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    collate_fn,
    num_workers: int = 0,
    cyclic: bool = False,
    plan_fn=None,
):
    """Micro-batches for this data-parallel rank, starting after ``consumed_samples``.
    ``plan_fn(dataset, cyclic)``: a ``TokenBudgetPlan`` whose rows are the micro-batches
    (token-budget packing; ``consumed_samples`` then counts rows). ``cyclic`` marks the
    validation split (evaluation passes keep drawing, wrapping around it)."""
    if dataset is None:
        return None
    if hasattr(dataset, "build_iterator"):  # a stream that shards by rank itself (energon.py's EnergonSplit)
        return dataset.build_iterator(
            consumed_samples, micro_batch_size, dp_rank, dp_size, collate_fn, num_workers, cyclic, plan_fn
        )
    if len(dataset) == 0:
        return None
    # Every DataLoader iterator draws its base seed from a generator; without one of its own that is
    # torch's global generator, after megatron has restored it from the checkpoint, so a resumed
    # run's dropout would differ from the straight run's. A fixed generator per loader draws nothing
    # from the global one and gives workers the same seeds in both runs.
    loader_options = dict(
        collate_fn=_CollateWithSkips(collate_fn, dataset),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),
        generator=torch.Generator().manual_seed(0),
        worker_init_fn=exit_with_parent if num_workers > 0 else None,
    )
    if plan_fn is not None:
        sampler = TokenBudgetSampler(plan_fn(dataset, cyclic), consumed_samples, dp_rank)
        return summing_skips(torch.utils.data.DataLoader(dataset, batch_sampler=sampler, **loader_options), dataset)
    if len(dataset) < micro_batch_size * dp_size:
        raise ValueError(
            f"a split of {len(dataset)} samples cannot fill one micro-batch of {micro_batch_size} "
            f"on each of {dp_size} data-parallel ranks"
        )

    def one_pass(consumed):
        sampler = MegatronPretrainingSampler(
            total_samples=len(dataset),
            consumed_samples=consumed,
            micro_batch_size=micro_batch_size,
            data_parallel_rank=dp_rank,
            data_parallel_size=dp_size,
        )
        return iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler, **loader_options))

    if not cyclic:
        return summing_skips(one_pass(consumed_samples), dataset)
    first = one_pass(consumed_samples % len(dataset))
    return summing_skips(
        itertools.chain(first, itertools.chain.from_iterable(one_pass(0) for _ in itertools.count())), dataset
    )


def exit_with_parent(worker_id: int = 0) -> None:
    """A DataLoader worker dies with the rank that forked it (``lifetime.py``). torch's
    workers notice a dead parent only while they wait for work; a rank killed with SIGKILL left a
    worker (a copy of the rank's memory, ~760 MB for tiny) and multiprocessing's resource tracker
    running. A rank killed while the worker was still starting died before the request: the worker,
    by then a child of init, ends itself."""
    import multiprocessing

    from ..lifetime import die_with_parent

    parent = multiprocessing.parent_process()
    die_with_parent(parent.pid if parent is not None else None)


class _CollateWithSkips:
    """The collate, plus what the dataset skipped in this process (a DataLoader worker holds its
    own copy of the dataset and its counts) since the last batch, on the batch's stats."""

    def __init__(self, collate_fn, dataset):
        self.collate_fn, self.dataset = collate_fn, dataset

    def __call__(self, samples):
        batch = self.collate_fn(samples)
        if hasattr(self.dataset, "new_skips"):
            hand_over_skips(batch, self.dataset.new_skips())
        return batch


def summing_skips(batches, dataset):
    """``batches`` with each batch's skip counts taken out and summed into the run's total
    (main process); a data error raised in a worker comes out as its own one line."""
    batches = iter(batches)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except DataError as err:  # torch re-raises a worker's error with its traceback in the message
            raise DataError(_original_line(str(err))) from None
        delta = take_skips(batch)
        if delta is not None and hasattr(dataset, "add_run_skips"):
            dataset.add_run_skips(delta)
        yield batch


def _original_line(message: str) -> str:
    """The error's own line from torch's "Caught X in DataLoader worker ... Original Traceback"."""
    if "\n" not in message:
        return message
    last = message.rstrip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last
