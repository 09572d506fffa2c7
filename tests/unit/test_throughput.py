"""Model FLOPs in megatron.training's log: the per-iteration FLOPs from the collate's stats, the
window mean the log divides by its mean iteration time, and the MFU line."""

import inspect
import itertools
from types import SimpleNamespace

import pytest

import throughput
from throughput import StepFlops, device_peak_tflops, flops_function, log_wrapper


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                       ("NVIDIA H200", 989.0), ("NVIDIA B200", 2250.0), ("NVIDIA GB200", 2500.0),
                                       ("NVIDIA A100-SXM4-80GB", 312.0), ("Some Accelerator 9000", None)])
def test_peak_from_device_name(name, peak):
    assert device_peak_tflops(name) == peak


def test_peak_override():
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", 400.0) == 400.0
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", 0.0) is None  # 0 turns MFU off
    with pytest.raises(ValueError, match="--peak-tflops -1"):
        device_peak_tflops("NVIDIA H100", -1.0)


def _batches(*flops):
    return iter([{"tokens": None, "stats": {"model_flops": f}} for f in flops])


def test_iteration_flops_then_window_mean(mcore):
    meter = StepFlops()
    count = flops_function(meter)
    data = meter.tap(_batches(1e12, 2e12, 10e12))
    next(data), next(data)  # iteration 1: two micro-batches
    assert count(None, 8) == 3e12  # the training loop's call ends the iteration
    assert count(None, 8) == 3e12  # the log's call: mean over the window (one iteration)
    next(data)  # iteration 2: one micro-batch
    assert count(None, 8) == 10e12
    assert count(None, 8) == 6.5e12
    assert (meter.take_window(), meter.window_iters) == (13e12, 0)


def test_log_wrapper_emits_mfu_on_log_iterations_only():
    calls, emitted, timer_reads = [], [], []

    def original(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale):
        calls.append(iteration)
        return "report"

    class Timer:
        def elapsed(self, reset=True, barrier=False):
            timer_reads.append(reset)
            return 2.0

    meter = StepFlops()
    meter.window_flops, meter.window_iters = 4 * 2.0 * 250e12, 2  # 250 TFLOP/s on each of 4 GPUs
    args = SimpleNamespace(log_interval=2, world_size=4)
    log = log_wrapper(original, meter, lambda a: 1000.0, lambda: args, lambda: (lambda name: Timer()), emitted.append)
    assert log({}, {}, 1e-4, 1, 1.0) == "report" and not emitted and not timer_reads
    assert log({}, {}, 1e-4, iteration=2, loss_scale=1.0) == "report"
    assert calls == [1, 2] and timer_reads == [False]  # read, never reset: megatron's log resets it
    assert emitted == [" model FLOPs (flops.py): 250.0 TFLOP/s per GPU over 2 iterations"
                       " | MFU: 25.0% of 1000 TFLOP/s dense bf16 |"]
    assert meter.window_flops == 0.0


def test_hooks_install_into_megatron_training(monkeypatch):
    from megatron.training import training as mt

    for name in ("num_floating_point_operations", "training_log"):
        monkeypatch.setattr(mt, name, getattr(mt, name))  # restored after the test
        # train() must look both up by name at call time for the replacement to take effect
        assert f"{name}(" in inspect.getsource(mt.train)
    throughput.install_megatron_training_hooks(StepFlops())
    assert mt.num_floating_point_operations.__module__ == "throughput"
    assert mt.training_log.__module__ == "throughput"


def test_cpu_log_reports_model_tflops_and_mfu_against_a_given_peak(capsys, monkeypatch):
    import megatron.cpu.reporting as reporting

    args = SimpleNamespace(tensorboard_dir=None, train_iters=2, log_interval=2, consumed_train_samples=16,
                           global_batch_size=8, peak_tflops=0.5)
    clock = itertools.chain([100.0], itertools.repeat(104.0))  # the window opens at 100 s, the line at 104 s
    monkeypatch.setattr(reporting.time, "perf_counter", lambda: next(clock))
    reporter = reporting.Reporter(args, 0, is_logging_rank=True)
    for it in (1, 2):  # 2 iterations of 0.6 TFLOP each per device in 4 s: 0.3 TFLOP/s, 60% of 0.5
        reporter.train_step(it, 10.0, 5.0, 1.0, 1e-4, real_tokens=100, padded_tokens=125, flops_per_device=0.6e12)
    line = capsys.readouterr().out
    assert "model TFLOP/s per device: 0.3000 | MFU: 60.00% of 0.5 TFLOP/s" in line
    assert "tokens/s: 50 |" in line and "padding: 20.0%" in line
