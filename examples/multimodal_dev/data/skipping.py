"""A map-style dataset that replaces unusable samples instead of crashing or corrupting a batch.

A provider implements ``produce(index) -> sample`` and raises ``BadSample`` for anything that
cannot be trained on. ``SkippingDataset[i]`` then tries ``i+1, i+2, ...`` (deterministically,
so resumed runs see the same samples, wrapping at the end), tells of the skips (the rule below), and
validates every sample it returns against the contract; one over a vision patch budget
(``patch_budget.py``) is a skip too.

One rule for every provider's skips (``SkipLog``; energon's encoder follows it too): a skip's own
line is printed the first ``LINES_PER_REASON`` times per reason in a process, later ones are only
counted; ``MAX_SKIPS_IN_A_ROW`` skips in a row (or every row of a smaller split) stop the run in one
line giving the count per reason: a dataset where nothing is usable ends, rather than skipping
forever.

Skip counts: each DataLoader worker holds its own copy of the dataset, so ``skip_counts`` is
this process's count only. ``new_skips()`` hands over what this process skipped since it was
last asked (the loader puts it in the collated batch), and the main process sums those into
``run_skip_counts`` (``add_run_skips``), the figure the log reports.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from torch.utils.data import Dataset

from .patch_budget import NO_BUDGET, PatchBudget
from .sample import VISION_KINDS, BadSample, DataError, VisionTokens, fit_to_budget, validate_sample

log = logging.getLogger(__name__)


# High enough that a run of bad records (a folder of missing images, an energon shard read whole)
# is skipped; low enough that a dataset with nothing usable stops within seconds to minutes
MAX_SKIPS_IN_A_ROW = 1000
LINES_PER_REASON = 3


def format_counts(counts) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))


class SkipLog:
    """A process's skips by reason (``counts``), each reason's first few told in a line, and the
    skips since the last usable sample (``in_a_row``), which stop the run at ``MAX_SKIPS_IN_A_ROW``."""

    def __init__(self, name: str, source: str | None = None):
        self.name, self.source = name, source
        self.counts: Counter = Counter()
        self.in_a_row: Counter = Counter()

    def skipped(self, bad: BadSample, what: str, count: bool = True) -> None:
        """``what`` was skipped for ``bad``; ``count=False``: a look that is not training (no line)."""
        self.in_a_row[bad.reason] += 1
        if count:
            self.counts[bad.reason] += 1
            told = self.counts[bad.reason]
            if told <= LINES_PER_REASON:
                later = f"; later {bad.reason} skips are counted, not printed" if told == LINES_PER_REASON else ""
                log.warning("%s: skipped %s (%s)%s", self.name, what, bad, later)
        if sum(self.in_a_row.values()) >= MAX_SKIPS_IN_A_ROW:
            self.stop(f"{MAX_SKIPS_IN_A_ROW} samples in a row of {self.name} were skipped")

    def usable(self) -> None:
        self.in_a_row.clear()

    def stop(self, what: str):
        """``DataError``: ``what`` happened, with the count per reason since the last usable sample."""
        where = f"{self.source}: " if self.source else ""
        counts = format_counts(self.in_a_row)
        self.in_a_row.clear()
        raise DataError(f"{where}{what} ({counts}); check the data and --seq-length")


class RunSkipTotals:
    """The run's skip total per reason, summed in the main process from the batches' deltas
    (``loader.summing_skips``) and logged: shared by every provider that skips."""

    name: str
    run_skip_counts: Counter

    def add_run_skips(self, delta: dict) -> None:
        """Add one batch's delta to the run's total and log the total (main process)."""
        if not delta:
            return
        self.run_skip_counts.update(delta)
        log.warning(
            "%s: %d samples skipped so far in this run (all workers): %s",
            self.name,
            sum(self.run_skip_counts.values()),
            format_counts(self.run_skip_counts),
        )


class SkippingDataset(RunSkipTotals, Dataset):
    def __init__(
        self,
        produce,
        num_source: int,
        length: int,
        tokens: VisionTokens,
        max_length: int,
        patch_dim: int | None = None,
        name: str = "dataset",
        source: str | None = None,
        patch_budget: PatchBudget = NO_BUDGET,
    ):
        if num_source <= 0:
            raise ValueError(f"{name}: the source has no samples")
        self.produce, self.num_source, self.length = produce, num_source, length
        self.tokens, self.max_length, self.patch_dim = tokens, max_length, patch_dim
        self.name = name
        self.source = source  # the flag and value the rows come from, for the user's error line
        self.patch_budget = patch_budget  # token-budget packing closes its rows under it too (plan_factory)
        self.skips = SkipLog(name, source)
        self.skip_counts: Counter = self.skips.counts  # skipped in this process
        self._handed_over: Counter = Counter()  # the part of skip_counts new_skips() returned
        self.run_skip_counts: Counter = Counter()  # the run's total, summed in the main process

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        return self._first_usable(index, self.produce, count=True)

    def prompt(self, index: int) -> tuple[dict, str | None]:
        """Source record ``index`` as a generation prompt and its reference answer, from the provider's
        ``prompt`` (``AttributeError`` where it has none): evaluation by generation reads these."""
        return self.produce.prompt(index % self.num_source)

    def describe(self, index: int, skip: bool = True) -> tuple[int, list]:
        """(tokens, vision grids: images, then videos) of ``self[index]``, through the same skips
        and truncation, from the provider's ``describe`` when it has one (no pixels), else from
        the sample itself. ``skip=False``: source row ``index`` itself, or its ``BadSample``."""
        produce = getattr(self.produce, "describe", self.produce)
        sample = self._first_usable(index, produce, count=False) if skip else self._usable(produce, index)
        return sample["input_ids"].numel(), [g for _, _, grids in VISION_KINDS for g in sample[grids].tolist()]

    def new_skips(self) -> dict:
        """What this process skipped since the last call (a worker's delta for the main process)."""
        delta = self.skip_counts - self._handed_over
        self._handed_over = Counter(self.skip_counts)
        return dict(delta)

    def _usable(self, produce, source_index: int) -> Any:
        return self._checked(produce(source_index))

    def _checked(self, sample: Any) -> Any:
        """``sample`` truncated, validated and within the patch budgets (a subclass's item may be
        several samples: ``preferences.PairDataset``'s pairs)."""
        sample = fit_to_budget(sample, self.tokens, self.max_length)
        return self.patch_budget.check_sample(validate_sample(sample, self.tokens, self.patch_dim))

    def _first_usable(self, index: int, produce, count: bool) -> dict:
        skips = self.skips if count else SkipLog(self.name, self.source)  # describe() counts nothing
        for attempt in range(self.num_source):
            source_index = (index + attempt) % self.num_source
            try:
                sample = self._usable(produce, source_index)
            except BadSample as bad:
                skips.skipped(bad, f"sample {source_index}", count)
                continue
            skips.usable()
            return sample
        # tried every row once: trying again cannot help
        skips.stop(f"every one of the {self.num_source} rows of {self.name} was skipped")
