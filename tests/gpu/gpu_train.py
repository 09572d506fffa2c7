"""Training runs for the GPU checks: launch ``run_qwen35_vl.sh`` under a time limit, poll GPU memory
meanwhile, and read back what the run recorded (metrics file, log lines, profiler trace). Also the
cut of 35b_a3b that fits one GPU. Parsing and sizing need no GPU (tests/gpu/test_results_table.py).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace

import gpu_profile
import gpu_results

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")
THROUGHPUT = re.compile(
    r"model FLOPs \(flops\.py\): ([0-9.eE+-]+) TFLOP/s per GPU over (\d+) iterations"
    r" \| tokens/s: ([0-9.]+) \| padding: ([0-9.]+)%"
)
MEMORY = re.compile(
    r"\(after (\d+) iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| max allocated: ([0-9.]+)"
    r" \| reserved: ([0-9.]+) \| max reserved: ([0-9.]+)"
)


@dataclass
class TrainRun:
    name: str
    returncode: int | None
    timed_out: bool
    seconds: float
    log_path: str
    records: dict = field(default_factory=dict)  # iteration -> metrics-file record
    throughput: dict = field(default_factory=dict)  # iteration -> {"tflops", "tokens_per_s", "padding"}
    iter_ms: dict = field(default_factory=dict)  # iteration -> elapsed ms (megatron's line)
    memory_mib: dict = field(default_factory=dict)  # "max allocated" / "max reserved" (megatron's lines)
    gpu_peak_mib: dict = field(default_factory=dict)  # GPU index -> nvidia-smi peak used, minus the baseline
    timers: dict = field(default_factory=dict)  # iteration -> {megatron timer: ms} (--timing-log-level)
    trace_path: str | None = None
    warm_up: dict = field(default_factory=dict)  # warm_up_work of the log

    @property
    def losses(self) -> dict:
        return {i: r["lm loss"] for i, r in sorted(self.records.items()) if r.get("lm loss") is not None}

    def tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def error_line(self) -> str:
        """The most telling line of a failed run: the last error / exception line, else the last line."""
        text = self.tail(200).splitlines()
        hits = [
            ln for ln in text if re.search(r"Error|error:|Exception|CUDA out of memory|Traceback|run_qwen35_vl.sh:", ln)
        ]
        return ((hits or text or [""])[-1]).strip()[:300]


def parse_log(text: str) -> tuple[dict, dict, dict]:
    """(throughput by iteration, elapsed ms by iteration, peak memory MiB) from a run's output. A
    throughput line belongs to the iteration line printed just before it (flops.py's log hook)."""
    throughput, iter_ms, memory, current = {}, {}, {}, None
    for line in text.splitlines():
        m = ITERATION.search(line)
        if m:
            current = int(m.group(1))
            iter_ms[current] = float(m.group(2))
            continue
        m = THROUGHPUT.search(line)
        if m and current is not None:
            throughput[current] = {
                "tflops": float(m.group(1)),
                "tokens_per_s": float(m.group(3)),
                "padding": float(m.group(4)),
            }
            continue
        m = MEMORY.search(line)
        if m:
            memory["max allocated"] = max(memory.get("max allocated", 0.0), float(m.group(3)))
            memory["max reserved"] = max(memory.get("max reserved", 0.0), float(m.group(5)))
    return throughput, iter_ms, memory


def steady_state(run: TrainRun, first: int, last: int) -> dict:
    """Medians over iterations first..last (warm-up and profiled steps left out); if fewer than three
    of them were logged, over every logged iteration after the second."""
    its = [i for i in sorted(run.throughput) if first <= i <= last]
    if len(its) < 3:
        its = sorted(run.throughput)[2:] or sorted(run.throughput)
    if not its:
        return {}
    pick = lambda key: statistics.median(run.throughput[i][key] for i in its)  # noqa: E731
    out = {
        "iterations": f"{its[0]}..{its[-1]}",
        "tflops": pick("tflops"),
        "tokens_per_s": pick("tokens_per_s"),
        "padding": pick("padding"),
    }
    ms = [run.iter_ms[i] for i in its if i in run.iter_ms]
    if ms:
        out["iter_ms"] = statistics.median(ms)
    return out


def planner_step_seconds(steady: dict, peak_tflops: float) -> float | None:
    """The planner's step time for the run's own setting: on one GPU with no parallelism its model is the
    compute term alone, the step's model FLOPs (flops.py's, as the run counted them) at the planner's
    default efficiency of the GPU's peak (planner/layout_plan.Request.efficiency)."""
    from examples.multimodal_dev.planner.layout_plan import Request

    if not peak_tflops or "tflops" not in steady or "iter_ms" not in steady:
        return None
    step_tflop = steady["tflops"] * steady["iter_ms"] / 1000
    return step_tflop / (peak_tflops * Request.efficiency)


COMPILED = re.compile(r"torch\.compile: (\d+) graphs compiled \(\d+ since the last line\)(?: in ([0-9.]+) s)?")


def warm_up_work(text: str) -> dict:
    """What a run compiled, from its log: torch.compile's graphs and seconds (the last line the run's log
    wrapper printed, training/compile_once.CompileWatch) and the kernels Triton autotuned and the seconds
    that took (compiling every config included)."""
    out = {}
    compiled = COMPILED.findall(text)
    if compiled:
        graphs, seconds = compiled[-1]
        out["compiled graphs"] = int(graphs)
        if seconds:
            out["compile s"] = float(seconds)
    tuned = gpu_results.autotuned(text)
    if tuned:
        out["autotuned kernels"] = len(tuned)
        out["autotune s"] = sum(seconds for _, seconds in tuned)
    return out


def compile_caches() -> str:
    """What the run's warm-up could reuse: kernels in Triton's cache (FLA's autotuned kernels among them;
    FLA keeps its autotune results there too) and files in Inductor's (megatron's compiled helpers)."""
    import getpass
    import tempfile

    triton_dir = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    inductor_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"
    )
    kernels = len(os.listdir(triton_dir)) if os.path.isdir(triton_dir) else 0
    files = sum(len(names) for _, _, names in os.walk(inductor_dir))
    return f"before the run: {kernels} entries in Triton's cache, {files} files in Inductor's"


