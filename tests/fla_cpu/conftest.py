"""FLA runs only in processes these tests start (``fla_worker.py``, training runs): Triton's interpreter,
FLA from ``.fla/lib``, ``MEGATRON_CPU_FLA=1``. The test process is the training environment and never
imports FLA."""

import os
import subprocess
import sys

import fla_install
import pytest
import torch
import triton_interpreter
from fla_worker import SKIP

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)


@pytest.fixture(scope="session")
def fla_env():
    """The environment of a process that runs FLA: ``.fla/lib`` first on PYTHONPATH, Triton's interpreter,
    ``MEGATRON_CPU_FLA=1``. Skips with the reason when FLA is not installed or this Triton lacks what the
    interpreter changes need."""
    reason = fla_install.missing_reason() or triton_interpreter.unsupported_reason()
    if reason:
        pytest.skip(reason)
    return {"TRITON_INTERPRET": "1", "MEGATRON_CPU_FLA": "1", "PYTHONPATH": _path(fla_install.LIB)}


def _path(*folders) -> str:
    return os.pathsep.join(p for p in (*folders, os.environ.get("PYTHONPATH", "")) if p)


@pytest.fixture(scope="session")
def fla_worker(fla_env, tmp_path_factory):
    """run(mode, inputs) -> the worker's results (see fla_worker.py)."""
    folder = tmp_path_factory.mktemp("fla_worker")

    def run(mode: str, inputs: dict) -> dict:
        inputs_path, results_path = folder / f"{mode}_inputs.pt", folder / f"{mode}_results.pt"
        torch.save(inputs, inputs_path)
        env = {**os.environ, **fla_env, "PYTHONPATH": _path(fla_install.LIB, fla_install.ROOT, TESTS)}
        proc = subprocess.run(
            [sys.executable, os.path.join(HERE, "fla_worker.py"), mode, str(inputs_path), str(results_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if proc.returncode == SKIP:
            pytest.skip(proc.stdout.strip().splitlines()[-1])
        assert proc.returncode == 0, f"fla_worker.py {mode} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        return torch.load(results_path)

    return run
