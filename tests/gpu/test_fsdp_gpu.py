"""Check 7: Megatron-FSDP (``FSDP=1``) on the GPU through ``run_qwen35_vl.sh``: CUDA buffers, NCCL, bf16,
the path the CPU host replaces with its device layer. On one GPU the data-parallel group has one rank, so
nothing is sharded, but every FSDP hook, buffer and ``fsdp_dtensor`` save runs; with two GPUs visible
the run is DP=2 and its shards are real.

Model: tiny with 4 experts (MOE=1), bf16, SEQ_LEN 512, MBS 4, GBS 8, 4 iterations with evaluation at 2
and 4, a save at 4. Compared with the DDP run of the same seed (metrics files): lm loss and grad norm of
every iteration within 2e-2 relative (bf16: FSDP's gradients go through fp32 main-gradient buffers in
another order), as tests/distributed/test_fsdp.py checks in fp32 on CPU at 1e-5. A rehearsal on a CPU
(gpu_results.rehearsal) runs the same two launches there.
"""

import os
import tempfile

import gpu_results
import pytest
import torch

if not torch.cuda.is_available() and not gpu_results.rehearsal():
    pytest.skip("no CUDA device: GPU checks run on a GPU host (bash tests/gpu/run.sh)", allow_module_level=True)

import gpu_train as gt

CHECK = "Megatron-FSDP"
pytestmark = pytest.mark.gpu
MODEL = dict(MODEL_VARIANT="tiny", MOE=1, SEQ_LEN=512, MBS=4, GBS=8, TRAIN_ITERS=4)
FLAGS = ["--eval-interval", "2", "--eval-iters", "1"]
REL = 2e-2


def test_fsdp_trains_evaluates_and_saves_as_ddp(record):
    if gpu_results.deadline_left() < 80:  # two launches of the tiny model
        pytest.skip("out of tests/gpu/run.sh's time budget")
    nproc = max(1, min(2, gt.visible_gpus()))
    base = os.path.join(os.environ.get("GPU_CHECKS_SCRATCH") or tempfile.mkdtemp(prefix="gpu_checks_"), "fsdp")

    def run(name, **env):
        workdir = os.path.join(base, name)
        timeout = min(150, gpu_results.deadline_left() - 20)
        result = gt.run_training(
            name,
            {**MODEL, "NPROC": nproc, **env},
            FLAGS,
            timeout,
            workdir,
            os.path.join(workdir, "log.txt"),
            poll_memory=False,
        )
        if result.returncode != 0 or result.timed_out:
            print(f"---- {name} ----\n{result.tail()}")
        return result

    ddp = run("ddp")
    fsdp = run("fsdp", FSDP=1, CKPT_SAVE=os.path.join(base, "fsdp_ckpt"), SAVE_INTERVAL=4)
    case = f"tiny-moe bf16, DP={nproc}: FSDP vs DDP"
    for result, name in ((ddp, "DDP"), (fsdp, "FSDP")):
        if result.returncode != 0 or result.timed_out or sorted(result.records) != [1, 2, 3, 4]:
            why = (
                f"the {name} run was stopped by the time budget after {result.seconds:.0f} s"
                if result.timed_out
                else f"the {name} run failed: {result.error_line()}"
            )
            record(case, "fail", {"iterations": len(result.records)}, why)
            pytest.fail(why)
    rel = {
        key: max(abs(fsdp.records[i][key] - ddp.records[i][key]) / abs(ddp.records[i][key]) for i in range(1, 5))
        for key in ("lm loss", "grad norm")
    }
    saved = os.path.isdir(os.path.join(base, "fsdp_ckpt", "iter_0000004"))
    ok = max(rel.values()) <= REL and saved
    metrics = {f"worst rel {k}": v for k, v in rel.items()} | {"fsdp_dtensor save": saved}
    record(case, "pass" if ok else "fail", metrics, f"4 iterations, evaluation at 2 and 4; bar {REL} relative")
    assert ok, metrics
