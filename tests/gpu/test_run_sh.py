"""CPU check of tests/gpu/run.sh's own plumbing (not marked gpu: it runs in the normal suite). On a
host without CUDA every group's pytest skips, which is enough to check what a GPU run relies on: the
groups run together start side by side and each still gets its own "no test ran" row, their rows
and outputs come back in the order they started, the ones run alone follow, and the table is
written with every step's exit in its header."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOGETHER = ["model parity fp32 tiny", "model parity fp32 wide", "model parity bf16 tiny", "model parity bf16 wide"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host the groups would run for real")
def test_groups_run_together_then_alone(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_")}
    env.update(OUT=str(out), GPU_CHECKS_SCRATCH=str(scratch), GPU_CHECKS="parity train", PYTHON=sys.executable)
    env.pop("WHEELHOUSE", None)
    done = subprocess.run(["bash", "tests/gpu/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    result = json.loads((out / "results.json").read_text())
    checks = [row["check"] for row in result["rows"] if row["status"] == "skip"]
    assert checks[-5:] == [*TOGETHER, "training"]  # one row each, in launch order, the alone one after
    assert all("no test ran" in row["note"] for row in result["rows"][-5:])
    steps = result["meta"]["steps"]
    assert all(f"{name}: " in steps and " exit 5" in steps for name in [*TOGETHER, "training"]), steps

    log = (out / "run.log").read_text()
    started = [log.index(f"== [gpu] {name}: started beside the others") for name in TOGETHER]
    outputs = [log.index(f"== [gpu] {name} (timeout") for name in TOGETHER]
    # every launch is announced before any output comes back, and the outputs keep the launch order
    assert max(started) < min(outputs) and outputs == sorted(outputs)
    assert log.index("== [gpu] training (timeout") > max(outputs)
