"""A map-style dataset that replaces unusable samples instead of crashing or corrupting a batch.

A provider implements ``produce(index) -> sample`` and raises ``BadSample`` for anything that
cannot be trained on. ``SkippingDataset[i]`` then tries ``i+1, i+2, ...`` (deterministically,
so resumed runs see the same samples, wrapping at the end), logs a warning per skipped sample, and
validates every sample it returns against the contract; one over a vision patch budget
(``patch_budget.py``) is a skip too. However long a run of bad rows, the next usable row is found:
only a split whose every row is unusable stops the run, in one line giving the count per reason.

Skip counts: each DataLoader worker holds its own copy of the dataset, so ``skip_counts`` is
this process's count only. ``new_skips()`` hands over what this process skipped since it was
last asked (the loader puts it in the collated batch), and the main process sums those into
``run_skip_counts`` (``add_run_skips``), the figure the log reports.
"""

from __future__ import annotations

import logging
from collections import Counter

from torch.utils.data import Dataset

from .patch_budget import NO_BUDGET, PatchBudget
from .sample import VISION_KINDS, BadSample, DataError, VisionTokens, fit_to_budget, validate_sample

log = logging.getLogger(__name__)


def format_counts(counts) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))


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
        self.skip_counts: Counter = Counter()  # skipped in this process
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

    def _usable(self, produce, source_index: int) -> dict:
        sample = fit_to_budget(produce(source_index), self.tokens, self.max_length)
        return self.patch_budget.check_sample(validate_sample(sample, self.tokens, self.patch_dim))

    def _first_usable(self, index: int, produce, count: bool) -> dict:
        reasons: Counter = Counter()
        for attempt in range(self.num_source):
            source_index = (index + attempt) % self.num_source
            try:
                return self._usable(produce, source_index)
            except BadSample as bad:
                reasons[bad.reason] += 1
                if count:
                    self.skip_counts[bad.reason] += 1
                    # A worker knows only its own count; the run's total is logged by add_run_skips.
                    log.warning(
                        "%s: skipped sample %d (%s); skipped so far in this process: %s",
                        self.name,
                        source_index,
                        bad,
                        format_counts(self.skip_counts),
                    )
        where = f"{self.source}: " if self.source else ""  # tried every row once: trying again cannot help
        raise DataError(
            f"{where}every one of the {self.num_source} rows of {self.name} was skipped "
            f"({format_counts(reasons)}); check the data and --seq-length"
        )
