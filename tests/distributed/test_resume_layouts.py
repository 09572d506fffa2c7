"""Checkpoints across layouts with the distributed optimizer, launched as the README launches it
(``--use-distributed-optimizer`` and nothing else): one DP=2 checkpoint of the tiny MoE model
resumes, optimizer state included, at TP=2, PP=2, PP=2 x VP=2 and EP=2, and the next step's loss
and grad norm equal the same-layout resume's; resuming it with megatron's plain optimizer is
refused in one line naming what to run, and so is a resume with another learning rate."""

import pytest
from launch import NO_EVAL, run_script

COMMON = dict(MOE=1, SEQ_LEN=256, GBS=4)
DIST = ("--use-distributed-optimizer", *NO_EVAL)
LAYOUTS = {"TP=2": dict(TP=2), "PP=2": dict(PP=2), "PP=2 x VP=2": dict(PP=2, VP=2), "EP=2": dict(EP=2, NPROC=2)}
# TP=2 splits the reductions inside every layer, so its grad norm differs from the DP run's in the
# last bits of fp32 (the single-step TP test measures 7.3e-6 on the dense model); the loss, a sum of
# per-token terms, agrees to 1e-6.
GRAD_NORM_RTOL = {"TP=2": 5e-5}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    run_script(DIST, TRAIN_ITERS=2, NPROC=2, CKPT_SAVE=root / "base", **COMMON).check()
    return root


def _resume(saved, name, flags=DIST, **layout):
    import shutil

    target = saved / name.replace(" ", "").replace("=", "")
    shutil.copytree(saved / "base", target)
    return run_script(flags, TRAIN_ITERS=3, CKPT_RESUME=target, **{"NPROC": 2, **COMMON, **layout})


@pytest.fixture(scope="module")
def same_layout(saved):
    return _resume(saved, "same").check()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_optimizer_state_resumes_at_another_layout(saved, same_layout, layout):
    other = _resume(saved, layout, **LAYOUTS[layout]).check()
    assert sorted(other.losses) == [3], other.output[-3000:]
    loss = abs(other.losses[3] - same_layout.losses[3]) / same_layout.losses[3]
    norm = abs(other.grad_norms[3] - same_layout.grad_norms[3]) / same_layout.grad_norms[3]
    print(f"{layout}: loss {other.losses[3]!r} vs {same_layout.losses[3]!r} (rel {loss:.1e}), grad norm "
          f"{other.grad_norms[3]!r} vs {same_layout.grad_norms[3]!r} (rel {norm:.1e})")
    assert loss < 1e-5 and norm < GRAD_NORM_RTOL.get(layout, 1e-5)


def test_the_plain_optimizer_is_refused_in_one_line(saved):
    run = _resume(saved, "plain", flags=NO_EVAL, NPROC=1)
    assert run.returncode != 0 and "Traceback" not in run.output
    assert "its optimizer state was saved with --use-distributed-optimizer and this run is without it" in run.output


def test_another_learning_rate_is_refused_in_one_line(saved):
    run = _resume(saved, "lr", LR="1e-3")
    assert run.returncode != 0 and "Traceback" not in run.output, run.output[-3000:]
    assert ("--lr 0.001 --min-lr 0.0001: the checkpoint under --load" in run.output
            and "trained with --lr 0.002 --min-lr 0.0002, which its optimizer state keeps" in run.output), run.output[-3000:]
