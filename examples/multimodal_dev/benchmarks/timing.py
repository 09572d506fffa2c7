"""Timing for the side-by-side benchmarks: every contender runs once to warm up, then they take
turns (a, b, c, a, b, c, ...) so a slow spell of a shared machine hits all of them alike; the
median of each one's repetitions is reported."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable


def alternating_medians(
    contenders: dict[str, Callable[[], Any]], reps: int, progress: bool = False, warm_up: bool = True
) -> tuple[dict[str, float], dict[str, Any]]:
    """({name: median seconds}, {name: output of its warm-up call, or of its first timed one where the
    caller warmed them up itself})."""
    if reps < 1:
        raise ValueError(f"--reps {reps}: need at least one timed repetition")
    outputs = {name: fn() for name, fn in contenders.items()} if warm_up else {}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for rep in range(reps):
        for name, fn in contenders.items():
            start = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - start)
            outputs.setdefault(name, out)
        if progress:
            print(
                f"  repetition {rep + 1}/{reps}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()),
                file=sys.stderr,
                flush=True,
            )
    return {name: statistics.median(t) for name, t in times.items()}, outputs
