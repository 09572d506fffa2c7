"""The main job, end to end on CPU: ``bash run_qwen35_vl.sh`` (torchrun, gloo, megatron.training).

- the default run (tiny, mock, packed) learns: mean loss of the last 5 of 30 iterations is
  clearly below the first 5;
- exact resume, with megatron's plain optimizer, and with the distributed optimizer at DP=2 under
  token-budget packing: 6 iterations straight == 3, stop (--exit-interval), resume, 3 more (fresh
  interpreters, ranks forked from a cold launcher's forkserver, and from the warm engine): the
  same tokens, loss and grad norm at every iteration (metrics file, full precision), the same
  validation loss, and a bitwise-equal final checkpoint (weights and optimizer state);
- a process killed (SIGKILL) while writing a checkpoint leaves the previous one loadable, and
  training resumes from it with the same losses; a longer TRAIN_ITERS then extends the run (on
  the checkpoint's LR schedule); 4 KiB overwritten inside a shard and a pickle planted in the
  checkpoint are refused in one line (the pickle never runs); a full disk during a save removes
  the half-written directory and keeps the last complete checkpoint;
- a NaN stops the run in one line before any checkpoint of the bad step is written, and a checkpoint
  megatron's rerun state machine re-saved after a NaN loads; CKPT_LOAD with an empty CKPT_RESUME
  starts from CKPT_LOAD's weights;
- TP=2 (no SP, dense) on the same weights (with the MTP head) reports the first-iteration loss,
  MTP loss and grad norm of the single process (1e-5 rel);
- with MTP=1 the MTP loss is logged and falls; TensorBoard gets the loss and TFLOP/s scalars.
"""

import glob
import os
import pickle

import pytest
import torch
from checkpoint_diff import entries, state_differences
from launch import NO_EVAL, run_script


def test_default_run_learns():
    run = run_script(ENGINE_SERVER="").check()  # as a user starts it: a cold launcher, a fresh interpreter
    losses = [run.losses[i] for i in range(1, 31)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"default run: first-5 mean loss {first:.3f}, last-5 mean {last:.3f}, validation {run.validation}")
    assert last < first - 1.0
    assert "using 'tiny'" in run.output and "backend local" in run.output and 30 in run.validation
    assert (
        "packed (THD) attention: language model SDPA per packed sample (varlen attention needs a CUDA device); "
        "vision encoder SDPA per packed sample"
    ) in run.output, run.output[-3000:]
    assert run.output.count("Gated DeltaNet runs on the torch kernels of megatron.cpu") == 1, run.output[-3000:]


@pytest.mark.parametrize("setting", ["plain", "distributed, DP=2, token budget"])
def test_exact_resume(tmp_path, setting):
    # As docs/checkpoints.md launches it: --use-distributed-optimizer and no checkpoint flags (the default
    # format is fully reshardable). Both train with dropout, so the RNG state must come back exactly
    # too, on every DP rank: in the straight run rank 1's stream moves on by its own draws, and
    # megatron alone would restore rank 0's on both (checkpoint/rng_per_rank.py). Token-budget
    # packing continues its plan from the checkpoint's plan state: the same rows, dealt to the same
    # ranks.
    flags, common = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"], dict(TRAIN_ITERS=6, SEQ_LEN=512)
    if setting != "plain":
        flags += ["--use-distributed-optimizer"]
        common.update(NPROC=2, PACKING="tokens", PACKED_SEQ_LENGTH=256, GBS=4)
    # Three ways to start the ranks, the same figures from each (launcher/torchrun.py): the
    # straight run's are fresh interpreters; the stopped run's fork from the forkserver of a cold
    # launcher, which imports the engine; the resumed run's fork from the warm engine
    # (tests/warm_engine.py) that the tests launch on
    straight = run_script(flags, CKPT_SAVE=tmp_path / "straight", FORK_RANKS=0, **common).check()
    first = run_script(
        [*flags, "--exit-interval", "3"], CKPT_RESUME=tmp_path / "resumed", FORK_RANKS=1, ENGINE_SERVER="", **common
    ).check()
    second = run_script(flags, CKPT_RESUME=tmp_path / "resumed", **common).check()
    assert sorted(first.losses) == [1, 2, 3] and sorted(second.losses) == [4, 5, 6]
    resumed = {**first.losses, **second.losses}
    print(f"{setting}\nstraight:", straight.losses, "\nresumed: ", resumed, "\ntokens:", straight.tokens)
    assert {**first.tokens, **second.tokens} == straight.tokens
    if setting != "plain":  # 4 rows of exactly 256 tokens a step (one static shape)
        assert all(straight.records[i]["padded_tokens"] == 4 * 256 for i in range(1, 7))
        # the plan continued from the checkpoint's plan state, not by replaying steps 0-2
        plan_file = tmp_path / "resumed" / "iter_0000003" / "token_budget_plan.json"
        assert f"token-budget plan: continues at step 3 from {plan_file}" in second.output, second.output[-3000:]
    assert resumed == straight.losses  # full-precision floats, bitwise
    assert {**first.grad_norms, **second.grad_norms} == straight.grad_norms
    assert second.validation == straight.validation
    a = entries(tmp_path / "straight" / "iter_0000006", tmp_path)
    b = entries(tmp_path / "resumed" / "iter_0000006", tmp_path)
    optimizer_keys = [k for k in a if "optimizer" in k and torch.is_tensor(a[k])]
    rng_keys = [k for k in a if "rng_state" in k]
    print(f"{len(a)} entries in the final checkpoint, {len(optimizer_keys)} optimizer tensors, RNG: {rng_keys}")
    assert len(a) > 50 and optimizer_keys and rng_keys
    differing = state_differences(a, b)
    assert not differing, differing


