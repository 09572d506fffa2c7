"""Run ``run_qwen35_vl.sh`` (torchrun, megatron.training) from tests and read back what it recorded.

Figures come from the run's metrics file (``--metrics-file``: one JSON line per iteration, full
precision), not from the log's 6-digit loss and 3-decimal grad norm.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import tempfile
import time

from warm_engine import IMPORT_TIME

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_LOSS = ("lm loss", "dpo loss", "grpo loss")
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, records: list[dict]):
        self.returncode, self.output = proc.returncode, proc.stdout + proc.stderr
        self.records = {r["iteration"]: r for r in records if "iteration" in r}
        self.gen_eval = {r["gen_eval_iteration"]: r for r in records if "gen_eval_iteration" in r}
        # the step's loss: the answers' (sft), the pairs' (dpo) or the drawn answers' (grpo)
        self.losses = {
            i: next(r[k] for k in STEP_LOSS if k in r) for i, r in self.records.items() if set(STEP_LOSS) & set(r)
        }
        self.mtp_losses = {i: r["mtp_1 loss"] for i, r in self.records.items() if "mtp_1 loss" in r}
        self.grad_norms = {i: r["grad norm"] for i, r in self.records.items() if r.get("grad norm") is not None}
        self.tokens = {i: r["real_tokens"] for i, r in self.records.items()}
        self.validation = {int(i): float(v) for i, v in VALID.findall(self.output)}

    def check(self) -> "Run":
        assert self.returncode == 0, f"run failed ({self.returncode}):\n{self.output[-6000:]}"
        return self


HOOKS = os.path.join(ROOT, "tests", "hooks")

# The model every parallel-vs-single comparison trains: tiny MoE with the MTP head, fp32, THD;
# those runs compare training steps only, so they skip the closing evaluation.
PARALLEL_MODEL = dict(MOE=1, MTP=1, SEQ_LEN=512)
NO_EVAL = ("--eval-iters", "0")
# ... with the layouts' batches: THD micro-batches of 4 samples, 8 a step
LAYOUT_MODEL = dict(PARALLEL_MODEL, MBS=4, GBS=8)


class WarmEngine:
    """This test process's warm engine (``tests/warm_engine.py``), started at its first launch: every
    launch forks from it rather than import torch and megatron-core again (about 8 s of CPU a rank).
    It lives as long as this process (it stops when its stdin closes)."""

    address = None

    @classmethod
    def get(cls) -> str:
        if cls.address is not None and cls.server.poll() is not None:
            # every later launch would start cold, slower but passing: a test ended a process not its own
            raise RuntimeError(
                f"the tests' warm engine ended (status {cls.server.returncode}) while its tests ran:\n{cls.log_tail()}"
            )
        if cls.address is None:
            folder = tempfile.mkdtemp(prefix="warm_engine_")
            address, log = os.path.join(folder, "socket"), open(os.path.join(folder, "log"), "w")
            cls.log = log.name
            # started as run_qwen35_vl.sh starts its launcher: the environment tools/bootstrap_env.sh makes;
            # a session of its own, out of reach of a test that signals its own process group
            cls.server = subprocess.Popen(
                [
                    "bash",
                    "-c",
                    'source tools/bootstrap_env.sh && exec "$PY" -u tests/warm_engine.py "$0"',
                    address,
                ],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            deadline = time.monotonic() + 300
            while not os.path.exists(address):
                if cls.server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the warm engine did not start:\n{open(log.name).read()[-3000:]}")
                time.sleep(0.1)
            cls.address = address
            atexit.register(cls._stop, folder)
        return cls.address

    @classmethod
    def log_tail(cls) -> str:
        """The end of the server's own output (what it said while starting or failing)."""
        with open(cls.log) as f:
            return f.read()[-3000:]

    @classmethod
    def _stop(cls, folder: str) -> None:
        cls.server.stdin.close()  # the server's signal to end
        try:
            cls.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            cls.server.kill()
        shutil.rmtree(folder, ignore_errors=True)


def on_warm_engine(env: dict) -> dict:
    """``env`` (a whole environment) with its launches handed to this process's warm engine: the server's
    socket, and the hook that hands a torchrun launcher over to it on PYTHONPATH."""
    return {**env, "ENGINE_SERVER": WarmEngine.get(), "PYTHONPATH": HOOKS + os.pathsep + env.get("PYTHONPATH", "")}


