"""Model TFLOP/s and MFU in megatron.training's log, from ``models/qwen35_vl/flops.py``'s count of
the work done.

megatron.training prices an iteration with a closed-form GPT formula: no vision tower, attention
in every layer instead of Gated DeltaNet, ``seq_length`` tokens per sample for unpacked batches.
On a GPU, ``pretrain_multimodal.py`` installs two hooks instead:

- ``num_floating_point_operations`` returns the FLOPs the collate counted for the micro-batches
  of the iteration (real tokens and images only, summed over data-parallel ranks), so
  ``--log-throughput`` and the FLOPs total saved in checkpoints are this model's;
- after every ``--log-interval`` line, one more line gives model TFLOP/s per GPU and the MFU
  against the device's dense bf16 peak (``--peak-tflops`` overrides the table, 0 turns it off).

Both read megatron.training's own interval timer, so eval and checkpoint time stay out.
"""

from __future__ import annotations

import inspect
from typing import ClassVar

import torch

from examples.multimodal_dev.data.batch import PackedBatch
from examples.multimodal_dev.models import model_of
from examples.multimodal_dev.training.compile_once import CompileWatch

# Dense (no sparsity) bf16 tensor-core peak per GPU, TFLOP/s, from the vendors' data sheets.
# First match wins, so the more specific names come first.
PEAK_DENSE_BF16_TFLOPS = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
)


def device_peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """The peak to quote MFU against: ``override`` when given (0 means none), else the table's
    entry for this device name, else None (unknown device: MFU is not printed)."""
    if override is not None:
        if override < 0:
            raise ValueError(f"--peak-tflops {override}: must be >= 0 (0 turns MFU off)")
        return override or None
    for key, peak in PEAK_DENSE_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def batch_flops(shape, batch: PackedBatch):
    """Forward FLOPs of a collated batch (THD or BSHD), the model's ``FlopsBreakdown``: real lengths
    from the collate's stats, so padding is never counted as work."""
    grids = [g for grid in (batch.image_grid_thw, batch.video_grid_thw) if grid is not None for g in grid.tolist()]
    return model_of(shape).micro_batch_flops(shape, batch.stats.lengths, grids)


class StepFlops:
    """Model FLOPs and real / padded tokens of the training micro-batches, read off the collate's
    stats as the training loop draws them, summed per iteration and per log window."""

    _KEYS = ("model_flops", "real_tokens", "padded_tokens")
    # The run's meter (pretrain_multimodal.main), for the work of batches the step makes itself
    # (GRPO's drawn answers, which no collate counted): ``count_in_step``.
    of_run: ClassVar[StepFlops | None] = None

    def __init__(self):
        self.pending = dict.fromkeys(self._KEYS, 0.0)  # this rank's micro-batches since the last iteration
        self.pending_batches = 0
        self.window = dict.fromkeys(self._KEYS, 0.0)  # global sums over the iterations since the last log line
        self.window_iters = 0
        self.last = dict.fromkeys(self._KEYS, 0.0)  # global sums of the last iteration
        self.counted = True  # this rank's micro-batches add to the sums (tap)
        self.side_losses: dict = {}  # this iteration's auxiliary (MTP) losses, for the metrics file

    @property
    def window_flops(self) -> float:
        return self.window["model_flops"]

    def tap(self, iterator, counted: bool = True):
        """``iterator``'s micro-batches, their FLOPs added unless not ``counted`` (a rank that draws
        another's micro-batches, still joining every iteration's sums)."""
        self.counted = counted
        for batch in iterator:
            # a micro-batch without stats (ServedBatches, a test's stand-in) counts nothing
            self._add(getattr(batch, "stats", None) if counted else None)
            self.pending_batches += 1
            yield batch

    @classmethod
    def count_in_step(cls, stats) -> None:
        """A batch the step made counted in this iteration's sums, as a drawn micro-batch's stats are."""
        meter = cls.of_run
        if meter is not None and meter.counted:
            meter._add(stats)

    def _add(self, stats) -> None:
        for key in self._KEYS:
            self.pending[key] += getattr(stats, key, 0.0)

    def end_iteration(self) -> float:
        """Global model FLOPs of the iteration that just ended: every rank's micro-batches summed
        over the world, divided by the ranks that share a batch (TP x CP x PP)."""
        from megatron.core import parallel_state as ps

        device = "cuda" if torch.cuda.is_available() else "cpu"
        counting = float(self.counted)
        totals = torch.tensor([self.pending[k] for k in self._KEYS] + [counting], dtype=torch.float64, device=device)
        busiest = torch.tensor([self.pending["model_flops"]], dtype=torch.float64, device=device)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(totals)
            torch.distributed.all_reduce(busiest, op=torch.distributed.ReduceOp.MAX)
        totals, world = totals[:-1], totals[-1].item()  # the ranks that count
        shared = (
            ps.get_tensor_model_parallel_world_size()
            * ps.get_context_parallel_world_size()
            * ps.get_pipeline_model_parallel_world_size()
        )
        self.last = {k: v / shared for k, v in zip(self._KEYS, totals.tolist())}
        # Every rank of a data-parallel replica counts that replica's micro-batches, so the
        # world's mean per rank is the mean over data-parallel ranks.
        mean = totals[0].item() / world
        self.last["dp_imbalance"] = busiest.item() / mean if mean else 1.0
        self.pending, self.pending_batches = dict.fromkeys(self._KEYS, 0.0), 0
        for key in self._KEYS:
            self.window[key] += self.last[key]
        self.window["dp_imbalance"] = max(self.window.get("dp_imbalance", 1.0), self.last["dp_imbalance"])
        self.window_iters += 1
        return self.last["model_flops"]

    def window_mean(self) -> float:
        return self.window["model_flops"] / max(self.window_iters, 1)

    def take_window(self) -> dict:
        window = self.window
        self.window, self.window_iters = dict.fromkeys(self._KEYS, 0.0), 0
        return window