def mean(values: list) -> float:
    return sum(values) / len(values) if values else float("nan")


def loss_falls(losses: list) -> bool:
    """The last three losses average at least 1% below the first three, all finite."""
    return len(losses) >= 2 and all(v == v for v in losses) and mean(losses[-3:]) < 0.99 * mean(losses[:3])


def training_verdict(losses: list, iters: int, returncode: int | None, timed_out: bool, cap_s: float) -> tuple:
    """(status, why) of a training run from its logged losses (in iteration order). A run stopped by its
    time cap is judged on the iterations it completed: all of them with a falling loss is a pass whose
    note says where the cap struck (the end-of-run evaluation or exit); fewer is a fail that says how
    many it completed, not that the loss did not fall. bash reports 0 for a run killed at its cap."""
    done, falls = len(losses), loss_falls(losses)
    trend = f"loss {mean(losses[:3]):.4g} -> {mean(losses[-3:]):.4g}" if losses else "no loss logged"
    if timed_out:
        where = f"stopped by its time cap ({cap_s:.0f} s) after {done} iterations"
        if done >= iters and falls:
            return "pass", f"{where}, all it had to run (the cap struck after training); {trend}"
        fell = "falling" if falls else "not falling"
        return "fail", f"{where} of {iters}; {trend}, {fell} over those"
    if returncode != 0:
        return "fail", f"exit {returncode} after {done} of {iters} iterations; {trend}"
    if done < iters:
        return "fail", f"exit 0 with {done} of {iters} iterations logged; {trend}"
    if not falls:
        return "fail", f"loss did not fall: {trend}"
    return "pass", trend


