"""Log lines in megatron.training's format, a progress bar on a terminal, and TensorBoard."""

from __future__ import annotations

import math
import sys
import time


class Reporter:
    def __init__(self, args, start_iteration: int, is_logging_rank: bool):
        self.args, self.active = args, is_logging_rank
        self.window = {"loss_sum": 0.0, "tokens": 0.0, "real_tokens": 0, "padded_tokens": 0, "iters": 0, "grad_norm": 0.0,
                       "flops": 0.0}
        self.extra_window: dict[str, list[float]] = {}  # auxiliary losses (MTP), averaged per window
        self.window_start = time.perf_counter()
        self.excluded = 0.0  # seconds of evaluation / checkpointing inside the window
        self.writer = None
        if self.active and args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)
        self.bar = None
        if self.active and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=args.train_iters, initial=start_iteration, unit="it", dynamic_ncols=True)

    def train_step(self, iteration: int, loss_sum: float, tokens: float, grad_norm: float, lr: float,
                   real_tokens: int, padded_tokens: int, extra: dict[str, float] | None = None,
                   flops_per_device: float = 0.0) -> None:
        """``flops_per_device``: model FLOPs (forward + backward) of this step per device, from the
        collate's accounting of real tokens and images (``flops.py``); 0 when not reported."""
        w = self.window
        w["flops"] += flops_per_device
        for name, value in (extra or {}).items():
            self.extra_window.setdefault(name, []).append(value)
            if self.writer is not None:
                self.writer.add_scalar(name, value, iteration)
        w["loss_sum"] += loss_sum
        w["tokens"] += tokens
        w["grad_norm"] = grad_norm
        w["real_tokens"] += real_tokens
        w["padded_tokens"] += padded_tokens
        w["iters"] += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss_sum / max(tokens, 1):.4f}")
        if self.writer is not None:
            self.writer.add_scalar("lm loss", loss_sum / max(tokens, 1), iteration)
            self.writer.add_scalar("grad-norm", grad_norm, iteration)
            self.writer.add_scalar("learning-rate", lr, iteration)
        if iteration % self.args.log_interval == 0 or iteration == self.args.train_iters:
            self._print_window(iteration, lr)

    def _print_window(self, iteration: int, lr: float) -> None:
        w, args = self.window, self.args
        elapsed = max(time.perf_counter() - self.window_start - self.excluded, 1e-9)
        throughput = ""
        if w["flops"]:
            tflops = w["flops"] / elapsed / 1e12
            throughput = f" | model TFLOP/s per device: {tflops:.4f}"
            if peak := getattr(args, "peak_tflops", None):
                throughput += f" | MFU: {100 * tflops / peak:.2f}% of {peak:g} TFLOP/s"
        line = (f" iteration {iteration:8d}/{args.train_iters:8d} | consumed samples: {args.consumed_train_samples:12d}"
                f" | elapsed time per iteration (ms): {1000 * elapsed / max(w['iters'], 1):.1f}"
                f" | learning rate: {lr:.6E} | global batch size: {args.global_batch_size:5d}"
                f" | lm loss: {w['loss_sum'] / max(w['tokens'], 1):.6E}"
                + "".join(f" | {name}: {sum(v) / len(v):.6E}" for name, v in self.extra_window.items())
                + f" | grad norm: {w['grad_norm']:.6f}"
                f" | tokens/s: {w['real_tokens'] / elapsed:.0f}"
                + throughput
                + f" | padding: {100 * (1 - w['real_tokens'] / max(w['padded_tokens'], 1)):.1f}% |")
        if self.writer is not None:
            self.writer.add_scalar("tokens-per-second", w["real_tokens"] / elapsed, iteration)
        self._emit(line)
        self.window = {k: 0 for k in w}
        self.extra_window = {}
        self.window_start = time.perf_counter()
        self.excluded = 0.0

    def exclude(self, seconds: float) -> None:
        """Keep evaluation and checkpoint time out of the per-iteration time and tokens/s."""
        self.excluded += seconds

    def validation(self, iteration: int, loss: float) -> None:
        ppl = math.exp(min(20.0, loss))
        text = f"validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"
        bar = "-" * (len(text) + 1)
        self._emit(f"{bar}\n {text}\n{bar}")
        if self.writer is not None:
            self.writer.add_scalar("lm loss validation", loss, iteration)

    def _emit(self, text: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
