"""Throughput in megatron.training's log: the per-iteration sums of model FLOPs and real /
padded tokens from the collate's stats, the window mean the log divides by its mean iteration
time, the throughput line, the per-iteration metrics file and the MTP losses it records."""

import inspect
import json
from types import SimpleNamespace

import pytest
import torch

from examples.multimodal_dev.data.batch import BatchStats
from examples.multimodal_dev.training import throughput
from examples.multimodal_dev.training.throughput import (
    MetricsFile,
    StepFlops,
    capture_mtp_losses,
    device_peak_tflops,
    flops_function,
    log_wrapper,
    throughput_line,
)


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA GB200", 2500.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Some Accelerator 9000", None),
    ],
)
def test_peak_from_device_name(name, peak):
    assert device_peak_tflops(name) == peak


def test_peak_override():
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", 400.0) == 400.0
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", 0.0) is None  # 0 turns MFU off
    with pytest.raises(ValueError, match="--peak-tflops -1"):
        device_peak_tflops("NVIDIA H100", -1.0)


def _stats(model_flops: float = 0.0, real: int = 0, padded: int = 0) -> BatchStats:
    return BatchStats(
        samples=1,
        real_tokens=real,
        padded_tokens=padded,
        pad_fraction=1.0 - real / max(padded, 1),
        lengths=[real],
        model_flops=model_flops,
    )


def _batches(*stats):
    """Micro-batches as the tap sees them (only their stats are read): (model FLOPs, real tokens,
    padded tokens)."""
    return iter([SimpleNamespace(stats=_stats(f, r, p)) for f, r, p in stats])


def test_iteration_sums_then_window_mean(mcore):
    meter = StepFlops()
    count = flops_function(meter)
    data = meter.tap(_batches((1e12, 100, 128), (2e12, 50, 64), (10e12, 300, 512)))
    next(data), next(data)  # iteration 1: two micro-batches
    assert meter.pending_batches == 2 and meter.pending["real_tokens"] == 150
    assert count(None, 8) == 3e12  # the training loop's call ends the iteration
    assert meter.last == {"model_flops": 3e12, "real_tokens": 150.0, "padded_tokens": 192.0, "dp_imbalance": 1.0}
    assert meter.pending_batches == 0 and meter.pending["model_flops"] == 0.0
    assert count(None, 8) == 3e12  # the log's call: mean over the window (one iteration)
    next(data)  # iteration 2: one micro-batch
    assert count(None, 8) == 10e12
    assert meter.last == {"model_flops": 10e12, "real_tokens": 300.0, "padded_tokens": 512.0, "dp_imbalance": 1.0}
    assert count(None, 8) == 6.5e12
    assert meter.window_flops == 13e12 and meter.window_iters == 2
    assert meter.take_window() == {
        "model_flops": 13e12,
        "real_tokens": 450.0,
        "padded_tokens": 704.0,
        "dp_imbalance": 1.0,
    }
    assert meter.window_iters == 0 and meter.window_flops == 0.0
    assert meter.take_window() == {"model_flops": 0.0, "real_tokens": 0.0, "padded_tokens": 0.0}


def test_stats_missing_from_a_batch_count_as_zero(mcore):
    meter = StepFlops()
    data = meter.tap(iter([SimpleNamespace(), SimpleNamespace(stats=_stats(model_flops=5.0))]))
    assert len(list(data)) == 2 and meter.pending_batches == 2
    assert meter.end_iteration() == 5.0
    assert meter.last == {"model_flops": 5.0, "real_tokens": 0.0, "padded_tokens": 0.0, "dp_imbalance": 1.0}


def test_work_the_step_makes_counts_in_its_iteration(mcore, monkeypatch):
    """GRPO's drawn answers, packed inside the step, add to the run's meter as a drawn micro-batch."""
    monkeypatch.setattr(StepFlops, "of_run", None)
    StepFlops.count_in_step(_stats(model_flops=1.0))  # no run's meter: nothing to count into
    meter = StepFlops()
    monkeypatch.setattr(StepFlops, "of_run", meter)
    next(meter.tap(_batches((2.0, 10, 16))))
    StepFlops.count_in_step(_stats(model_flops=5.0, real=20, padded=32))
    assert meter.end_iteration() == 7.0 and meter.last["real_tokens"] == 30.0 and meter.last["padded_tokens"] == 48.0
    next(meter.tap(_batches((2.0, 10, 16)), counted=False))  # a rank that counts none of its batches
    StepFlops.count_in_step(_stats(model_flops=5.0, real=20, padded=32))
    assert meter.pending == {"model_flops": 0.0, "real_tokens": 0.0, "padded_tokens": 0.0}


