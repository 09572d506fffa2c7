"""Where a training step's time goes, read from the torch.profiler Chrome trace that megatron writes
with ``--profile --use-pytorch-profiler`` (``torch_profile/rank-0.json.gz``). Pure functions over the
parsed JSON, so tests/gpu/test_step_profile.py checks every figure on CPU with a synthetic trace.

Every count and time is per profiled step, so the ``calls`` columns and ``ms/step`` agree.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict


def load_trace(path: str) -> list[dict]:
    """The trace's events (a dict with ``traceEvents``, or a bare list), gzip or not."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def _complete(events: list[dict], category: str) -> list[dict]:
    return [ev for ev in events if ev.get("ph") == "X" and str(ev.get("cat", "")).lower() == category]


def top_kernels(events: list[dict], steps: int, n: int = 10) -> list[dict]:
    """GPU kernels by total time: [{kernel, calls/step, ms/step, share %}] over ``steps`` profiled steps."""
    total_us, calls = defaultdict(float), defaultdict(int)
    for ev in _complete(events, "kernel"):
        total_us[ev.get("name", "?")] += float(ev.get("dur", 0.0))
        calls[ev.get("name", "?")] += 1
    grand, steps = sum(total_us.values()) or 1.0, max(steps, 1)
    ranked = sorted(total_us.items(), key=lambda kv: -kv[1])[:n]
    return [
        {
            "kernel": name[:100],
            "calls/step": calls[name] / steps,
            "ms/step": us / 1000.0 / steps,
            "share %": 100.0 * us / grand,
        }
        for name, us in ranked
    ]