def run_script(extra_args=(), timeout: int = 600, **env) -> Run:
    """``bash run_qwen35_vl.sh extra_args`` with ``env``, forked from this process's warm engine unless
    ``ENGINE_SERVER=""`` (a cold start, as a user's); the warm engine's hand-over and the variables of
    ``tests/hooks/sitecustomize.py`` (fault injection, FLA's kernels) put that folder on PYTHONPATH."""
    env.setdefault("ENGINE_SERVER", WarmEngine.get())
    full_env = {**os.environ, **{k: str(v) for k, v in env.items()}}
    if env["ENGINE_SERVER"] or {
        "KILL_DURING_SAVE_AT",
        "KILL_NODE_AT",
        "NODE_LOCAL_SAVE",
        "RECORD_PIPELINE",
        "FULL_DISK_AT",
        "MEGATRON_CPU_FLA",
        "VISION_GRAD_NORMS",
        "CUT_VISION_GRAD",
    } & set(env):
        full_env["PYTHONPATH"] = HOOKS + os.pathsep + full_env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory(prefix="run_metrics_") as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        proc = subprocess.run(
            ["bash", os.path.join(ROOT, "run_qwen35_vl.sh"), *extra_args, "--metrics-file", metrics],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            start_new_session=True,
        )  # its own process group (see tests/hooks)
        records = []
        if os.path.exists(metrics):
            with open(metrics) as f:
                records = [json.loads(line) for line in f if line.strip()]
    run = Run(proc, records)
    # a launch the warm engine refuses starts cold, slower but otherwise the same: only one that sets an
    # import-time variable of its own may (a refusal of any other says the tests' engine has drifted)
    if "does not run this launch" in run.output and not any(k.startswith(IMPORT_TIME) for k in env):
        raise AssertionError(
            f"the warm engine refused a launch that sets no import-time variable:\n{run.output[:3000]}"
        )
    if env["ENGINE_SERVER"] and "no warm engine answers" in run.output:
        WarmEngine.get()  # says how it ended where it did
        raise AssertionError(f"the tests' warm engine did not answer:\n{run.output[-3000:]}")
    return run


def run_recording_vision_norms(directory, name, flags=NO_EVAL, **env):
    """A run that records the vision tower's grad norms (``tests/hooks``): (run, the tower's grad norm
    by iteration). Ranks 0 .. VISION_TP-1 hold one copy of the tower: its TP-split weights' squares
    from each, the others' from rank 0; where the distributed optimizer shards the tower's gradients
    over its data-parallel ranks (the tower on VISION_NPROC ranks of its own), every rank's shard."""
    record = directory / f"{name}.vision_norms"
    run = run_script(flags, VISION_GRAD_NORMS=record, **env).check()
    vtp, vnproc = int(env.get("VISION_TP", env.get("TP", 1))), int(env.get("VISION_NPROC", 0))
    steps = [[json.loads(line) for line in open(f"{record}.{r}")] for r in range(max(vtp, vnproc))]
    if steps[0][0]["sharded"]:  # each rank's shard: every rank's split, the whole weights of TP rank 0s
        if not vnproc:
            raise NotImplementedError("the tower's sharded gradients on the language model's ranks")
        return run, {
            i + 1: sum(rank[i]["split"] + (rank[i]["whole"] if r % vtp == 0 else 0.0) for r, rank in enumerate(steps))
            ** 0.5
            for i in range(len(steps[0]))
        }
    squares = [steps[0][i]["whole"] + sum(rank[i]["split"] for rank in steps[:vtp]) for i in range(len(steps[0]))]
    return run, {i + 1: sq**0.5 for i, sq in enumerate(squares)}


def stopped_at(saved, target, iteration: int):
    """A copy of the checkpoint directory ``saved`` that ends at its checkpoint of ``iteration``, as a run
    stopped there leaves it: a straight run that also saved that step stands in for the stopped run."""
    later = [p.name for p in saved.glob("iter_*") if int(p.name[len("iter_") :]) > iteration]
    assert (saved / f"iter_{iteration:07d}").is_dir(), f"{saved} has no checkpoint of iteration {iteration}"
    shutil.copytree(saved, target, ignore=lambda folder, names: later if folder == str(saved) else [])
    (target / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return target
