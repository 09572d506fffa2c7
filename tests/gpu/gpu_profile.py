"""Where a training step's time goes, read from the torch.profiler Chrome trace that megatron writes
with ``--profile --use-pytorch-profiler`` (``torch_profile/rank-0.json.gz``). Pure functions over the
parsed JSON, so tests/gpu/test_step_profile.py checks every figure on CPU with a synthetic trace.

Every count and time is per profiled step, so the ``calls`` columns and ``ms/step`` agree.
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
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


# ---- per step: GPU busy share, launches, host syncs, CPU ops ----

LAUNCHES = re.compile(r"^cu(da)?(LaunchKernel|LaunchKernelExC|LaunchKernelEx|LaunchCooperativeKernel|GraphLaunch)")
SYNCS = {"cudaStreamSynchronize": "stream syncs", "cudaDeviceSynchronize": "device syncs"}


def _steps(events: list[dict]) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of each profiled step: the host-side ProfilerStep#N marks that
    torch.profiler's schedule writes; a trace without them is one step spanning everything."""
    marks = [
        (ev["name"], float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0)))
        for ev in events
        if ev.get("ph") == "X"
        and str(ev.get("name", "")).startswith("ProfilerStep#")
        and not str(ev.get("cat", "")).startswith("gpu_")
    ]
    if marks:
        return sorted(marks, key=lambda m: m[1])
    timed = [ev for ev in events if ev.get("ph") == "X" and "ts" in ev]
    if not timed:
        return []
    return [
        ("whole trace", min(float(e["ts"]) for e in timed), max(float(e["ts"]) + float(e.get("dur", 0)) for e in timed))
    ]


def _union_us(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of ``intervals`` clipped to [start, end]: overlapping kernels (streams) count once."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in intervals if b > start and a < end)
    total, reach = 0.0, start
    for a, b in clipped:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _self_times(ops: list[dict]) -> list[tuple[dict, float]]:
    """(op, self us): its duration less that of the ops nested directly inside it on its thread."""
    out, by_thread = [], defaultdict(list)
    for ev in ops:
        by_thread[(ev.get("pid"), ev.get("tid"))].append(ev)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        stack = []  # [op, end us, self us]
        for ev in thread:
            start, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
            while stack and stack[-1][1] <= start:
                out.append((stack[-1][0], stack.pop()[2]))
            if stack:
                stack[-1][2] -= dur
            stack.append([ev, start + dur, dur])
        out += [(op, self_us) for op, _, self_us in stack]
    return out


def _host_ts(events: list[dict]) -> dict:
    """correlation id -> host time of the runtime call that queued the GPU work (so a kernel or copy
    belongs to the step that launched it, even when it runs after the step's host side ended)."""
    return {
        ev["args"]["correlation"]: float(ev["ts"])
        for ev in _complete(events, "cuda_runtime") + _complete(events, "cuda_driver")
        if "correlation" in ev.get("args", {})
    }


def step_profile(events: list[dict], top: int = 10) -> dict:
    """Per profiled step: wall time, GPU busy share, kernel launches, host syncs, and the CPU ops with
    the most self time and the most calls (all per step). Returns {"summary", "per step", "top CPU
    ops by self time", "top CPU ops by count"}; empty tables for a trace with no events."""
    steps = _steps(events)
    launched_at = _host_ts(events)

    def step_of(ts: float) -> int | None:
        return next((i for i, (_, a, b) in enumerate(steps) if a <= ts < b), None)

    def host_step(ev: dict) -> int | None:
        return step_of(launched_at.get(ev.get("args", {}).get("correlation"), float(ev["ts"])))

    kernels = _complete(events, "kernel")
    runtime = _complete(events, "cuda_runtime") + _complete(events, "cuda_driver")
    spans = [(float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0.0))) for k in kernels]
    copies_back = [ev for ev in _complete(events, "gpu_memcpy") if "DtoH" in ev.get("name", "")]
    rows = []
    for i, (name, start, end) in enumerate(steps):
        mine = [ev for ev in runtime if step_of(float(ev["ts"])) == i]
        row = {
            "step": name,
            "wall ms": (end - start) / 1000.0,
            "GPU busy %": 100.0 * _union_us(spans, start, end) / max(end - start, 1e-9),
            "kernels": sum(1 for k in kernels if host_step(k) == i),
            "launches": sum(1 for ev in mine if LAUNCHES.match(ev["name"])),
            **{label: sum(1 for ev in mine if ev["name"] == call) for call, label in SYNCS.items()},
            "DtoH copies": sum(1 for ev in copies_back if host_step(ev) == i),
            "sync wait ms": sum(float(ev.get("dur", 0.0)) for ev in mine if ev["name"] in SYNCS) / 1000.0,
        }
        row["host syncs"] = row["stream syncs"] + row["device syncs"] + row["DtoH copies"]
        rows.append(row)
    n = max(len(rows), 1)
    wall = sum(r["wall ms"] for r in rows)
    summary = {"profiled steps": len(rows), "wall ms/step": wall / n}
    summary["GPU busy %"] = sum(r["GPU busy %"] * r["wall ms"] for r in rows) / wall if wall else 0.0
    for key in ("kernels", "launches", "host syncs", "stream syncs", "device syncs", "DtoH copies", "sync wait ms"):
        summary[f"{key}/step"] = sum(r[key] for r in rows) / n
    ops = [
        ev
        for ev in _complete(events, "cpu_op")
        if not ev.get("name", "").startswith("ProfilerStep#") and step_of(float(ev["ts"])) is not None
    ]
    self_us, calls = defaultdict(float), defaultdict(int)
    for op, us in _self_times(ops):
        self_us[op["name"]] += us
        calls[op["name"]] += 1

    def table(key) -> list[dict]:
        ranked = sorted(calls, key=lambda name: (-key(name), name))[:top]
        return [
            {"op": name[:80], "calls/step": calls[name] / n, "self ms/step": self_us[name] / 1000.0 / n}
            for name in ranked
        ]

    return {
        "summary": summary,
        "per step": rows,
        "top CPU ops by self time": table(lambda name: self_us[name]),
        "top CPU ops by count": table(lambda name: calls[name]),
    }


# ---- megatron's timers (--timing-log-level 2), from the run's log ----

TIMER = re.compile(r"^\s+([A-Za-z][\w\-/ ]*?) \.+: \(([0-9.]+), ([0-9.]+)\)\s*$")
ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|")


def parse_timers(text: str) -> dict:
    """{iteration: {timer: ms}} from megatron's "(min, max) time across ranks (ms):" blocks, each read
    as the max over ranks; a block belongs to the iteration line printed before it."""
    out, current = defaultdict(dict), None
    for line in text.splitlines():
        m = ITERATION.search(line)
        if m:
            current = int(m.group(1))
            continue
        m = TIMER.match(line)
        if m and current is not None:
            out[current][m.group(1)] = float(m.group(3))
    return dict(out)


def timer_table(timers: dict, first: int, last: int) -> list[dict]:
    """Each timer's median over iterations first..last (ms per iteration: megatron divides by the log
    interval), slowest first."""
    values = defaultdict(list)
    for iteration, named in timers.items():
        if first <= iteration <= last:
            for name, ms in named.items():
                values[name].append(ms)
    rows = [{"timer": name, "median ms": statistics.median(v), "iterations": len(v)} for name, v in values.items()]
    return sorted(rows, key=lambda r: -r["median ms"])
