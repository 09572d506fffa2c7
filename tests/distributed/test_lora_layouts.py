"""LoRA through ``run_qwen35_vl.sh`` (``LORA_RANK``) on the tiny MoE model with the MTP head, fp32:
adapters on every linear of the decoder (attention, Gated DeltaNet, the routed and shared experts).

- From a base checkpoint (``parallel_start``: no adapters) a LoRA run starts: the adapters start at
  ``B = 0``, so its first loss is the base model's, and its checkpoint holds the base weights
  bitwise as they were, plus adapters that moved.
- From that LoRA checkpoint every layout tracks the single process (the bounds of
  ``test_parallelism.py``): TP with SP, EP, the experts split over TP or not, CP, DP with the
  distributed optimizer, PP; and the routed experts' adapters on SequentialMLP's linears track
  them on the grouped experts (the run script's default, which every other run here takes).
- A LoRA checkpoint as the run script saves it (optimizer state and all) leaves as docs/lora.md
  shows: merged, and as a PEFT adapter that ``peft`` loads onto the base's export.
"""

import os
import shutil

import pytest
from checkpoint_diff import entries, state_differences
from launch import LAYOUT_MODEL as MODEL
from launch import NO_EVAL, run_script
from lora_exports import peft_equals_merged
from test_parallelism import assert_tracks

from examples.multimodal_dev.tools.convert_checkpoint import main

LORA = dict(LORA_RANK=4, LORA_ALPHA=8)

# name -> (environment, iterations, extra flags)
LAYOUTS = {
    "TP=2 SP EP=2 ETP=1": (dict(TP=2, EP=2, ETP=1), 3, ()),
    # the experts split over TP too (ETP=TP, the default): their adapters' whole halves sum their
    # gradients over the expert-TP ranks
    "TP=2 SP ETP=2": (dict(TP=2), 2, ()),
    "TP=2 x CP=2": (dict(TP=2, CP=2), 1, ()),
    "CP=2": (dict(CP=2), 1, ()),
    "EP=2": (dict(EP=2, NPROC=2), 1, ()),
    "DP=2 distributed optimizer": (dict(NPROC=2), 2, ("--use-distributed-optimizer",)),
    "PP=2": (dict(PP=2), 1, ()),
    "PP=2 VP=2": (dict(PP=2, VP=2), 1, ()),
    # the vision tower on a layout of its own: its own TP size, or ranks of its own (where, with the
    # default targets, nothing trains)
    "VISION_TP=1 TP=2": (dict(TP=2, VISION_TP=1), 1, ()),
    "VISION_NPROC=1 TP=2": (dict(TP=2, VISION_NPROC=1), 1, ()),
    # the routed experts' adapters on SequentialMLP's per-expert linears (lora/adapter.py) against the
    # grouped experts' (lora/grouped.py) every run above uses, from the checkpoint the grouped ones saved
    "SequentialMLP against grouped experts": (dict(GROUPED_EXPERTS=0), 2, ()),
}


@pytest.fixture(scope="module")
def lora_start(parallel_start, tmp_path_factory):
    """One LoRA step from the base checkpoint, saved: (the run, its checkpoint directory)."""
    path = tmp_path_factory.mktemp("lora") / "start"
    run = run_script(NO_EVAL, CKPT_LOAD=parallel_start, CKPT_SAVE=path, TRAIN_ITERS=1, **MODEL, **LORA).check()
    return run, path


@pytest.fixture(scope="module")
def lora_single(lora_start, tmp_path_factory):
    """3 steps on from ``lora_start``, one process (the plain optimizer), saved in ``.path``."""
    path = tmp_path_factory.mktemp("lora_single") / "single"
    run = run_script(NO_EVAL, CKPT_LOAD=lora_start[1], CKPT_SAVE=path, TRAIN_ITERS=3, **MODEL, **LORA).check()
    run.path = path
    return run


