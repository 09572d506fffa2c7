"""Check 5: tensor and expert parallelism on GPUs (NCCL; EP with the alltoall token dispatcher,
which run_qwen35_vl.sh picks on GPU hosts) against one GPU, from one saved checkpoint.

Needs two visible GPUs; with fewer it records a row saying so. Model: tiny with 4 experts (MOE=1),
bf16, SEQ_LEN 512, MBS 4, GBS 8 (as tests/distributed/test_parallelism.py, which checks the same in
fp32 on CPU at 1e-5). Compared: the first iteration's lm loss and grad norm (metrics files), bar 2e-2
relative (bf16 GEMMs split over ranks round differently).
"""

import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU checks run on a GPU host (bash tests/gpu/run.sh)", allow_module_level=True)

import gpu_results
import gpu_train as gt

CHECK = "TP / EP on GPUs"
pytestmark = pytest.mark.gpu
MODEL = dict(MODEL_VARIANT="tiny", MOE=1, SEQ_LEN=512, MBS=4, GBS=8)
SETTINGS = {"TP=2 (SP)": dict(TP=2), "EP=2 alltoall": dict(EP=2, NPROC=2)}
REL = 2e-2


def test_tp2_and_ep2_match_one_gpu(record):
    gpus = gt.visible_gpus()
    if gpus < 2:
        record("TP=2, EP=2", "skip", {"visible GPUs": gpus}, f"{gpus} GPU visible: TP=2 and EP=2 need two")
        pytest.skip(f"{gpus} GPU visible")
    if gpu_results.deadline_left() < 150:
        pytest.skip("out of tests/gpu/run.sh's time budget")
    scratch = os.environ.get("GPU_CHECKS_SCRATCH") or tempfile.mkdtemp(prefix="gpu_checks_")
    base = os.path.join(scratch, "parallel")

    def run(name, **env):
        workdir = os.path.join(base, name.replace(" ", "_").replace("=", ""))
        timeout = min(150, gpu_results.deadline_left() - 20)
        result = gt.run_training(
            name, {**MODEL, **env}, [], timeout, workdir, os.path.join(workdir, "log.txt"), poll_memory=False
        )
        if result.returncode != 0 or 1 not in result.records:
            print(f"---- {name} ----\n{result.tail()}")
        return result

    start = os.path.join(base, "start_ckpt")
    first = run("start", TRAIN_ITERS=1, CKPT_SAVE=start)
    assert first.returncode == 0, first.error_line()
    single = run("single", TRAIN_ITERS=1, CKPT_LOAD=start)
    assert 1 in single.records, single.error_line()
    ok_all = True
    for name, env in SETTINGS.items():
        other = run(name, TRAIN_ITERS=1, CKPT_LOAD=start, **env)
        if 1 not in other.records:
            record(name, "fail", note=other.error_line())
            ok_all = False
            continue
        a, b = other.records[1], single.records[1]
        loss_rel = abs(a["lm loss"] - b["lm loss"]) / abs(b["lm loss"])
        grad_rel = abs(a["grad norm"] - b["grad norm"]) / abs(b["grad norm"])
        ok = loss_rel <= REL and grad_rel <= REL
        ok_all &= ok
        record(
            name,
            "pass" if ok else "fail",
            {
                "lm loss": a["lm loss"],
                "single lm loss": b["lm loss"],
                "loss rel": loss_rel,
                "grad norm": a["grad norm"],
                "single grad norm": b["grad norm"],
                "grad rel": grad_rel,
            },
            f"first iteration from one checkpoint; bar {REL:g} relative",
        )
    assert ok_all
