"""Check 4: training through ``run_qwen35_vl.sh`` on one GPU in bf16 (megatron.training, the path users
run), mock data: does the loss fall, and how fast and how big is it.

Runs (GPU_TRAIN_RUNS, default 35b_a3b-cut,35b_a3b-cut-lora,proxy, in this order; each at most
GPU_TRAIN_RUN_CAP_S, 200 s):
- ``35b_a3b-cut``: 35b_a3b with fewer layers from an HF_CONFIG this test writes
  (configuration.to_hf_config_dict), every layer type and all 256 experts kept, no MTP head. The
  layer count is the largest of 8 / 4 / 3 / 2 whose estimate fits 95% of the GPU: 18 bytes per
  parameter (bf16 weight, fp32 gradient accumulation, fp32 main weight, two fp32 Adam moments; DP=1
  so nothing is sharded) plus 16 GB of activations (the 248k-vocabulary logits in fp32 dominate).
  One layer of 256 experts is ~0.81 B parameters (14.6 GB with its optimizer), embeddings + vision
  ~1.5 B: an 80 GB H100 takes 2 layers (GDN + attention, ~3.1 B, ~68 GiB estimated), a 141 GB
  H200 takes 4 (~96 GiB) (the released 3 GDN + 1 attention pattern). GPU_35B_LAYERS overrides.
- ``tiny``: MODEL_VARIANT=tiny, the run of a rehearsal on a CPU host (gpu_results.rehearsal), where the
  two above would not fit.
- ``35b_a3b-cut-lora``: the cut with LORA_RANK=8 on the default targets (every decoder linear, the
  routed experts' adapters on grouped GEMMs: lora/grouped.py), from its random weights: LoRA's step.
- ``proxy``: MODEL_VARIANT=proxy (4 layers of the 397B shape, 8 experts; ~3.4 B parameters, ~72 GiB
  estimated the same way).

Settings: TRAIN_ITERS=20, MBS=4 samples packed (THD) per micro-batch, GBS=8, SEQ_LEN=4096, LR=2e-4,
mock samples of up to ~2k tokens (--mock-text-tokens 1024; the default ~100-token samples would
measure launch overhead, not the model): ~4k tokens per micro-batch, ~8k per iteration.
Measured: loss of the first and last three iterations (metrics file, full precision; "falls" means
the last three average at least 1% below the first three; a run stopped by its cap is judged on the
iterations it completed, gpu_train.training_verdict), the warm-up (iterations 1 and 2 together: the
compilation and autotuning happen there; the graphs torch.compile built and the kernels Triton
autotuned, with their seconds, from the log; how full both caches were before), and over the steady iterations
6..(profile start - 1): tokens/s, model TFLOP/s per GPU (flops.py's count of the real work, from the
run's log line) and MFU against the device's dense bf16 peak (throughput.py's table), iteration
time, and beside it the planner's step time for the same setting (gpu_train.planner_step_seconds) as
measured / planner; peak memory two ways: nvidia-smi polled every 0.5 s during the run (minus what was in use
before it) and megatron's own "max allocated" (--log-memory-interval 5); megatron's timers
(--timing-log-level 2: forward / backward compute, optimizer, ...; median over the steady iterations).
From megatron's --profile --use-pytorch-profiler (a torch.profiler Chrome trace of exactly two steady
training steps, no extra code in the run; tests/gpu/gpu_profile.py), per step: the GPU busy share
(union of kernel intervals over the step's wall time), kernels and kernel launches, host syncs
(stream and device synchronizes, device-to-host copies) and the time waited in them, the 10 CPU ops
with the most self time and the 10 with the most calls, and the 10 kernels with the most GPU time.
"""

import os
import subprocess
import tempfile

import gpu_results
import pytest
import torch

if not torch.cuda.is_available() and not gpu_results.rehearsal():
    pytest.skip("no CUDA device: GPU checks run on a GPU host (bash tests/gpu/run.sh)", allow_module_level=True)

import gpu_profile
import gpu_train as gt

CHECK = "training"
pytestmark = pytest.mark.gpu