def test_a_lora_run_from_the_base_starts_at_its_loss_and_saves_the_adapters_alone(
    parallel_start, one_process, lora_start, tmp_path
):
    """The adapters start at B = 0: the first loss is the base model's (the same step of the full
    run from the same checkpoint). Only adapters are in the optimizer, and the checkpoint holds them
    and their state alone: none of the base's weights (read again from the base at every load), the
    adapters new entries that moved."""
    run, path = lora_start
    assert "holds no LoRA adapters: its weights are the base" in run.output
    assert "its checkpoints hold the adapters, not the base" in run.output
    assert run.losses[1] == one_process[0].losses[1], (run.losses[1], one_process[0].losses[1])
    base = entries(parallel_start / "iter_0000001", tmp_path)
    tuned = entries(path / "iter_0000001", tmp_path)
    # the linears' _extra_state objects stay, a few bytes each
    frozen = {k for k in base if k.startswith(("language_model.", "vision_model.")) and "_extra_state" not in k}
    assert len(frozen) > 50 and not frozen & set(tuned), sorted(frozen & set(tuned))[:5]
    adapters = sorted(k for k in tuned if ".lora_" in k)
    assert any(".in_proj.lora_B" in k for k in adapters) and any(".experts.experts." in k for k in adapters)
    assert any(tuned[k].abs().max() > 0 for k in adapters if ".lora_B" in k)  # B left zero after a step
    moments = [k for k in tuned if k.startswith("optimizer.state.exp_avg.")]
    assert moments and all(".lora_" in k for k in moments), [k for k in moments if ".lora_" not in k][:5]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_matches_single_process(name, lora_start, lora_single):
    env, iters, flags = LAYOUTS[name]
    run = run_script((*flags, *NO_EVAL), CKPT_LOAD=lora_start[1], TRAIN_ITERS=iters, **MODEL, **LORA, **env).check()
    assert_tracks(f"LoRA {name}", run, lora_single, iters)


# DP=2 with the distributed optimizer, dropout on the adapters' input (each DP rank's RNG matters)
RESUMED = ("--lora-dropout", "0.1", "--use-distributed-optimizer", *NO_EVAL)


@pytest.fixture(scope="module")
def lora_straight(parallel_start, tmp_path_factory):
    """4 LoRA steps from the base checkpoint (``RESUMED``'s settings), saved: (the run, its directory)."""
    path = tmp_path_factory.mktemp("lora_straight") / "straight"
    common = dict(CKPT_LOAD=parallel_start, TRAIN_ITERS=4, NPROC=2, **MODEL, **LORA)
    return run_script(RESUMED, CKPT_SAVE=path, **common).check(), path


def test_lora_resumes_exactly(parallel_start, lora_straight, tmp_path):
    """From the base checkpoint, 4 LoRA steps straight against 2 + 2 resumed (DP=2, distributed
    optimizer, dropout on the adapters' input, so each DP rank's RNG must come back too): the same
    losses and grad norms, bitwise, and the same final checkpoint, entry by entry."""
    common = dict(CKPT_LOAD=parallel_start, TRAIN_ITERS=4, NPROC=2, **MODEL, **LORA)
    straight, straight_path = lora_straight
    first = run_script([*RESUMED, "--exit-interval", "2"], CKPT_RESUME=tmp_path / "resumed", **common).check()
    second = run_script(RESUMED, CKPT_RESUME=tmp_path / "resumed", **common).check()
    assert sorted(first.losses) == [1, 2] and sorted(second.losses) == [3, 4]
    assert {**first.losses, **second.losses} == straight.losses
    assert {**first.grad_norms, **second.grad_norms} == straight.grad_norms
    a = entries(straight_path / "iter_0000004", tmp_path)
    b = entries(tmp_path / "resumed" / "iter_0000004", tmp_path)
    assert any(".lora_B" in k for k in a)
    differing = state_differences(a, b)
    assert not differing, differing
    # every checkpoint names the base its adapters adapt, the resumed run's too (carried on)
    from examples.multimodal_dev.checkpoint.files import checkpoint_directory, stored_args

    base = os.path.abspath(checkpoint_directory(str(parallel_start)))
    assert f"LoRA adapters adapt {base}" in second.output, second.output[-2000:]
    for path in (straight_path, tmp_path / "resumed"):
        assert stored_args(checkpoint_directory(str(path))).lora_base == base