def flops_function(meter: StepFlops):
    """Stand-in for ``megatron.training.training.num_floating_point_operations``. The training
    loop calls it once per iteration (after drawing the iteration's micro-batches) and
    ``training_log`` once more on a log iteration: the first call ends the iteration, the second
    gets the window's mean FLOPs per iteration, which is what the log divides by the mean
    iteration time. Every rank draws the same number of micro-batches, so every rank takes the
    same branch (the first one is a collective)."""

    def num_floating_point_operations(args, batch_size, *_args, **_kwargs):
        return meter.end_iteration() if meter.pending_batches else meter.window_mean()

    return num_floating_point_operations


def window_rates(window: dict, seconds: float, world_size: int) -> dict:
    """Model TFLOP/s per GPU, real tokens per second and the padding percentage of a log window."""
    seconds = max(seconds, 1e-9)
    return {
        "model TFLOP/s per GPU": window["model_flops"] / seconds / world_size / 1e12,
        "tokens per second": window["real_tokens"] / seconds,
        "padding percent": 100 * (1 - window["real_tokens"] / max(window["padded_tokens"], 1)),
    }


def throughput_line(window: dict, iterations: int, seconds: float, world_size: int, peak: float | None) -> str:
    rates = window_rates(window, seconds, world_size)
    per_gpu = rates["model TFLOP/s per GPU"]
    line = (
        f" model FLOPs (flops.py): {per_gpu:.4g} TFLOP/s per GPU over {iterations} iterations"
        f" | tokens/s: {rates['tokens per second']:.0f} | padding: {rates['padding percent']:.1f}%"
    )
    if "dp_imbalance" in window:
        line += f" | DP imbalance (max/mean FLOPs, worst step): {window['dp_imbalance']:.3f}"
    if peak:
        line += f" | MFU: {100 * per_gpu / peak:.1f}% of {peak:.0f} TFLOP/s dense bf16"
    return line + " |"


class MetricsFile:
    """One JSON line per iteration, full precision (the log prints 6 digits and a 3-decimal grad
    norm): what tests and tools compare runs with. Written by the last rank, as megatron logs."""

    def __init__(self, path: str | None):
        self.path = path

    def write(self, record: dict) -> None:
        if not self.path:
            return
        import json

        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _scalar(value):
    return float(value.item() if hasattr(value, "item") else value) if value is not None else None


