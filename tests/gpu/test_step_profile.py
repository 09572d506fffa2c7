"""CPU checks of where-the-step's-time-goes (tests/gpu/gpu_profile.py): a synthetic torch.profiler
trace of two steps with every figure worked out by hand, and megatron's timer lines. Not marked gpu:
they run in the normal suite, in well under a second."""

import gpu_profile
import pytest


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def _trace() -> list[dict]:
    """Steps 16 (0..1000 us) and 17 (1000..2000 us). Step 16: two overlapping kernels (100..300,
    250..400: 300 us busy), a stream sync, a device-to-host copy. Step 17: a kernel inside it and a
    graph launched at its start that runs 1900..2200 (100 us of it inside), a device sync."""
    return [
        _x("user_annotation", "ProfilerStep#16", 0, 1000),
        _x("user_annotation", "ProfilerStep#17", 1000, 1000),
        _x("gpu_user_annotation", "ProfilerStep#16", 50, 2000, tid=7),  # the GPU's copy: not a step
        # host side of step 16
        _x("cpu_op", "aten::linear", 5, 100),
        _x("cpu_op", "aten::matmul", 10, 60),
        _x("cpu_op", "aten::mm", 15, 40),
        _x("cuda_runtime", "cudaLaunchKernel", 20, 5, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 30, 5, correlation=2),
        _x("cpu_op", "aten::add", 200, 10),
        _x("cpu_op", "aten::add", 300, 10),
        _x("cuda_runtime", "cudaStreamSynchronize", 600, 100),
        _x("cuda_runtime", "cudaMemcpyAsync", 800, 50, correlation=4),
        # host side of step 17
        _x("cpu_op", "aten::linear", 1005, 100),
        _x("cpu_op", "aten::matmul", 1010, 60),
        _x("cpu_op", "aten::mm", 1015, 40),
        _x("cuda_runtime", "cudaLaunchKernelExC", 1020, 5, correlation=5),
        _x("cuda_runtime", "cudaGraphLaunch", 1030, 5, correlation=6),
        _x("cuda_runtime", "cudaEventRecord", 1100, 2),  # neither a launch nor a sync
        _x("cuda_runtime", "cudaMemcpyAsync", 1190, 5, correlation=7),
        _x("cpu_op", "aten::add", 1200, 10),
        _x("cpu_op", "aten::add", 1300, 10),
        _x("cpu_op", "aten::copy_", 1400, 300),
        _x("cuda_runtime", "cudaDeviceSynchronize", 1500, 200),
        _x("cpu_op", "aten::empty", 2500, 5),  # after the profiled steps: left out
        # device side
        _x("kernel", "gemm", 100, 200, tid=7, correlation=1),
        _x("kernel", "gemm", 250, 150, tid=8, correlation=2),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 820, 10, tid=7, correlation=4),
        _x("kernel", "add", 1050, 100, tid=7, correlation=5),
        _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1195, 10, tid=7, correlation=7),
        _x("kernel", "graph_kernel", 1900, 300, tid=7, correlation=6),
    ]


def test_every_figure_of_a_synthetic_trace():
    profile = gpu_profile.step_profile(_trace())
    one, two = profile["per step"]
    assert one == {
        "step": "ProfilerStep#16",
        "wall ms": 1.0,
        "GPU busy %": 30.0,
        "kernels": 2,
        "launches": 2,
        "stream syncs": 1,
        "device syncs": 0,
        "DtoH copies": 1,
        "sync wait ms": 0.1,
        "host syncs": 2,
    }
    assert two["GPU busy %"] == 20.0 and two["kernels"] == 2 and two["launches"] == 2
    assert (two["stream syncs"], two["device syncs"], two["DtoH copies"], two["host syncs"]) == (0, 1, 0, 1)
    assert profile["summary"] == pytest.approx(
        {
            "profiled steps": 2,
            "wall ms/step": 1.0,
            "GPU busy %": 25.0,
            "kernels/step": 2.0,
            "launches/step": 2.0,
            "host syncs/step": 1.5,
            "stream syncs/step": 0.5,
            "device syncs/step": 0.5,
            "DtoH copies/step": 0.5,
            "sync wait ms/step": 0.15,
        }
    )
    by_self = [(r["op"], r["calls/step"], r["self ms/step"]) for r in profile["top CPU ops by self time"]]
    assert by_self == [
        ("aten::copy_", 0.5, 0.15),
        ("aten::linear", 1.0, 0.04),  # 100 us less the 60 of the matmul inside it
        ("aten::mm", 1.0, 0.04),
        ("aten::add", 2.0, 0.02),
        ("aten::matmul", 1.0, 0.02),  # 60 us less the 40 of the mm inside it
    ]
    by_count = [(r["op"], r["calls/step"]) for r in profile["top CPU ops by count"]]
    assert by_count == [
        ("aten::add", 2.0),
        ("aten::linear", 1.0),
        ("aten::matmul", 1.0),
        ("aten::mm", 1.0),
        ("aten::copy_", 0.5),
    ]
    assert len(gpu_profile.step_profile(_trace(), top=2)["top CPU ops by count"]) == 2


def test_a_trace_without_step_marks_is_one_step():
    events = [e for e in _trace() if not e["name"].startswith("ProfilerStep#")]
    profile = gpu_profile.step_profile(events)
    assert [r["step"] for r in profile["per step"]] == ["whole trace"]
    assert profile["per step"][0]["wall ms"] == 2.5  # the first op's start (5 us) to the last one's end
    assert profile["summary"]["launches/step"] == 4
    assert gpu_profile.step_profile([])["per step"] == []


def test_megatron_timer_lines():
    log = []
    for i, ms in ((5, 3000.0), (6, 3100.0), (7, 3300.0), (8, 3200.0)):
        log += [
            f" [2026-11-28 01:55:00.000000] iteration {i:8d}/{20:8d} | consumed samples: {8 * i:12d} |",
            "(min, max) time across ranks (ms):",
            f"    forward-backward ...............................: ({ms - 5:.2f}, {ms:.2f})",
            f"    backward-compute ...............................: ({ms / 2 - 1:.2f}, {ms / 2:.2f})",
            "    optimizer ......................................: (40.00, 41.50)",
        ]
    log += [
        "(min, max) time across ranks (ms):",
        "    evaluate .......................................: (2617.71, 2617.71)",
    ]
    timers = gpu_profile.parse_timers("\n".join(log))
    assert timers[6] == {"forward-backward": 3100.0, "backward-compute": 1550.0, "optimizer": 41.5}
    assert timers[8]["evaluate"] == 2617.71  # after the last iteration line: outside a steady window
    table = gpu_profile.timer_table(timers, 6, 7)
    assert table == [
        {"timer": "forward-backward", "median ms": 3200.0, "iterations": 2},
        {"timer": "backward-compute", "median ms": 1600.0, "iterations": 2},
        {"timer": "optimizer", "median ms": 41.5, "iterations": 2},
    ]