class GpuMemoryPoller:
    """Peak ``nvidia-smi`` memory.used per GPU while a run lasts (the run's own torch counters are not
    visible from outside). Readings every 500 ms; a missing nvidia-smi leaves the peaks empty."""

    QUERY = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]

    def __init__(self):
        self.peak, self.baseline, self.proc, self.thread = {}, self.read_once(), None, None

    @classmethod
    def read_once(cls) -> dict:
        try:
            out = subprocess.run(cls.QUERY, capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            return {}
        return dict(cls._parse(line) for line in out.splitlines() if cls._parse(line))

    @staticmethod
    def _parse(line: str):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                return int(parts[0]), float(parts[1])
            except ValueError:
                return None
        return None

    def start(self):
        try:
            self.proc = subprocess.Popen([*self.QUERY, "-lms", "500"], stdout=subprocess.PIPE, text=True)
        except OSError:
            return self
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            parsed = self._parse(line)
            if parsed:
                self.peak[parsed[0]] = max(self.peak.get(parsed[0], 0.0), parsed[1])

    def stop(self) -> dict:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.thread.join(timeout=10)
        return {i: used - self.baseline.get(i, 0.0) for i, used in self.peak.items()}


def kill_tree(pid: int) -> None:
    """End a launched run and everything it started (torchrun's workers), so the GPU is free again."""
    try:
        import psutil

        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
        for p in procs:
            p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=15)
        for p in alive:
            p.kill()
    except ImportError:
        os.kill(pid, 15)  # torchrun forwards SIGTERM to its workers
    except Exception:  # noqa: BLE001 - already gone
        pass