def test_throughput_line_with_and_without_peak():
    # 123.456 TFLOP/s on each of 4 GPUs for 2 s; 1500 real of 2000 padded tokens
    window = {"model_flops": 123.456e12 * 4 * 2.0, "real_tokens": 1500.0, "padded_tokens": 2000.0}
    assert throughput_line(window, 3, 2.0, 4, 1000.0) == (
        " model FLOPs (flops.py): 123.5 TFLOP/s per GPU over 3 iterations | tokens/s: 750 | padding: 25.0%"
        " | MFU: 12.3% of 1000 TFLOP/s dense bf16 |"
    )
    assert throughput_line(window, 3, 2.0, 4, None) == (
        " model FLOPs (flops.py): 123.5 TFLOP/s per GPU over 3 iterations | tokens/s: 750 | padding: 25.0% |"
    )
    # 4 significant digits on a CPU-sized rate; an empty window does not divide by zero
    small = {"model_flops": 0.0123456e12, "real_tokens": 10.0, "padded_tokens": 10.0}
    assert "0.01235 TFLOP/s per GPU over 1 iterations | tokens/s: 10 | padding: 0.0% |" in throughput_line(
        small, 1, 1.0, 1, None
    )
    empty = dict.fromkeys(("model_flops", "real_tokens", "padded_tokens"), 0.0)
    assert "padding: 100.0%" in throughput_line(empty, 0, 0.0, 1, None)
    assert throughput_line(dict(window, dp_imbalance=1.0412), 3, 2.0, 4, None).endswith(
        "padding: 25.0% | DP imbalance (max/mean FLOPs, worst step): 1.041 |"
    )


class _Timer:
    def __init__(self, reads, seconds):
        self.reads, self.seconds = reads, seconds

    def elapsed(self, reset=True, barrier=False):
        self.reads.append(reset)
        return self.seconds


def _training_log_stub(calls, side_losses=None):
    """megatron.training.training.training_log's leading parameters; it fills the MTP losses as
    megatron's does (track_mtp_metrics runs inside training_log)."""

    def training_log(
        loss_dict,
        total_loss_dict,
        learning_rate,
        iteration,
        loss_scale,
        report_memory_flag,
        skipped_iter,
        grad_norm,
        params_norm,
        num_zeros_in_grad,
        max_attention_logit,
    ):
        calls.append(iteration)
        if side_losses is not None:
            side_losses["mtp_1 loss"] = 0.25 * iteration
        return "report"

    return training_log


def _log_call(log, iteration, loss=2.5, grad_norm=None, **kwargs):
    return log(
        {"lm loss": torch.tensor(loss, dtype=torch.float64)},
        {},
        1e-4 * iteration,
        iteration,
        1.0,
        False,
        0,
        grad_norm,
        None,
        None,
        None,
        **kwargs,
    )


