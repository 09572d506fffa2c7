"""Error and time measures shared by the GPU kernel checks (CUDA events; no GPU needed to import)."""

from __future__ import annotations

import statistics


def errors(candidates, references: dict) -> dict:
    """Worst tensor's max |diff| / max |ref| and RMS(diff) / RMS(ref), and which tensor it was
    (``candidates`` in the order of ``references``: name -> reference tensor)."""
    worst = {"rel": 0.0, "rms": 0.0, "worst": ""}
    for name, c, r in zip(references, candidates, references.values()):
        diff = c.float() - r.float()
        rel = (diff.abs().max() / r.abs().max().clamp_min(1e-30)).item()
        rms = (diff.pow(2).mean().sqrt() / r.float().pow(2).mean().sqrt().clamp_min(1e-30)).item()
        if rel >= worst["rel"]:
            worst["worst"] = name
        worst["rel"], worst["rms"] = max(worst["rel"], rel), max(worst["rms"], rms)
    return worst


def median_ms(fn, reps: int = 10, warmup: int = 2, device: str = "cuda") -> float:
    """Median time of ``fn()`` in milliseconds, after ``warmup`` untimed calls: GPU time between CUDA
    events, or on ``device="cpu"`` the wall clock (a check's CPU variant times the same code)."""
    import time

    import torch

    for _ in range(warmup):
        fn()
    if device == "cpu":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