def visible_gpus() -> int:
    """GPUs this host shows, from nvidia-smi, so the calling process starts no CUDA context of its own."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
        return sum(1 for line in out.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        import torch

        return torch.cuda.device_count()


def run_training(
    name: str, env: dict, args: list, timeout_s: float, workdir: str, log_path: str, poll_memory: bool = True
) -> TrainRun:
    """``bash run_qwen35_vl.sh args --metrics-file ...`` with ``env`` added, output to ``log_path``."""
    os.makedirs(workdir, exist_ok=True)
    metrics = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in env.items()}}
    poller = GpuMemoryPoller().start() if poll_memory else None
    start, timed_out = time.time(), False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["bash", os.path.join(ROOT, "run_qwen35_vl.sh"), *map(str, args), "--metrics-file", metrics],
            cwd=ROOT,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            returncode = proc.wait(timeout=max(timeout_s, 1))
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_tree(proc.pid)
            returncode = proc.wait()
    run = TrainRun(name, returncode, timed_out, time.time() - start, log_path)
    run.gpu_peak_mib = poller.stop() if poller else {}
    if os.path.exists(metrics):
        with open(metrics) as f:
            for line in f:
                try:
                    record = json.loads(line)
                    run.records[int(record["iteration"])] = record
                except (ValueError, KeyError):
                    continue
    with open(log_path, errors="replace") as f:
        text = f.read()
    run.throughput, run.iter_ms, run.memory_mib = parse_log(text)
    run.timers = gpu_profile.parse_timers(text)
    run.warm_up = warm_up_work(text)
    trace = os.path.join(workdir, "torch_profile", "rank-0.json.gz")
    run.trace_path = trace if os.path.exists(trace) else None
    _keep_tail(log_path)
    return run


def _keep_tail(path: str, limit: int = 15_000_000) -> None:
    """Logs come back from the GPU machine only under 16 MiB: keep the end of a longer one."""
    if os.path.getsize(path) > limit:
        with open(path, "rb") as f:
            f.seek(-limit, os.SEEK_END)
            tail = f.read()
        with open(path, "wb") as f:
            f.write(b"[... cut: the log's start is dropped ...]\n" + tail)


# ---- the cut of 35b_a3b that fits one GPU with its optimizer ----

# Every layer type kept at every size: [GDN, attention] ... the released 3 GDN + 1 attention pattern.
CUT_PATTERNS = {
    2: ("linear_attention", "full_attention"),
    3: ("linear_attention", "linear_attention", "full_attention"),
    4: ("linear_attention",) * 3 + ("full_attention",),
    8: (("linear_attention",) * 3 + ("full_attention",)) * 2,
}
# bf16 weights (2) + fp32 gradient accumulation (4: megatron sets --accumulate-allreduce-grads-in-fp32 for
# bf16) + fp32 main weights (4) + Adam's two fp32 moments (8); DP=1, so the distributed optimizer saves nothing.
BYTES_PER_PARAM = 18
# Activations of one micro-batch of ~4k tokens: dominated by the 248k-vocabulary logits in fp32 for the
# cross entropy (~4 GB a copy, two or three live), plus allocator slack.
ACTIVATION_BYTES = 16e9


def param_count(shape) -> int:
    """Parameters of the Megatron model of ``shape`` (TP=1), as build_model makes them (checked on CPU
    against the built tiny models in test_results_table.py)."""
    t, v = shape.text, shape.vision
    h, merged = v.hidden_size, v.hidden_size * v.spatial_merge_size**2
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * v.intermediate_size * h + v.intermediate_size + h
    vision = (
        h * v.patch_dim
        + h
        + v.num_position_embeddings * h
        + v.depth * block
        + 2 * h
        + merged * merged
        + merged
        + v.out_hidden_size * merged
        + v.out_hidden_size
    )
    H = t.hidden_size
    qk, vd = t.linear_num_key_heads * t.linear_key_head_dim, t.linear_num_value_heads * t.linear_value_head_dim
    gdn = (
        H
        + 2 * t.linear_num_value_heads
        + H * (2 * qk + 2 * vd + 2 * t.linear_num_value_heads)
        + (2 * qk + vd) * t.linear_conv_kernel_dim
        + t.linear_value_head_dim
        + vd * H
    )
    attn = (
        H
        + H * (2 * t.num_attention_heads + 2 * t.num_kv_heads) * t.head_dim
        + 2 * t.head_dim
        + t.num_attention_heads * t.head_dim * H
    )
    if t.is_moe:
        mlp = (
            H
            + t.num_experts * H
            + t.num_experts * 3 * H * t.moe_ffn_hidden_size
            + H
            + 3 * H * t.shared_expert_ffn_hidden_size
        )
    else:
        mlp = H + 3 * H * t.ffn_hidden_size
    layers = sum((gdn if kind == "linear_attention" else attn) + mlp for kind in t.layer_types)
    embeddings = t.vocab_size * H * (1 if t.tie_word_embeddings else 2)
    if t.mtp_num_layers:
        raise ValueError("param_count covers models without the MTP head")
    return vision + embeddings + layers + H


def cut_35b(layers: int):
    """35b_a3b with ``layers`` decoder layers (every 256 experts kept) and no MTP head."""
    from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant

    if layers not in CUT_PATTERNS:
        raise ValueError(f"GPU_35B_LAYERS={layers}: choose one of {sorted(CUT_PATTERNS)}")
    shape = get_variant("35b_a3b", mtp=False)
    return replace(shape, text=replace(shape.text, num_layers=layers, layer_types=CUT_PATTERNS[layers]))


def estimated_bytes(shape) -> float:
    return BYTES_PER_PARAM * param_count(shape) + ACTIVATION_BYTES


def choose_35b_layers(gpu_bytes: float, fraction: float = 0.95) -> int:
    """The most layers whose weights, gradients, Adam state and activations fit ``fraction`` of the GPU."""
    for layers in sorted(CUT_PATTERNS, reverse=True):
        if estimated_bytes(cut_35b(layers)) <= fraction * gpu_bytes:
            return layers
    return min(CUT_PATTERNS)


def write_hf_config(shape, path: str) -> str:
    from examples.multimodal_dev.models.qwen35_vl.configuration import to_hf_config_dict

    with open(path, "w") as f:
        json.dump(to_hf_config_dict(shape), f, indent=1)
    return path