def test_log_wrapper_emits_throughput_on_log_iterations_and_writes_metrics(mcore, tmp_path):
    calls, emitted, timer_reads, side_losses, scalars = [], [], [], {}, []
    meter = StepFlops()
    args = SimpleNamespace(log_interval=2, world_size=4)
    path = tmp_path / "metrics.jsonl"
    log = log_wrapper(
        _training_log_stub(calls, side_losses),
        meter,
        lambda a: 1000.0,
        lambda: args,
        lambda: lambda name: _Timer(timer_reads, 2.0),
        emitted.append,
        MetricsFile(str(path)),
        side_losses,
        lambda: SimpleNamespace(add_scalar=lambda *scalar: scalars.append(scalar)),
        SimpleNamespace(news=lambda: " torch.compile: 9 graphs compiled (9 since the last line) in 3.2 s |"),
    )
    meter.last = {"model_flops": 3e12, "real_tokens": 150.0, "padded_tokens": 192.0}
    assert _log_call(log, 1, loss=2.123456789, grad_norm=torch.tensor(3.98581234)) == "report"
    assert not emitted and not timer_reads and side_losses == {}  # captured losses are cleared per iteration
    # iteration 2 closes a 2-iteration window: 250 TFLOP/s on each of 4 GPUs over 2 s
    meter.window = {"model_flops": 4 * 2.0 * 250e12, "real_tokens": 900.0, "padded_tokens": 1000.0}
    meter.window_iters = 2
    meter.last = {"model_flops": 1e12, "real_tokens": 50.0, "padded_tokens": 64.0}
    assert (
        log(
            {"lm loss": 1.5},
            {},
            2e-4,
            iteration=2,
            loss_scale=1.0,
            report_memory_flag=False,
            skipped_iter=0,
            grad_norm=1.25,
            params_norm=None,
            num_zeros_in_grad=None,
            max_attention_logit=None,
        )
        == "report"
    )
    assert calls == [1, 2] and timer_reads == [False]  # read, never reset: megatron's log resets it
    assert emitted == [
        " model FLOPs (flops.py): 250 TFLOP/s per GPU over 2 iterations | tokens/s: 450"
        " | padding: 10.0% | MFU: 25.0% of 1000 TFLOP/s dense bf16 |",
        " torch.compile: 9 graphs compiled (9 since the last line) in 3.2 s |",  # after a log line only
    ]
    assert meter.window_iters == 0 and meter.window_flops == 0.0
    # TensorBoard gets the line's rates at the log iteration
    assert [(name, step) for name, _, step in scalars] == [
        ("model TFLOP/s per GPU", 2),
        ("tokens per second", 2),
        ("padding percent", 2),
    ]
    assert [value for _, value, _ in scalars] == pytest.approx([250.0, 450.0, 10.0], rel=1e-12)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [
        {
            "iteration": 1,
            "learning rate": 1e-4,
            "grad norm": pytest.approx(3.98581234, rel=1e-7),
            "model_flops": 3e12,
            "real_tokens": 150.0,
            "padded_tokens": 192.0,
            "lm loss": 2.123456789,
            "mtp_1 loss": 0.25,
        },
        {
            "iteration": 2,
            "learning rate": 2e-4,
            "grad norm": 1.25,
            "model_flops": 1e12,
            "real_tokens": 50.0,
            "padded_tokens": 64.0,
            "lm loss": 1.5,
            "mtp_1 loss": 0.5,
        },
    ]
    assert records[0]["lm loss"] == 2.123456789  # full precision, not the log's 6 digits


def test_metrics_file_is_written_by_the_last_rank_only(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 4)
    args = SimpleNamespace(log_interval=100, world_size=4)
    for rank, written in ((0, False), (2, False), (3, True)):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, rank=rank, **k: rank)
        path = tmp_path / f"rank{rank}.jsonl"
        log = log_wrapper(
            _training_log_stub([]), StepFlops(), lambda a: None, lambda: args, None, None, MetricsFile(str(path))
        )
        _log_call(log, 7)
        assert path.exists() == written
    assert json.loads((tmp_path / "rank3.jsonl").read_text())["iteration"] == 7


def test_no_metrics_file_asks_no_rank(monkeypatch):
    def no_rank(*_a, **_k):
        raise AssertionError("the rank is asked only when there is a file to write")

    monkeypatch.setattr(torch.distributed, "get_rank", no_rank)
    args = SimpleNamespace(log_interval=100, world_size=1)
    for metrics in (None, MetricsFile(None)):
        log = log_wrapper(_training_log_stub([]), StepFlops(), lambda a: None, lambda: args, None, None, metrics)
        assert _log_call(log, 3) == "report"


def test_log_wrapper_reads_parameters_megatron_passes():
    from megatron.training import training as mt

    params = inspect.signature(mt.training_log).parameters
    assert {"loss_dict", "learning_rate", "iteration", "grad_norm"} <= set(params)


