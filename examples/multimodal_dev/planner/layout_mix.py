"""The data a layout is planned for: packed rows of a conversation mix, each row's real sample
lengths and vision grids, and what the slowest data-parallel rank costs against the mean.

A row is what one micro-batch of ``--packing tokens`` holds: conversations first-fit into rows of
``seq_len`` tokens (``token_budget.first_fit_rows``), MBS rows a micro-batch. By default the mix
is ``mock_mix``'s profile (the length / image shape of a real SFT set); ``from_dataset`` takes
a dataset's ``describe()`` instead (real token counts and grids, nothing decoded).

The step waits for the slowest DP rank. Rows are dealt to ranks by FLOPs
(``token_budget.deal_rows``, the loader's own policy), so the imbalance is what is left after
that dealing: ``imbalance(dp, rows_per_rank)`` simulates it over a few steps of this mix.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..data.token_budget import deal_rows, first_fit_rows
from ..models import model_of

DRAW = 4096  # conversations drawn for the mix's rows (a few hundred rows of 4k tokens)
TEMPLATE = 10  # chat-template tokens of a mock conversation (``mock.MockConversations``)


@dataclass(frozen=True)
class Row:
    lengths: tuple[int, ...]  # tokens of each packed conversation
    grids: tuple[tuple[int, ...], ...]  # (t, h, w) patches of each image / video frame group

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


class Mix:
    def __init__(self, shape, seq_len: int, rows: list[Row], name: str):
        if not rows:
            raise ValueError(f"data mix {name}: no rows of {seq_len} tokens")
        self.shape, self.seq_len, self.rows, self.name = shape, seq_len, rows, name
        flops = model_of(shape).micro_batch_flops
        self.flops = np.array([flops(shape, r.lengths, r.grids).training for r in rows])
        self._imbalance = lru_cache(maxsize=None)(self._simulate)

    @classmethod
    def from_documents(cls, shape, seq_len: int, docs, name: str = "dataset") -> Mix:
        """Rows of conversations given as (tokens, [(t, h, w) grid of each image / video]): what a
        dataset's ``describe(index)`` returns (``SkippingDataset.describe``). A conversation longer
        than ``seq_len`` is cut to it, as the loader's length limit does."""
        docs = [(min(int(n), seq_len), tuple(tuple(int(x) for x in g) for g in grids)) for n, grids in docs]
        rows = [
            Row(tuple(docs[i][0] for i in row), tuple(g for i in row for g in docs[i][1]))
            for row in first_fit_rows([n for n, _ in docs], seq_len)
        ]
        # the last rows of a first-fit pass hold the leftovers; a long-running loader fills them
        full = [r for r in rows if r.tokens >= 0.9 * seq_len] or rows
        return cls(shape, seq_len, full, name)

    @classmethod
    def mock_mix(cls, shape, seq_len: int, seed: int = 1234, draw: int = DRAW) -> Mix:
        """Conversations drawn from ``mock_mix``'s profile as ``MockConversations`` lays them out
        (template tokens, each image as its merged patches between two vision markers, prompt and
        answer), counted without building the token ids."""
        import torch

        from ..data.mock_mix import RealisticProfile

        profile, merge = RealisticProfile(), shape.vision.spatial_merge_size
        gen = torch.Generator().manual_seed(seed)
        docs = []
        for _ in range(draw):
            grids = [(1, *profile.grid(gen, merge)) for _ in range(profile.n_images(gen))]
            vision = sum(h * w // merge**2 + 2 for _, h, w in grids)
            prompt, answer = profile.text_lengths(gen, seq_len - vision - TEMPLATE)
            docs.append((TEMPLATE + vision + prompt + answer, grids))
        return cls.from_documents(shape, seq_len, docs, "mock_mix")

    @classmethod
    def from_dataset(cls, shape, seq_len: int, dataset, name: str, limit: int = 512) -> Mix:
        """The first ``limit`` conversations of a dataset with ``describe`` (ids and grids, no
        pixels; about 70 ms a conversation with images, so a few hundred): each source record once
        (``num_source``; the dataset's length repeats them over epochs). Records training would skip
        are left out and counted in the name; ``DataError`` when none is usable."""
        from ..data.sample import BadSample, DataError  # torch: only when a dataset is read
        from ..data.skipping import format_counts

        n = min(getattr(dataset, "num_source", len(dataset)), len(dataset), limit)
        documents, skipped = [], Counter()
        for i in range(n):
            try:
                documents.append(dataset.describe(i, skip=False))
            except BadSample as bad:
                skipped[bad.reason] += 1
        if not documents:
            raise DataError(f"{name}: none of the {n} conversations read would train ({format_counts(skipped)})")
        if skipped:
            name = f"{name} ({len(documents)} of {n} conversations; skipped {format_counts(skipped)})"
        return cls.from_documents(shape, seq_len, iter(documents), name)

    @property
    def mean_row(self) -> Row:
        """The row whose FLOPs are the median: what one micro-batch is costed with."""
        return self.rows[int(np.argsort(self.flops)[len(self.flops) // 2])]

    def vision_share(self) -> float:
        parts = [model_of(self.shape).micro_batch_flops(self.shape, r.lengths, r.grids) for r in self.rows]
        return sum(p.vision for p in parts) / sum(p.forward for p in parts)

    def imbalance(self, dp: int, rows_per_rank: int) -> float:
        """Mean over simulated steps of (slowest DP rank's FLOPs) / (mean rank's FLOPs)."""
        return self._imbalance(dp, rows_per_rank)

    def _simulate(self, dp: int, rows_per_rank: int, steps: int = 4) -> float:
        if dp == 1:
            return 1.0
        rng = np.random.default_rng(0)
        ratios = []
        for _ in range(steps):
            costs = self.flops[rng.integers(0, len(self.flops), dp * rows_per_rank)]
            if dp * rows_per_rank <= 512:  # the loader's dealing (greedy + swaps) is quadratic
                loads = [costs[g].sum() for g in deal_rows(costs.tolist(), dp)]
            else:  # greedy largest-first onto the least loaded rank, with room
                loads = np.zeros(dp)
                room = np.full(dp, rows_per_rank)
                for c in np.sort(costs)[::-1]:
                    r = int(np.argmin(np.where(room > 0, loads, np.inf)))
                    loads[r] += c
                    room[r] -= 1
            ratios.append(max(loads) / (sum(loads) / dp))
        return float(np.mean(ratios))
