"""``FSDP=1`` (Megatron-FSDP) against DDP on two data-parallel ranks, from the same seed: the same losses
and grad norms with evaluation on, a save that completes (it hung: ``checkpoint/fsdp_state.py``), and
an exact resume; what FSDP does not run with, refused by name before launch."""

import re

import pytest
from launch import run_script

FLAGS = ["--eval-interval", "2", "--eval-iters", "1"]
COMMON = dict(NPROC=2, TRAIN_ITERS=4, SEQ_LEN=512, GBS=4)
FP32_REL = 1e-5  # two reductions of one sum in another order


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= FP32_REL * max(abs(a), abs(b), 1e-12)


def test_fsdp_trains_evaluates_saves_and_resumes_as_ddp(tmp_path):
    ddp = run_script(FLAGS, **COMMON).check()
    fsdp = run_script(FLAGS, FSDP=1, CKPT_SAVE=tmp_path / "straight", SAVE_INTERVAL=2, **COMMON).check()
    assert re.search(r"use_megatron_fsdp \.+ True", fsdp.output) and "in fsdp_dtensor format" in fsdp.output
    for i in range(1, 5):
        assert _close(fsdp.losses[i], ddp.losses[i]) and _close(fsdp.grad_norms[i], ddp.grad_norms[i]), (
            i,
            fsdp.losses,
            ddp.losses,
            fsdp.grad_norms,
            ddp.grad_norms,
        )
    assert fsdp.validation.keys() == ddp.validation.keys() == {2, 4}
    assert all(_close(fsdp.validation[i], ddp.validation[i]) for i in (2, 4)), (fsdp.validation, ddp.validation)
    resumed_dir = tmp_path / "resumed"
    first = run_script([*FLAGS, "--exit-interval", "2"], FSDP=1, CKPT_RESUME=resumed_dir, **COMMON).check()
    second = run_script(FLAGS, FSDP=1, CKPT_RESUME=resumed_dir, **COMMON).check()
    assert sorted(first.losses) == [1, 2] and sorted(second.losses) == [3, 4]
    for i in (3, 4):  # the same run, continued: bitwise
        assert second.losses[i] == fsdp.losses[i] and second.grad_norms[i] == fsdp.grad_norms[i], i


@pytest.mark.parametrize(
    "env,line",
    [
        (dict(PP=2, NPROC=2), "FSDP=1 with PP=2: its fsdp_dtensor checkpoints name layers per pipeline stage"),
        (dict(LORA_RANK=4, NPROC=2), "FSDP=1 with LORA_RANK=4: LoRA checkpoints are torch_dist"),
        (dict(VISION_NPROC=1, NPROC=3), "FSDP=1 with VISION_NPROC=1: the tower's own ranks save torch_dist"),
    ],
)
def test_what_fsdp_does_not_run_with_is_refused_before_launch(env, line):
    run = run_script(FSDP=1, DRY_RUN=1, **env)
    assert run.returncode == 2 and line in run.output, run.output[-2000:]