ITERS = int(os.environ.get("GPU_TRAIN_ITERS", 20))
SETTINGS = dict(
    TRAIN_ITERS=ITERS,
    MBS=os.environ.get("GPU_TRAIN_MBS", 4),
    GBS=os.environ.get("GPU_TRAIN_GBS", 8),
    SEQ_LEN=os.environ.get("GPU_TRAIN_SEQ_LEN", 4096),
    LR=os.environ.get("GPU_TRAIN_LR", "2e-4"),
)
PROFILE_START, PROFILE_END = ITERS - 4, ITERS - 2  # two steady iterations, before the last one's evaluation
RUN_CAP_S = float(os.environ.get("GPU_TRAIN_RUN_CAP_S", 200))
# 35b_a3b first: its GDN kernels are the ones test_fla_kernels.py compiled and autotuned already.
# A rehearsal on a CPU (gpu_results.rehearsal) trains the tiny model instead.
DEFAULT_RUNS = "tiny" if not torch.cuda.is_available() else "35b_a3b-cut,35b_a3b-cut-lora,proxy"
RUNS = [r for r in os.environ.get("GPU_TRAIN_RUNS", DEFAULT_RUNS).split(",") if r]


def _gpu(field: str) -> str:
    """nvidia-smi's answer for GPU 0: this process never starts a CUDA context (it would hold ~0.5 GB
    of the GPU the run needs)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
        return out.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):  # no nvidia-smi: ask torch after all
        if not torch.cuda.is_available():  # a rehearsal on a CPU
            return "0" if field == "memory.total" else "cpu (rehearsal)"
        props = torch.cuda.get_device_properties(0)
        return str(props.total_memory // 2**20) if field == "memory.total" else props.name


def _dirs(run_name: str) -> tuple[str, str]:
    scratch = os.environ.get("GPU_CHECKS_SCRATCH") or tempfile.mkdtemp(prefix="gpu_checks_")
    workdir = os.path.join(scratch, run_name)
    os.makedirs(workdir, exist_ok=True)
    return workdir, os.path.join(os.environ.get("GPU_CHECKS_OUTDIR") or workdir, f"train_{run_name}.log")


def _plan(run_name: str, workdir: str):
    """(shape, environment for run_qwen35_vl.sh, what the case is)."""
    from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant

    if run_name == "proxy":
        return get_variant("proxy", mtp=False), {"MODEL_VARIANT": "proxy"}, "proxy variant (MTP off: the default)"
    if run_name == "tiny":
        return get_variant("tiny", mtp=False), {"MODEL_VARIANT": "tiny"}, "tiny variant (a rehearsal's run)"
    if run_name == "35b_a3b-cut-lora":
        shape, env, what = _plan("35b_a3b-cut", workdir)
        return shape, {**env, "LORA_RANK": "8"}, f"LoRA rank 8 on the default targets; {what}"
    if run_name == "35b_a3b-cut":
        total = float(_gpu("memory.total")) * 2**20
        layers = int(os.environ.get("GPU_35B_LAYERS") or gt.choose_35b_layers(total))
        shape = gt.cut_35b(layers)
        types = "+".join("GDN" if t == "linear_attention" else "attn" for t in shape.text.layer_types)
        return (
            shape,
            {"HF_CONFIG": gt.write_hf_config(shape, os.path.join(workdir, "hf_config.json"))},
            (
                f"{layers} layers ({types}), 256 experts top-8, no MTP; estimated "
                f"{gt.estimated_bytes(shape) / 2**30:.0f} of {total / 2**30:.0f} GiB"
            ),
        )
    raise ValueError(f"GPU_TRAIN_RUNS: unknown run {run_name!r} (proxy, 35b_a3b-cut, 35b_a3b-cut-lora, tiny)")


def _record_profile(record, run_name: str, events: list) -> None:
    """One row of where the profiled steps' time went (gpu_profile.step_profile), with the top kernels."""
    steps = PROFILE_END - PROFILE_START
    profile = gpu_profile.step_profile(events)
    tables = {"top 10 kernels by GPU time": gpu_profile.top_kernels(events, steps)}
    tables.update((title, profile[title]) for title in ("per step", "top CPU ops by self time", "top CPU ops by count"))
    record(
        f"{run_name} profile",
        "info",
        profile["summary"],
        "torch.profiler (megatron --profile --use-pytorch-profiler), per profiled step; the device syncs "
        "include megatron's timers' own (--timing-log-level 2 synchronizes at each timer's start and stop)",
        tables,
    )