def test_killed_save_keeps_previous_checkpoint(tmp_path):
    """One checkpoint directory through the ways a save or a load goes wrong; the runs after the
    first compare training steps only, so they skip the closing evaluation."""
    ckpt = tmp_path / "ckpt"
    common = dict(TRAIN_ITERS=4, SAVE_INTERVAL=2, SEQ_LEN=512, CKPT_RESUME=ckpt)
    killed = run_script(KILL_DURING_SAVE_AT=4, **common)
    assert killed.returncode != 0 and sorted(killed.losses) == [1, 2, 3, 4]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    again = run_script(NO_EVAL, **common).check()
    assert f"{ckpt / 'iter_0000004'} is complete but newer than latest_checkpointed_iteration.txt" in again.output
    assert sorted(again.losses) == [3, 4]
    assert again.losses == {i: killed.losses[i] for i in (3, 4)}
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    # extending the run (the checkpoint's LR schedule carries on), with a full disk while saving
    # iteration 6: its half-written directory goes, iteration 5 stays
    full = run_script(NO_EVAL, FULL_DISK_AT=6, **{**common, "TRAIN_ITERS": 6, "SAVE_INTERVAL": 1})
    assert full.returncode != 0 and sorted(full.losses) == [5, 6]
    assert "resuming with the checkpoint's LR schedule" in full.output
    assert (
        f"pretrain_multimodal.py: no space left on {ckpt} while saving iteration 6: removed the partial "
        f"{ckpt / 'iter_0000006'}; the last complete checkpoint is iteration 5"
    ) in full.output, full.output[-3000:]
    assert not (ckpt / "iter_0000006").exists()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    # 4 KiB of a shard overwritten (its length kept): named against the crc32 recorded at the save,
    # with the newest whole iteration, before megatron reads a byte
    shard = next((ckpt / "iter_0000005").glob("*.distcp"))
    saved = shard.read_bytes()
    with open(shard, "r+b") as f:
        f.seek(len(saved) // 2)
        f.write(b"\xa5" * 4096)  # not zeros: a stretch of zero-valued state would not change
    damaged = run_script(NO_EVAL, **{**common, "TRAIN_ITERS": 6})
    assert damaged.returncode != 0 and not damaged.losses and "Traceback" not in damaged.output
    assert (
        f"the latest checkpoint (iteration 5) is damaged: {shard} is not the file that was saved (crc32 "
    ) in damaged.output and "iteration 4 is complete: resume from it" in damaged.output, damaged.output[-3000:]
    shard.write_bytes(saved)
    # a pickle planted in the checkpoint is refused by name and never runs
    marker, metadata = tmp_path / "ran", ckpt / "iter_0000005" / ".metadata"
    with open(metadata, "wb") as f:
        pickle.dump(_Plant(marker), f)
    refused = run_script(NO_EVAL, **{**common, "TRAIN_ITERS": 6})
    assert refused.returncode != 0 and not marker.exists()
    assert (
        f"pretrain_multimodal.py: checkpoint refused: {metadata}: it names 'posix.system', which is not checkpoint data"
    ) in refused.output, refused.output[-3000:]


class _Plant:
    """Unpickling this would run ``os.system`` (creating ``path``)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_nan_stops_without_saving_the_bad_step(tmp_path):
    ckpt = tmp_path / "ckpt"
    # LR 1e9: the first update blows the weights up; the next backward pass produces NaN gradients,
    # which stop the run in one line before the optimizer steps (and nothing is saved for it)
    run = run_script(TRAIN_ITERS=4, SAVE_INTERVAL=1, SEQ_LEN=256, LR=1e9, CKPT_SAVE=ckpt)
    line = (
        "pretrain_multimodal.py: iteration 2: found NaN in local grad norm for bucket #0 in backward pass before "
        "data-parallel communication collective; the run stopped before the optimizer step and saved nothing "
        f"for it: the last checkpoint is iteration 1 in {ckpt}"
    )
    assert run.returncode != 0 and line in run.output and "Traceback" not in run.output, run.output[-3000:]
    assert sorted(run.losses) == [1]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001"]


def test_checkpoint_resaved_by_the_rerun_state_machine_still_loads(tmp_path):
    """Under megatron's own --rerun-mode validate_results, a NaN makes megatron re-save the last
    checkpoint with its rerun state (a Call of a Caller) and exit; that checkpoint must load as data."""
    ckpt, rerun = tmp_path / "ckpt", ("--rerun-mode", "validate_results")
    run_script(rerun, TRAIN_ITERS=4, SAVE_INTERVAL=1, SEQ_LEN=256, LR=1e9, CKPT_SAVE=ckpt)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    resumed = run_script(TRAIN_ITERS=4, SEQ_LEN=256, LR=1e9, CKPT_RESUME=ckpt)
    assert "checkpoint refused" not in resumed.output and "loaded checkpoint from" in resumed.output
    assert "pretrain_multimodal.py: iteration 2: found NaN" in resumed.output, resumed.output[-3000:]


# The dense model with its MTP head, one step: a saved start, and one process's first step from it
DENSE_STEP = dict(TRAIN_ITERS=1, SEQ_LEN=512, MTP=1)


@pytest.fixture(scope="module")
def dense_start(tmp_path_factory):
    start = tmp_path_factory.mktemp("dense") / "start"
    run_script(NO_EVAL, CKPT_SAVE=start, **DENSE_STEP).check()
    return start


@pytest.fixture(scope="module")
def dense_single(dense_start):
    return run_script(NO_EVAL, CKPT_LOAD=dense_start, **DENSE_STEP).check()


def test_a_starting_checkpoint_with_an_empty_resume_directory_is_loaded(dense_start, dense_single, tmp_path):
    """CKPT_LOAD with CKPT_RESUME on an empty directory starts from CKPT_LOAD's weights: the first
    loss equals the plain CKPT_LOAD run's (it used to start from random weights)."""
    both = run_script(NO_EVAL, CKPT_LOAD=dense_start, CKPT_RESUME=tmp_path / "run", **DENSE_STEP).check()
    assert both.losses[1] == dense_single.losses[1] and both.grad_norms[1] == dense_single.grad_norms[1]
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores for two ranks")
def test_tensor_parallel_matches_single_process(dense_start, dense_single):
    single = dense_single
    tp2 = run_script(NO_EVAL, CKPT_LOAD=dense_start, TP=2, **DENSE_STEP).check()
    rel = abs(tp2.losses[1] - single.losses[1]) / single.losses[1]
    rel_mtp = abs(tp2.mtp_losses[1] - single.mtp_losses[1]) / single.mtp_losses[1]
    rel_norm = abs(tp2.grad_norms[1] - single.grad_norms[1]) / single.grad_norms[1]
    print(
        f"first-iteration loss: single {single.losses[1]:.8f} TP=2 {tp2.losses[1]:.8f} (rel {rel:.1e}); "
        f"MTP loss {single.mtp_losses[1]:.8f} vs {tp2.mtp_losses[1]:.8f} (rel {rel_mtp:.1e}); "
        f"grad norm {single.grad_norms[1]:.8f} vs {tp2.grad_norms[1]:.8f} (rel {rel_norm:.1e})"
    )
    assert rel < 1e-5 and rel_mtp < 1e-5 and rel_norm < 1e-5


def test_mtp_head_trains_on_videos_and_tensorboard_records(tmp_path):
    """On mock_video: images and videos (every frame a vision run) through the engine."""
    board = tmp_path / "tb"
    run = run_script(
        ["--tensorboard-dir", str(board), *NO_EVAL], TRAIN_ITERS=16, SEQ_LEN=512, MTP=1, DATASET="mock_video"
    ).check()
    mtp = [run.mtp_losses[i] for i in range(1, 17)]
    first, last = sum(mtp[:4]) / 4, sum(mtp[-4:]) / 4
    print(f"MTP loss: first-4 mean {first:.3f}, last-4 mean {last:.3f}")
    assert len(run.mtp_losses) == 16 and last < first - 0.5

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(glob.glob(str(board / "events.out.tfevents.*"))[0])
    events.Reload()
    tags = set(events.Tags()["scalars"])
    print("TensorBoard scalars:", sorted(tags))
    assert {"lm loss", "model TFLOP/s per GPU", "tokens per second"} <= tags
    assert len(events.Scalars("lm loss")) == 16 and all(s.value > 0 for s in events.Scalars("model TFLOP/s per GPU"))