def test_a_lora_checkpoint_leaves_as_docs_lora_md_shows(parallel_start, lora_straight, lora_single, tmp_path):
    """LoRA checkpoints as the run script saves them, of the adapters alone with their optimizer's
    state (the distributed optimizer's and the plain one's, on the MoE model: the routed experts'
    adapters too), exported merged and as a PEFT adapter, each reading the base from where the
    checkpoint names it; the adapter, loaded by ``peft`` onto the base's own export, gives the
    merged export's logits."""
    base = tmp_path / "base"
    assert main(["export", "--megatron-path", str(parallel_start), "--hf-path", str(base)]) == 0
    for kind in ("distributed", "plain"):
        (tmp_path / kind).mkdir()
    line = peft_equals_merged(lora_straight[1], base, tmp_path / "distributed", "MoE, distributed optimizer")
    assert "PEFT's expert adapters take no dropout" in line, line  # the run's 0.1 cannot be carried
    peft_equals_merged(lora_single.path, base, tmp_path / "plain", "MoE, plain optimizer")


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(), "holds LoRA adapters of rank 4; this run has none: train on with --lora-rank 4"),
        (dict(LORA_RANK=8), "holds LoRA adapters of rank 4; this run has rank 8"),
        (dict(LORA_RANK=4, LORA_TARGETS="in_proj,out_proj"), "holds LoRA adapters on linear_qkv,linear_proj,"),
    ],
    ids=["no LoRA", "another rank", "fewer targets"],
)
def test_a_run_that_would_drop_trained_adapters_is_refused(lora_start, settings, message):
    """megatron ignores what a checkpoint holds beyond the model: without the refusal these runs
    would silently train on without the adapters the checkpoint learned."""
    run = run_script(NO_EVAL, CKPT_LOAD=lora_start[1], TRAIN_ITERS=1, **MODEL, **settings)
    assert run.returncode != 0 and message in run.output, run.output[-2000:]
    assert "Traceback" not in run.output


def test_added_targets_start_fresh_beside_the_trained_ones(lora_start, lora_single):
    """A LoRA checkpoint loaded with more targets: its adapters load, the new ones (the vision
    tower's) start at B = 0, so the first loss is the one the checkpoint's adapters give."""
    targets = "linear_qkv,linear_proj,in_proj,out_proj,linear_fc1,linear_fc2,vision.linear_qkv"
    run = run_script(NO_EVAL, CKPT_LOAD=lora_start[1], TRAIN_ITERS=1, LORA_TARGETS=targets, **MODEL, **LORA).check()
    assert "adapter tensors fewer; the adapters it lacks start at B = 0" in run.output
    assert run.losses[1] == lora_single.losses[1]


def test_a_moved_base_is_refused_by_name_and_read_where_told(parallel_start, lora_start, tmp_path):
    """A LoRA checkpoint names its base, which is checked before any load: moved, it is refused in one
    line naming both paths, and LORA_BASE (``--lora-base`` of the conversion tools) points at it;
    another checkpoint of the same shapes there (the base trained one more step) is refused by its
    fingerprint (the crc32 of every file its save recorded)."""
    base, moved = tmp_path / "base", tmp_path / "moved"
    shutil.copytree(parallel_start, base)
    run_script(NO_EVAL, CKPT_LOAD=base, CKPT_SAVE=tmp_path / "lora", TRAIN_ITERS=1, **MODEL, **LORA).check()
    base.rename(moved)
    resume = dict(CKPT_LOAD=tmp_path / "lora", TRAIN_ITERS=1, **MODEL, **LORA)
    refused = run_script(NO_EVAL, **resume)
    named = (
        f"{tmp_path / 'lora' / 'iter_0000001'} holds LoRA adapters only; their base {base / 'iter_0000001'} is missing"
    )
    assert refused.returncode != 0 and "Traceback" not in refused.output and named in refused.output, refused.output
    moved_run = run_script(NO_EVAL, LORA_BASE=moved, **resume).check()
    assert moved_run.losses[1] == run_script(NO_EVAL, CKPT_LOAD=lora_start[1], TRAIN_ITERS=1, **MODEL, **LORA).losses[1]
    assert main(["export-peft", "--megatron-path", str(tmp_path / "lora"), "--peft-path", str(tmp_path / "p")]) == 2
    args = ["--megatron-path", str(tmp_path / "lora"), "--lora-base", str(moved)]
    assert main(["export-peft", *args, "--peft-path", str(tmp_path / "p")]) == 0
    other = tmp_path / "other"
    run_script(NO_EVAL, CKPT_LOAD=moved, CKPT_SAVE=other, TRAIN_ITERS=1, **MODEL).check()
    changed = run_script(NO_EVAL, LORA_BASE=other, **resume)
    assert changed.returncode != 0 and "is not the checkpoint they were trained on" in changed.output
