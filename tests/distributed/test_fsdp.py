"""``FSDP=1`` (Megatron-FSDP) against DDP from the same seed: the same losses and grad norms over several
iterations with evaluation on, at DP=2 and with TP, CP, EP and ``--freeze-vision`` beside it; a save that
completes (it hung: ``checkpoint/fsdp_state.py``); an exact resume, and a resume at another DP size; an
import in its format (``convert_checkpoint import --ckpt-format fsdp_dtensor``) that trains and exports
back bitwise; what FSDP does not run with, refused by name."""

import re
import shutil

import pytest
import torch
from hf_checkpoints import write_hf_checkpoint
from launch import NO_EVAL, run_script

from examples.multimodal_dev.checkpoint.hf_safetensors import HFTensorSource
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.tools.convert_checkpoint import main as convert

FLAGS = ["--eval-interval", "2", "--eval-iters", "1"]
COMMON = dict(NPROC=2, TRAIN_ITERS=4, SEQ_LEN=512, GBS=4)
FP32_REL = 1e-5  # two reductions of one sum in another order


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= FP32_REL * max(abs(a), abs(b), 1e-12)


def _same_training(fsdp, ddp, iterations) -> None:
    for i in iterations:
        assert _close(fsdp.losses[i], ddp.losses[i]) and _close(fsdp.grad_norms[i], ddp.grad_norms[i]), (
            i,
            fsdp.losses,
            ddp.losses,
            fsdp.grad_norms,
            ddp.grad_norms,
        )


def test_fsdp_trains_evaluates_saves_and_resumes_as_ddp(tmp_path):
    ddp = run_script(FLAGS, **COMMON).check()
    fsdp = run_script(FLAGS, FSDP=1, CKPT_SAVE=tmp_path / "straight", SAVE_INTERVAL=2, **COMMON).check()
    assert re.search(r"use_megatron_fsdp \.+ True", fsdp.output) and "in fsdp_dtensor format" in fsdp.output
    _same_training(fsdp, ddp, range(1, 5))
    # every evaluation, the last one's validation and test sets too: each rank's batch has images,
    # videos or neither, and the tower still runs once per forward on each (models/base.py)
    assert fsdp.validation.keys() == ddp.validation.keys() == {2, 4}
    assert "validation loss at iteration 4 on test set" in fsdp.output, fsdp.output[-3000:]
    assert all(_close(fsdp.validation[i], ddp.validation[i]) for i in ddp.validation), (fsdp.validation, ddp.validation)
    # a fresh run given a --load with no checkpoint trains as one without (checkpoint/fsdp_state.py), and a
    # resume continues it bitwise
    resumed = tmp_path / "resumed"
    first = run_script([*FLAGS, "--exit-interval", "2"], FSDP=1, CKPT_RESUME=resumed, **COMMON).check()
    second = run_script(FLAGS, FSDP=1, CKPT_RESUME=resumed, **COMMON).check()
    assert sorted(first.losses) == [1, 2] and sorted(second.losses) == [3, 4]
    for i in range(1, 5):
        run = first if i <= 2 else second
        assert run.losses[i] == fsdp.losses[i] and run.grad_norms[i] == fsdp.grad_norms[i], i
    # the straight run's step-2 checkpoint, resumed by one rank: the same global batches
    one_rank = tmp_path / "one_rank"
    shutil.copytree(tmp_path / "straight" / "iter_0000002", one_rank / "iter_0000002")
    (one_rank / "latest_checkpointed_iteration.txt").write_text("2")
    dp1 = run_script(NO_EVAL, FSDP=1, CKPT_RESUME=one_rank, **{**COMMON, "NPROC": 1}).check()
    assert sorted(dp1.losses) == [3, 4]
    _same_training(dp1, fsdp, (3, 4))


@pytest.mark.parametrize(
    "layout,flags",
    [
        (dict(NPROC=4, TP=2, MOE=1, EP=2), ()),
        (dict(NPROC=2, CP=2, MOE=1, EP=2), ("--freeze-vision",)),
    ],
    ids=["TP=2 x DP=2, EP=2", "CP=2, EP=2, frozen tower"],
)
def test_fsdp_with_other_layouts_trains_as_ddp(layout, flags):
    common = dict(TRAIN_ITERS=3, SEQ_LEN=512, GBS=4, **layout)
    ddp = run_script((*NO_EVAL, *flags), **common).check()
    fsdp = run_script((*NO_EVAL, *flags), FSDP=1, **common).check()
    _same_training(fsdp, ddp, range(1, 4))


def test_an_import_in_fsdp_format_trains_and_exports_back_bitwise(tmp_path):
    """docs/parallelism.md's commands: import for FSDP, a run from it (LR=0: its step leaves the weights
    as they were), export; and a run without FSDP refusing that checkpoint with how to move it."""
    hf, imported, saved, out = (tmp_path / n for n in ("hf", "imported", "saved", "out"))
    write_hf_checkpoint(hf, get_variant("tiny", moe=True, mtp=True), dtype=torch.float32, experts_per_expert=True)
    assert (
        convert(["import", "--hf-path", str(hf), "--megatron-path", str(imported), "--ckpt-format", "fsdp_dtensor"])
        == 0
    )
    run_script(
        NO_EVAL, FSDP=1, CKPT_LOAD=imported, CKPT_SAVE=saved, MTP=1, LR=0, **{**COMMON, "TRAIN_ITERS": 1}
    ).check()
    assert convert(["export", "--megatron-path", str(saved), "--hf-path", str(out)]) == 0
    original, back = HFTensorSource(str(hf)), HFTensorSource(str(out))
    assert back.names == original.names
    for name in sorted(original.names):
        a, b = original.get(name), back.get(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    refused = run_script(NO_EVAL, NPROC=1, CKPT_LOAD=imported, MOE=1, MTP=1, TRAIN_ITERS=1, SEQ_LEN=512)
    line = (
        f"{imported}: saved in fsdp_dtensor format, which megatron-core 0.19.2 does not read into a run without "
        f"FSDP; move its weights with convert_checkpoint export --megatron-path {imported} --hf-path HF, then "
        "import --hf-path HF --megatron-path NEW --ckpt-format torch_dist, and start from NEW (CKPT_LOAD)"
    )
    assert refused.returncode != 0 and line in refused.output, refused.output[-3000:]


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
