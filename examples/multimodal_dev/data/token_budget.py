"""Token-budget packing (``--packing tokens``): every micro-batch is one THD row of at most
``budget`` tokens, and the rows of a step are dealt to the data-parallel ranks so that their
work is equal.

The policy, and why:

- **A global batch is a fixed number of rows.** megatron.training's ``--global-batch-size``,
  ``consumed_samples``, ``--train-samples`` and a schedule in samples all count rows of
  ``budget`` tokens (a micro-batch is one row: ``--micro-batch-size 1``), so a step holds a
  near-constant number of tokens and the learning-rate schedule needs no change. The number of
  conversations a step holds varies instead.
- **Rows are filled first-fit decreasing from a look-ahead buffer.** The buffer holds the
  conversations the previous step could not place, then the next ones of the stream until it
  holds ``LOOKAHEAD`` times the step's tokens (at most ``window`` conversations). Carried-over
  conversations are placed first, so none waits more than one step in practice. A conversation
  is never split, so neither is an image; one longer than the budget gets a row to itself.
  Lengths are padded to ``pad_multiple`` (CP / SP) before they are fitted, and the collate pads
  every row to exactly ``budget`` tokens: one static shape every micro-batch. With a vision patch
  budget (``max_patches``: ``--max-vision-patches-per-micro-batch``, ``patch_budget.py``) a row also
  closes before a conversation whose patches would take it past the budget; ``describe`` gives each
  conversation's grids, so the plan knows its patches without decoding a pixel. A conversation
  over the budget on its own is skipped by the dataset and never reaches the plan.
- **Rows are dealt to ranks by cost**, the model FLOPs of their conversations (``models/qwen35_vl/flops.py``:
  attention is quadratic in a conversation's length and images cost their vision tower, so
  tokens alone do not balance): largest first to the least-loaded rank with room, then
  pairwise swaps while they lower the most-loaded rank. Each rank gets the same number of rows.
- **Exact resume.** The plan is a pure function of the dataset, the budget, the global batch
  and the data-parallel size, and what planning a step starts from is small: the stream
  position and the conversations carried over (``state``). A checkpoint stores it
  (``checkpoint/plan_state.py``) and a resumed run ``restore``s it, continuing at exactly the same
  rows without reading the conversations before it; where a checkpoint has none (or its data
  differ), the plan is replayed from the start on lengths alone (``SkippingDataset.describe``, no
  pixels). Every rank plans the whole step, so ranks agree without communicating.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .patch_budget import patches

LOOKAHEAD = 1.25  # buffer tokens per step's tokens: the slack first-fit decreasing packs from
STATES_KEPT = 16  # steps whose starting state stays available: the loader plans a few steps ahead of a save
MAX_SWAP_ROUNDS = 64
SWAP_PARTNERS = 4  # least-loaded ranks the busiest one swaps with: bounds the search at large DP


@dataclass(frozen=True)
class Item:
    index: int  # position in the dataset
    tokens: int  # padded to the per-sample multiple
    cost: float
    carried: bool = False  # already deferred once
    patches: int = 0  # vision patches (t*h*w of its grids), for the row's patch budget


def deal_rows(costs: list[float], ranks: int) -> list[list[int]]:
    """Row indices per rank, ``len(costs) // ranks`` each, with the ranks' summed costs as equal
    as greedy placement plus improving swaps make them."""
    if len(costs) % ranks:
        raise ValueError(f"{len(costs)} rows cannot be dealt evenly to {ranks} ranks")
    per_rank = len(costs) // ranks
    groups: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0.0] * ranks
    for row in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        rank = min((r for r in range(ranks) if len(groups[r]) < per_rank), key=lambda r: (loads[r], r))
        groups[rank].append(row)
        loads[rank] += costs[row]
    for _ in range(MAX_SWAP_ROUNDS):
        hi = max(range(ranks), key=lambda r: loads[r])
        best = None  # (new max of the pair, lo, a, b)
        for lo in range(ranks):
            for a in groups[hi]:
                for b in groups[lo]:
                    d = costs[a] - costs[b]
                    if d > 0 and max(loads[hi] - d, loads[lo] + d) < loads[hi] - 1e-9 * loads[hi]:
                        pair_max = max(loads[hi] - d, loads[lo] + d)
                        if best is None or pair_max < best[0]:
                            best = (pair_max, lo, a, b)
        if best is None:
            break
        _, lo, a, b = best
        groups[hi][groups[hi].index(a)], groups[lo][groups[lo].index(b)] = b, a
        loads[hi] -= costs[a] - costs[b]
        loads[lo] += costs[a] - costs[b]
    return groups


@dataclass
class Step:
    ranks: list[list[list[int]]]  # per rank, its rows in order; a row is a list of dataset indices
    filled_tokens: int  # conversations' tokens, padded to the per-sample multiple
    budget_tokens: int
    rank_costs: list[float]

    @property
    def pad_fraction(self) -> float:
        return 1.0 - self.filled_tokens / max(self.budget_tokens, 1)

    @property
    def imbalance(self) -> float:
        """max / mean of the ranks' planned costs."""
        mean = sum(self.rank_costs) / len(self.rank_costs)
        return max(self.rank_costs) / mean if mean else 1.0


