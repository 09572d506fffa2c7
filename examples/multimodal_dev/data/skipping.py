"""A map-style dataset that replaces unusable samples instead of crashing or corrupting a batch.

A provider implements ``produce(index) -> sample`` and raises ``BadSample`` for anything that
cannot be trained on. ``SkippingDataset[i]`` then tries ``i+1, i+2, ...`` (deterministically,
so resumed runs see the same samples), logs a warning with the running count per reason, and
validates every sample it returns against the contract.
"""

from __future__ import annotations

import logging
from collections import Counter

from torch.utils.data import Dataset

from .sample import VISION_KINDS, BadSample, VisionTokens, fit_to_budget, validate_sample

log = logging.getLogger(__name__)


class SkippingDataset(Dataset):
    def __init__(self, produce, num_source: int, length: int, tokens: VisionTokens, max_length: int,
                 patch_dim: int | None = None, max_consecutive_skips: int = 64, name: str = "dataset"):
        if num_source <= 0:
            raise ValueError(f"{name}: the source has no samples")
        self.produce, self.num_source, self.length = produce, num_source, length
        self.tokens, self.max_length, self.patch_dim = tokens, max_length, patch_dim
        self.max_consecutive_skips, self.name = max_consecutive_skips, name
        self.skip_counts: Counter = Counter()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        return self._first_usable(index, self.produce, count=True)

    def describe(self, index: int) -> tuple[int, list]:
        """(tokens, vision grids: images, then videos) of ``self[index]``, through the same skips
        and truncation, from the provider's ``describe`` when it has one (no pixels), else from
        the sample itself."""
        sample = self._first_usable(index, getattr(self.produce, "describe", self.produce), count=False)
        return sample["input_ids"].numel(), [g for _, _, grids in VISION_KINDS for g in sample[grids].tolist()]

    def _first_usable(self, index: int, produce, count: bool) -> dict:
        for attempt in range(self.max_consecutive_skips):
            source_index = (index + attempt) % self.num_source
            try:
                sample = fit_to_budget(produce(source_index), self.tokens, self.max_length)
                return validate_sample(sample, self.tokens, self.patch_dim)
            except BadSample as bad:
                if not count:
                    continue
                self.skip_counts[bad.reason] += 1
                counts = ", ".join(f"{k}={v}" for k, v in sorted(self.skip_counts.items()))
                log.warning("%s: skipped sample %d (%s); skipped so far: %s", self.name, source_index, bad, counts)
        raise RuntimeError(f"{self.name}: {self.max_consecutive_skips} consecutive samples from index {index} were "
                           f"unusable ({dict(self.skip_counts)}); check --data-path and --seq-length")