def log_wrapper(
    original,
    meter: StepFlops,
    peak_of,
    get_args,
    get_timers,
    emit,
    metrics: MetricsFile | None = None,
    side_losses: dict | None = None,
    get_writer=lambda: None,
    compiles=None,
):
    """``training_log`` that records every iteration in ``metrics`` and, on every
    ``--log-interval`` iteration, also emits ``throughput_line`` (``peak_of(args)``: the MFU peak,
    or None) and writes its rates to TensorBoard (``get_writer()``, None where megatron has no
    writer). The interval timer is read (not reset) before megatron's own log resets it.
    ``side_losses``: per-iteration auxiliary losses (MTP) captured for the metrics file. ``compiles``:
    a ``compile_once.CompileWatch``, whose line follows a log line when torch.compile compiled since."""
    names = list(inspect.signature(original).parameters)

    def training_log(*args, **kwargs):
        bound = dict(zip(names, args), **kwargs)
        iteration = bound["iteration"]
        margs = get_args()
        at_log = iteration % margs.log_interval == 0
        seconds = get_timers()("interval-time").elapsed(reset=False, barrier=True) if at_log else 0.0
        result = original(*args, **kwargs)
        if (
            metrics is not None
            and metrics.path
            and torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
        ):
            record = {
                "iteration": iteration,
                "learning rate": _scalar(bound.get("learning_rate")),
                "grad norm": _scalar(bound.get("grad_norm")),
                **meter.last,
            }
            record.update({k: _scalar(v) for k, v in (bound.get("loss_dict") or {}).items()})
            record.update(side_losses or {})
            metrics.write(record)
        if side_losses is not None:
            side_losses.clear()
        if at_log:
            iterations, window = meter.window_iters, meter.take_window()
            emit(throughput_line(window, iterations, seconds, margs.world_size, peak_of(margs)))
            if hidden := negative_values(bound.get("loss_dict") or {}):
                emit(hidden)
            compiled = compiles.news() if compiles is not None else None
            if compiled:
                emit(compiled)
            writer = get_writer()
            if writer is not None:
                for name, value in window_rates(window, seconds, margs.world_size).items():
                    writer.add_scalar(name, value, iteration)
        if at_log and bound.get("is_first_iteration"):
            _start_next_interval(bound.get("total_loss_dict"), get_timers)
        return result

    return training_log


def negative_values(loss_dict: dict) -> str | None:
    """The line of the reported values below zero (DPO's reward margin), which megatron's log line
    leaves out; None where there are none. This iteration's values (the metrics file has every one)."""
    below = {k: value for k, v in loss_dict.items() if (value := _scalar(v)) is not None and value < 0}
    if not below:
        return None
    shown = " | ".join(f"{k}: {v:.6E}" for k, v in below.items())
    return f" {shown} | (iteration's values below 0, which megatron's line leaves out)"


def _start_next_interval(total_loss_dict: dict | None, get_timers) -> None:
    """What megatron's ``training_log`` resets after a logged line and keeps after a run's first iteration
    (so that a first interval of ``--log-interval`` N still counts N): at a first iteration that is
    itself a log line (N = 1, the run script's default) the next line would average two iterations'
    losses and times, so the sums and the interval timer start again here."""
    if total_loss_dict is not None:
        for key, value in total_loss_dict.items():
            total_loss_dict[key] = torch.zeros_like(value) if torch.is_tensor(value) else 0
    get_timers()("interval-time").elapsed(reset=True, barrier=False)


def capture_mtp_losses(original, side_losses: dict):
    """``MTPLossLoggingHelper.track_mtp_metrics`` that also keeps this iteration's reduced MTP
    losses (megatron adds them into the log's running sums, where one iteration is lost)."""

    def track_mtp_metrics(loss_scale, iteration, writer, wandb_writer=None, total_loss_dict=None, *args, **kwargs):
        fresh: dict = {}
        original(loss_scale, iteration, writer, wandb_writer, fresh, *args, **kwargs)
        side_losses.update({k: _scalar(v) for k, v in fresh.items()})
        if total_loss_dict is not None:
            for key, value in fresh.items():
                total_loss_dict[key] = total_loss_dict.get(key, 0.0) + value
        return None

    return track_mtp_metrics


def peak_for_args(args) -> float | None:
    """MFU peak of this process's GPU under ``--peak-tflops``."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return device_peak_tflops(name, getattr(args, "peak_tflops", None))


def _expect_parameters(function, needed: tuple[str, ...]) -> None:
    if not all(p in inspect.signature(function).parameters for p in needed):
        raise RuntimeError(
            f"megatron.training.training.{function.__name__} no longer takes {needed}; "
            "the throughput rows of megatron_changes need updating for this megatron-core"
        )


# megatron_changes rows (group step-flops-and-log): ``run`` holds the run's args and its StepFlops meter.


def counted_flops(original, run):
    """megatron.training's FLOPs count of a step, from ``run.meter``."""
    _expect_parameters(original, ("args", "batch_size"))
    return flops_function(run.meter)


def logged_step(original, run):
    """megatron.training's ``training_log`` with the throughput line and the metrics file."""
    from megatron.training import get_args, get_tensorboard_writer, get_timers
    from megatron.training.utils import print_rank_last

    _expect_parameters(original, ("iteration",))
    return log_wrapper(
        original,
        run.meter,
        peak_for_args,
        get_args,
        get_timers,
        print_rank_last,
        MetricsFile(getattr(run.args, "metrics_file", None)),
        run.meter.side_losses,
        get_tensorboard_writer,
        CompileWatch(),
    )


def captured_mtp_losses(original, run):
    """MTPLossLoggingHelper's ``track_mtp_metrics`` that also keeps the iteration's MTP losses."""
    return capture_mtp_losses(original, run.meter.side_losses)