class TokenBudgetPlan:
    """The rows of every step, planned in order and on demand.

    ``describe(index) -> (tokens, grids)``; ``cost(tokens, grids) -> float``; ``num_samples``:
    the stream's length (``cyclic``: it wraps around, for evaluation).
    """

    def __init__(
        self,
        describe,
        num_samples: int,
        budget: int,
        rows_per_step: int,
        dp_size: int,
        cost=None,
        pad_multiple: int = 1,
        window: int = 4096,
        cyclic: bool = False,
        max_patches: int = 0,
    ):
        if budget % pad_multiple:
            raise ValueError(
                f"--packed-seq-length {budget} must be a multiple of {pad_multiple} (2 x CP, x TP under "
                "sequence parallelism), so every padded conversation fits it exactly"
            )
        if rows_per_step % dp_size:
            raise ValueError(f"a step of {rows_per_step} rows cannot be dealt evenly to {dp_size} data-parallel ranks")
        self.describe, self.num_samples, self.budget = describe, num_samples, budget
        self.rows_per_step, self.dp_size, self.pad_multiple = rows_per_step, dp_size, pad_multiple
        self.cost = cost or (lambda tokens, grids: float(tokens))
        self.window, self.cyclic = window, cyclic
        self.max_patches = max_patches  # 0: rows are bounded by tokens only
        self._cursor = 0  # next stream position to read
        self._carried: list[Item] = []
        self._steps: dict[int, Step | None] = {}
        self._starts: dict[int, tuple[int, list[Item]]] = {}  # step -> (cursor, carried) it was planned from
        self._next_step = 0
        self.unplaced: list[int] = []

    def step(self, s: int) -> Step | None:
        """Step ``s``, or None once the stream cannot fill a whole step (the end of an epoch)."""
        if s < self._next_step - 2 and s not in self._steps:
            raise ValueError(f"step {s} was planned and dropped; plans only move forward")
        while self._next_step <= s:
            self._starts[self._next_step] = (self._cursor, list(self._carried))
            self._starts.pop(self._next_step - STATES_KEPT, None)
            self._steps[self._next_step] = self._plan_next()
            self._steps.pop(self._next_step - 3, None)  # keep a few: loaders prefetch ahead
            self._next_step += 1
        return self._steps[s]

    def settings(self) -> dict:
        """What besides the data decides the plan: a state restores only into equal settings."""
        return {
            "budget": self.budget,
            "rows_per_step": self.rows_per_step,
            "dp_size": self.dp_size,
            "pad_multiple": self.pad_multiple,
            "window": self.window,
            "num_samples": self.num_samples,
            "cyclic": self.cyclic,
            "lookahead": LOOKAHEAD,
            # only when set: a state saved before patch budgets existed still restores without one
            **({"max_patches": self.max_patches} if self.max_patches else {}),
        }

    def state(self, s: int) -> dict | None:
        """What planning step ``s`` starts from, as JSON-ready values (None: not planned yet, or
        planned too long ago)."""
        if s not in self._starts:
            return None
        cursor, carried = self._starts[s]
        return {
            "step": s,
            "cursor": cursor,
            "carried": [[i.index, i.tokens, i.cost] for i in carried],
            "settings": self.settings(),
        }

    def restore(self, state: dict) -> str | None:
        """Continue at ``state``'s step, as if every step before it had been planned here. Returns
        None, or why the state does not fit this plan (which is then left as it was)."""
        if state.get("settings") != self.settings():
            theirs, ours = state.get("settings", {}), self.settings()
            differ = sorted(k for k in {**theirs, **ours} if theirs.get(k) != ours.get(k))
            return "it was planned with other settings: " + ", ".join(differ)
        carried = [Item(index, tokens, cost, carried=True) for index, tokens, cost in state["carried"]]
        indices = [item.index for item in carried]
        if not all(isinstance(i, int) and 0 <= i < self.num_samples for i in indices) or len(set(indices)) < len(
            indices
        ):
            return f"its carried conversations {indices[:8]} are not distinct conversations of this dataset"
        cursor = state["cursor"]
        if not isinstance(cursor, int) or cursor < 0 or not self.cyclic and cursor > self.num_samples:
            return f"its stream position {state['cursor']!r} is not a position in this dataset"
        described = [self.describe(item.index) for item in carried]
        for item, (tokens, _) in zip(carried, described):  # the same data: each still has its length
            if self._padded(tokens) != item.tokens:
                return f"conversation {item.index} has another length in this dataset"
        # patches are not stored: the grids described here give them
        carried = [dataclasses.replace(item, patches=patches(grids)) for item, (_, grids) in zip(carried, described)]
        self._cursor, self._carried = state["cursor"], carried
        self._steps, self._starts, self._next_step = {}, {}, state["step"]
        return None

    def _read(self) -> Item | None:
        if not self.cyclic and self._cursor >= self.num_samples:
            return None
        index = self._cursor % self.num_samples
        self._cursor += 1
        tokens, grids = self.describe(index)
        return Item(index, self._padded(tokens), self.cost(tokens, grids), patches=patches(grids))

    def _padded(self, tokens: int) -> int:
        return -(-tokens // self.pad_multiple) * self.pad_multiple

    def _plan_next(self) -> Step | None:
        target = LOOKAHEAD * self.rows_per_step * self.budget
        fresh: list[Item] = []
        held = sum(i.tokens for i in self._carried)
        while held < target and len(self._carried) + len(fresh) < self.window:
            item = self._read()
            if item is None:
                break
            fresh.append(item)
            held += item.tokens
        order = sorted(self._carried, key=lambda i: (-i.tokens, i.index)) + sorted(
            fresh, key=lambda i: (-i.tokens, i.index)
        )
        rows: list[list[Item]] = [[] for _ in range(self.rows_per_step)]
        room = [self.budget] * self.rows_per_step
        patch_room = [self.max_patches or math.inf] * self.rows_per_step
        self._carried = []
        for item in order:  # first-fit decreasing by tokens
            needs = min(item.tokens, self.budget)  # one longer than the budget needs an empty row
            sees = min(item.patches, self.max_patches or math.inf)  # the same for patches (the dataset skips those)
            row = next((r for r in range(self.rows_per_step) if room[r] >= needs and patch_room[r] >= sees), None)
            if row is None:
                self._carried.append(item)
                continue
            rows[row].append(item)
            room[row] -= needs
            patch_room[row] -= sees
        if any(not row for row in rows):  # the stream ran out: no whole step left
            self.unplaced = sorted(i.index for i in order)  # the last, partial step: dropped, as megatron does
            return None
        dealt = deal_rows([sum(i.cost for i in row) for row in rows], self.dp_size)
        ranks = [[rows[j] for j in group] for group in dealt]
        swap_conversations(ranks, self.budget, self._carried, self.max_patches)
        self._carried = [dataclasses.replace(i, carried=True) for i in self._carried]
        return Step(
            ranks=[[[i.index for i in row] for row in rank_rows] for rank_rows in ranks],
            filled_tokens=sum(i.tokens for row in rows for i in row),
            budget_tokens=sum(max(self.budget, sum(i.tokens for i in row)) for row in rows),
            rank_costs=[sum(i.cost for row in rank_rows for i in row) for rank_rows in ranks],
        )


def first_fit_rows(
    lengths: list[int], budget: int, patch_counts: list[int] | None = None, max_patches: int = 0
) -> list[list[int]]:
    """Every index of ``lengths`` in rows of at most ``budget`` tokens, and of at most ``max_patches``
    of ``patch_counts`` when that is set, first-fit decreasing (one longer than the budget gets a row
    to itself; one over ``max_patches`` takes all of a row's, which only text may join). For streams
    packed from a buffer as they come (``energon.py``), where a fixed number of rows a step cannot be
    planned ahead."""
    rows: list[list[int]] = []
    room: list[int] = []
    patch_room: list[float] = []
    limit = max_patches or math.inf
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        needs, sees = min(lengths[i], budget), min(patch_counts[i] if patch_counts else 0, limit)
        row = next((r for r in range(len(rows)) if room[r] >= needs and patch_room[r] >= sees), None)
        if row is None:
            rows.append([])
            room.append(budget)
            patch_room.append(limit)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= needs
        patch_room[row] -= sees
    return rows


def swap_conversations(ranks: list[list[list[Item]]], budget: int, pool: list[Item], max_patches: int = 0) -> None:
    """Lower max / mean of the ranks' costs, in place, by single-conversation swaps that keep
    rows within ``budget`` (and ``max_patches`` vision patches, when set): between a row of the
    most-loaded rank and a row of one of the ``SWAP_PARTNERS`` least-loaded ranks, or with a
    conversation of ``pool`` (the carried-over buffer) that has never been carried (so nothing is
    deferred twice). Whole rows cannot balance a step where one long conversation costs a quarter
    of it; swaps can."""
    n = len(ranks)
    limit = max_patches or math.inf
    loads = [sum(i.cost for row in rank_rows for i in row) for rank_rows in ranks]
    for _ in range(MAX_SWAP_ROUNDS):
        by_load = sorted(range(n), key=lambda r: (-loads[r], r))
        hi, total = by_load[0], sum(loads)
        current, best = loads[hi] * n / total if total else 1.0, None  # best: (ratio, lo or None, row_hi, a, row_lo, b)

        def ratio_after(d: float, lo) -> float:  # max / mean once `d` moves off `hi` (onto `lo`, or out)
            others = next((loads[r] for r in by_load[1:] if r != lo), 0.0)
            top = max(loads[hi] - d, others, loads[lo] + d if lo is not None else 0.0)
            after = total - (d if lo is None else 0.0)
            return top * n / after if after else 1.0

        partners = [(lo, row) for lo in by_load[:0:-1][:SWAP_PARTNERS] for row in ranks[lo]] + [(None, pool)]
        for row_hi in ranks[hi]:
            free_hi = budget - sum(i.tokens for i in row_hi)
            patches_hi = limit - sum(i.patches for i in row_hi)
            for a in row_hi:
                for lo, row_lo in partners:
                    free_lo = budget - sum(i.tokens for i in row_lo) if lo is not None else 0
                    patches_lo = limit - sum(i.patches for i in row_lo) if lo is not None else 0
                    for b in row_lo:
                        d = a.cost - b.cost
                        if d <= 0 or b.tokens - a.tokens > free_hi or b.patches - a.patches > patches_hi:
                            continue
                        if lo is None and (b.carried or a.tokens - b.tokens > a.tokens // 8):
                            continue  # the pool: first-timers only, and no worse fill than an eighth
                        if lo is not None and (a.tokens - b.tokens > free_lo or a.patches - b.patches > patches_lo):
                            continue
                        ratio = ratio_after(d, lo)
                        if ratio < current * (1 - 1e-9) and (best is None or ratio < best[0]):
                            best = (ratio, lo, row_hi, a, row_lo, b)
        if best is None:
            return
        _, lo, row_hi, a, row_lo, b = best
        row_hi[row_hi.index(a)], row_lo[row_lo.index(b)] = b, a
        loads[hi] -= a.cost - b.cost
        if lo is not None:
            loads[lo] += a.cost - b.cost


def plan_factory(shape, budget: int, rows_per_step: int, dp_size: int, pad_multiple: int = 1, window: int = 4096):
    """``plan_fn(dataset, cyclic)`` for ``loader.build_iterator``: plans that price a
    conversation at its training FLOPs under ``shape`` (``models/qwen35_vl/flops.py``) and close
    rows under the dataset's own micro-batch patch budget (``SkippingDataset.patch_budget``), the
    one it skips conversations by, so the two cannot disagree."""
    from examples.multimodal_dev.models import model_of

    micro_batch_flops = model_of(shape).micro_batch_flops

    def cost(tokens: int, grids) -> float:
        return micro_batch_flops(shape, [tokens], grids).training

    return lambda dataset, cyclic: TokenBudgetPlan(
        dataset.describe,
        len(dataset),
        budget,
        rows_per_step,
        dp_size,
        cost=cost,
        pad_multiple=pad_multiple,
        window=window,
        cyclic=cyclic,
        max_patches=dataset.patch_budget.per_micro_batch,
    )


def check_packing_args(args) -> None:
    """Refuse settings token-budget packing cannot honour, by flag name (before launch)."""
    from .collate import pad_multiple_for

    if args.packing != "tokens":
        return
    if args.packed_seq_length is None:
        args.packed_seq_length = args.seq_length
    if not args.use_packed_sequence:
        raise ValueError("--packing tokens packs THD rows; it cannot be combined with --no-packed-sequence")
    if args.micro_batch_size != 1:
        raise ValueError(
            f"--micro-batch-size {args.micro_batch_size}: with --packing tokens a micro-batch is one row "
            "of --packed-seq-length tokens; use --micro-batch-size 1 (--global-batch-size counts rows)"
        )
    if getattr(args, "rampup_batch_size", None):
        raise ValueError("--rampup-batch-size: token-budget packing plans whole steps of a fixed number of rows")
    for flag, value in (("--packed-seq-length", args.packed_seq_length), ("--packing-window", args.packing_window)):
        if value < 1:
            raise ValueError(f"{flag} {value} must be a positive integer")
    multiple = pad_multiple_for(args.context_parallel_size, args.tensor_model_parallel_size, args.sequence_parallel)
    if args.packed_seq_length % multiple:
        raise ValueError(
            f"--packed-seq-length {args.packed_seq_length} must be a multiple of {multiple} (2 x CP, "
            "x TP under sequence parallelism), so every padded conversation fits it exactly"
        )


class TokenBudgetSampler:
    """A DataLoader ``batch_sampler``: this data-parallel rank's rows (lists of dataset indices),
    from the step that ``consumed_rows`` (megatron's consumed samples) starts at."""

    def __init__(self, plan: TokenBudgetPlan, consumed_rows: int, dp_rank: int):
        if consumed_rows % plan.rows_per_step:
            raise ValueError(
                f"consumed samples {consumed_rows} is not a whole number of steps of "
                f"{plan.rows_per_step} rows: token-budget packing resumes at step boundaries only"
            )
        self.plan, self.first_step, self.dp_rank = plan, consumed_rows // plan.rows_per_step, dp_rank

    def __iter__(self):
        s = self.first_step
        while (step := self.plan.step(s)) is not None:
            yield from step.ranks[self.dp_rank]
            s += 1
