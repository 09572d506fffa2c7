"""Progress of long work (a checkpoint tool over hundreds of GB): tensors and bytes done, rate, time left.

On a terminal it is tqdm's bar, one line redrawn in place. Anywhere else (a log file, a pipe, a batch
job's output) redrawing would leave a line per update, so a plain line is written every
``interval_s`` (30 s) and once at the end: work shorter than that says nothing beyond its result.
Lines go to stderr; a tool's result line stays alone on stdout. Imports nothing of the project.
"""

from __future__ import annotations

import sys
import time

GIB = 1024**3


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


class Progress:
    """``advance(nbytes)`` after each tensor; ``close()`` (or the ``with`` block's end) at the end."""

    def __init__(self, what: str, tensors: int, total_bytes: int, stream=None, interval_s: float = 30.0, clock=None):
        self.what, self.tensors, self.total = what, tensors, total_bytes
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s, self.clock = interval_s, clock or time.monotonic
        self.done_tensors = self.done_bytes = 0
        self.start = self.last = self.clock()
        self.said = False
        self._bar = None
        if getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_bytes,
                desc=what,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=self.stream,
                leave=False,
            )

    def line(self) -> str:
        elapsed = max(self.clock() - self.start, 1e-9)
        rate = self.done_bytes / elapsed
        left = (self.total - self.done_bytes) / rate if rate > 0 else float("inf")
        share = 100 * self.done_bytes / self.total if self.total else 100.0
        eta = _duration(left) if left != float("inf") else "?"
        return (
            f"{self.what}: {self.done_tensors}/{self.tensors} tensors, {self.done_bytes / GIB:.2f}/"
            f"{self.total / GIB:.2f} GiB ({share:.0f}%), {rate / 1024**2:.0f} MiB/s, {eta} left"
        )

    def advance(self, nbytes: int, tensors: int = 1) -> None:
        self.done_tensors += tensors
        self.done_bytes += nbytes
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.done_tensors}/{self.tensors} tensors", refresh=False)
            self._bar.update(nbytes)
        elif self.clock() - self.last >= self.interval_s:
            self.last = self.clock()
            self.said = True
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.said:  # the last line says it finished, and how long it took
            took = _duration(self.clock() - self.start)
            print(f"{self.line().rsplit(',', 1)[0]}, done in {took}", file=self.stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