def test_capture_mtp_losses_keeps_the_iteration_and_adds_to_the_log_sums():
    seen = []

    def track_mtp_metrics(loss_scale, iteration, writer, wandb_writer=None, total_loss_dict=None):
        seen.append((loss_scale, iteration, writer, wandb_writer))
        total_loss_dict["mtp_1 loss"] = total_loss_dict.get("mtp_1 loss", 0.0) + torch.tensor(0.5) * loss_scale

    side_losses = {}
    track = capture_mtp_losses(track_mtp_metrics, side_losses)
    totals = {"lm loss": torch.tensor(1.0), "mtp_1 loss": torch.tensor(3.0)}  # running sums of earlier iterations
    assert track(2.0, 5, "writer", total_loss_dict=totals) is None
    assert seen == [(2.0, 5, "writer", None)]
    assert side_losses == {"mtp_1 loss": 1.0}  # this iteration alone
    assert float(totals["mtp_1 loss"]) == 4.0 and float(totals["lm loss"]) == 1.0
    track(1.0, 6, None, None, None)  # no running sums given: nothing to add to
    assert side_losses == {"mtp_1 loss": 0.5}

    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    assert tuple(inspect.signature(MTPLossLoggingHelper.track_mtp_metrics).parameters)[:5] == (
        "loss_scale",
        "iteration",
        "writer",
        "wandb_writer",
        "total_loss_dict",
    )


def test_the_rows_replace_megatron_trainings_functions():
    """The three rows of megatron_changes' group step-flops-and-log build the meter's functions, and
    train() looks both module functions up by name at call time, so the replacement takes effect."""
    from megatron.training import training as mt

    from examples.multimodal_dev.megatron_changes.applier import load
    from examples.multimodal_dev.megatron_changes.table import CHANGES

    for name in ("num_floating_point_operations", "training_log"):
        assert f"{name}(" in inspect.getsource(mt.train)
    run = SimpleNamespace(args=SimpleNamespace(metrics_file=None), meter=StepFlops())
    rows = [c for c in CHANGES if c.group == "step-flops-and-log"]
    assert len(rows) == 3
    for row in rows:
        assert load(row.replacement)(load(row.target), run).__module__ == throughput.__name__


def test_the_line_after_a_logged_first_iteration_averages_its_own_iteration_alone(mcore):
    """megatron keeps its sums after a run's first iteration (so a first interval of --log-interval N
    counts N): at N = 1 its second line averaged two iterations' losses, as megatron's stub below does
    without the wrapper's reset."""
    lines, timer_reads = [], []

    def megatron_like(loss_dict, total_loss_dict, learning_rate, iteration, *rest, is_first_iteration=False):
        total_loss_dict["advanced iterations"] = total_loss_dict.get("advanced iterations", 0) + 1
        for key, value in loss_dict.items():
            total_loss_dict[key] = total_loss_dict.get(key, torch.zeros(1)) + value
        lines.append(float(total_loss_dict["lm loss"]) / total_loss_dict["advanced iterations"])
        if not is_first_iteration:
            total_loss_dict.update({k: 0 if k == "advanced iterations" else torch.zeros(1) for k in total_loss_dict})
        return "report"

    def run(wrapped: bool) -> list[float]:
        lines.clear()
        log = megatron_like
        if wrapped:
            args = SimpleNamespace(log_interval=1, world_size=1)
            log = log_wrapper(
                megatron_like,
                StepFlops(),
                lambda a: None,
                lambda: args,
                lambda: lambda name: _Timer(timer_reads, 1.0),
                print,
            )
        totals = {}
        for iteration, loss in ((1, 9.0), (2, 8.0), (3, 7.0)):
            log(
                {"lm loss": torch.tensor(loss)},
                totals,
                1e-4,
                iteration,
                1.0,
                False,
                0,
                None,
                None,
                None,
                None,
                is_first_iteration=iteration == 1,
            )
        return list(lines)

    assert run(wrapped=False) == [9.0, 8.5, 7.0]  # megatron alone: the second line is the mean of two
    assert run(wrapped=True) == [9.0, 8.0, 7.0]
    assert True in timer_reads  # the interval timer restarted after the first line too