@pytest.mark.parametrize("run_name", RUNS)
def test_training_run(run_name, record):
    left = gpu_results.deadline_left() - 25
    if left < 90:
        pytest.skip(f"{left:.0f} s left of tests/gpu/run.sh's budget: too little for a training run")
    workdir, log_path = _dirs(run_name)
    shape, env, what = _plan(run_name, workdir)
    env.update(SETTINGS)
    env["TRITON_PRINT_AUTOTUNING"] = "1"  # a line for each kernel autotuned, with its seconds (warm-up)
    if os.environ.get("GPU_TRAIN_IMPL"):
        env["TRANSFORMER_IMPL"] = os.environ["GPU_TRAIN_IMPL"]
    args = [
        "--mock-text-tokens",
        "1024",
        "--log-memory-interval",
        "5",
        "--tensorboard-dir",
        os.path.join(workdir, "tb"),
        "--profile",
        "--use-pytorch-profiler",
        "--profile-step-start",
        PROFILE_START,
        "--profile-step-end",
        PROFILE_END,
        "--timing-log-level",
        "2",
    ]
    caches = gt.compile_caches()  # the warm-up's figure depends on them: a fresh machine has neither
    run = gt.run_training(run_name, env, args, min(RUN_CAP_S, left), workdir, log_path)

    from examples.multimodal_dev.training.throughput import device_peak_tflops

    values = list(run.losses.values())
    status, verdict = gt.training_verdict(values, ITERS, run.returncode, run.timed_out, min(RUN_CAP_S, left))
    steady = gt.steady_state(run, 6, PROFILE_START - 1)
    peak = device_peak_tflops(_gpu("name"))
    metrics = {
        "iterations": len(values),
        "loss first3": gt.mean(values[:3]),
        "loss last3": gt.mean(values[-3:]),
        "tokens/s": steady.get("tokens_per_s"),
        "TFLOP/s/GPU": steady.get("tflops"),
        "MFU %": 100 * steady["tflops"] / peak if peak and "tflops" in steady else None,
        "iter ms": steady.get("iter_ms"),
        # compilation and autotuning land in the first two (the aim: under 15 s together)
        "iters 1+2 s": (run.iter_ms[1] + run.iter_ms[2]) / 1000 if {1, 2} <= run.iter_ms.keys() else None,
        **run.warm_up,
        "padding %": steady.get("padding"),
        "peak GiB (nvidia-smi)": max(run.gpu_peak_mib.values()) / 1024 if run.gpu_peak_mib else None,
        "max allocated GiB": run.memory_mib.get("max allocated", 0) / 1024 or None,
        "max reserved GiB": run.memory_mib.get("max reserved", 0) / 1024 or None,
        "params B": gt.param_count(shape) / 1e9,
        "wall s": run.seconds,
    }
    planned = gt.planner_step_seconds(steady, peak)
    if planned:  # the planner's time model beside the measured step, where calibrating it starts
        metrics.update({"planner step s": planned, "measured / planner": steady["iter_ms"] / 1000 / planned})
    metrics = {k: v for k, v in metrics.items() if v is not None}
    ok = status == "pass"
    note = (
        f"{what}; {verdict}; MBS {SETTINGS['MBS']} GBS {SETTINGS['GBS']} seq {SETTINGS['SEQ_LEN']}; "
        f"steady iterations {steady.get('iterations', 'none')}; "
        + (f"MFU vs {peak} TFLOP/s dense bf16; " if peak else "no MFU: no peak known for this device; ")
        + caches
    )
    if not ok:
        note += f"; {run.error_line()}"
        print(f"---- {run_name}: last lines of {log_path} ----\n{run.tail()}")
    timers = gpu_profile.timer_table(run.timers, 6, PROFILE_START - 1)
    per_iteration = [
        {
            "iteration": i,
            "lm loss": r.get("lm loss"),
            "grad norm": r.get("grad norm"),
            "real tokens": r.get("real_tokens"),
            "ms": run.iter_ms.get(i),
        }
        for i, r in sorted(run.records.items())
    ]
    details = {"per iteration": per_iteration}
    if timers:
        details["megatron timers, ms per iteration (median over the steady iterations)"] = timers
    record(run_name, status, metrics, note, details)
    if run.trace_path:
        try:
            _record_profile(record, run_name, gpu_profile.load_trace(run.trace_path))
        except Exception as e:  # noqa: BLE001 - the run's result stands without the profile
            record(f"{run_name} profile", "info", note=f"trace unreadable: {e!r}"[:300])
    elif run.returncode == 0:
        record(f"{run_name} profile", "info", note="no profiler trace written (torch_profile/rank-0.json.gz)")
    assert ok, note
