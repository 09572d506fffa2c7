"""Run ``run_qwen35_vl.sh`` (or torchrun scripts) from tests and read back what they logged."""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|(?: mtp_1 loss: ([0-9.E+-]+) \|)?"
                  r" grad norm: ([0-9.]+)")
# real tokens of an iteration = tokens/s x seconds per iteration (log interval 1)
THROUGHPUT = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+) \|.*?tokens/s: (\d+) \|")
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")


class Run:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.returncode, self.output = proc.returncode, proc.stdout + proc.stderr
        logged = LOSS.findall(self.output)
        self.losses = {int(i): float(v) for i, v, _, _ in logged}
        self.mtp_losses = {int(i): float(m) for i, _, m, _ in logged if m}
        self.grad_norms = {int(i): float(g) for i, _, _, g in logged}
        self.tokens = {int(i): float(ms) / 1000 * int(rate) for i, ms, rate in THROUGHPUT.findall(self.output)}
        self.validation = {int(i): float(v) for i, v in VALID.findall(self.output)}

    def check(self) -> "Run":
        assert self.returncode == 0, f"run failed ({self.returncode}):\n{self.output[-4000:]}"
        return self


def run_script(extra_args=(), timeout: int = 600, **env) -> Run:
    full_env = {**os.environ, **{k: str(v) for k, v in env.items()}}
    full_env.setdefault("MASTER_PORT", str(29600 + os.getpid() % 300))
    proc = subprocess.run(["bash", os.path.join(ROOT, "run_qwen35_vl.sh"), *extra_args], env=full_env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return Run(proc)
