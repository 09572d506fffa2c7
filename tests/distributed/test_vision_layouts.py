"""The vision tower on its own tensor-parallel size, on the language model's ranks: VISION_TP=1 under
TP=2 (2 processes; each rank encodes its share of a micro-batch's images with a whole tower, and
megatron-core's colocated bridge gathers the shares), through ``run_qwen35_vl.sh``.

- Against one process from the same checkpoint (``parallel_start``: the tiny MoE model with its MTP
  head, THD micro-batches of 4 samples with two images in three of them): the lm loss, the grad
  norm and the vision tower's own grad norm of the first step within 1e-5 relative, the later
  losses within 1e-4 (see ``test_parallelism.py`` for why), the same token counts.
  The vision norm is compared on its own because it is 3% of the total: a gradient that never
  reached the tower would move the total by 0.04% only. ``CUT_VISION_GRAD`` detaches the
  features at the bridge, and that comparison fails.
- With the distributed optimizer, a run stopped after step 2 and resumed equals a straight one
  bitwise (losses, grad norms, every tensor of the final checkpoint); the step-2 checkpoint
  resumes in one process (the ordinary layout), optimizer state included, onto the same step 3.
"""

import os
import shutil

import pytest
import torch
from checkpoint_diff import entries, state_differences
from launch import NO_EVAL, PARALLEL_MODEL, run_script

MODEL = dict(PARALLEL_MODEL, MBS=4, GBS=8)
LAYOUT = dict(TP=2, VISION_TP=1)
REL = 1e-5
pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _run(tmp_path, name, flags=NO_EVAL, **env):
    """A run that records its vision grad norms (``tests/hooks``): (run, norms by iteration)."""
    norms = tmp_path / f"{name}.vision_norms"
    run = run_script(flags, VISION_GRAD_NORMS=norms, **{**MODEL, **env}).check()
    lines = norms.read_text().split() if norms.exists() else []
    return run, {i + 1: float(v) for i, v in enumerate(lines)}


def _first_step_agrees(run, norms, ref, ref_norms) -> dict:
    """Relative differences of the first step's figures: lm loss, grad norm, vision grad norm."""
    return {"lm loss": _rel(run.losses[1], ref.losses[1]), "grad norm": _rel(run.grad_norms[1], ref.grad_norms[1]),
            "vision grad norm": _rel(norms[1], ref_norms[1])}


@pytest.fixture(scope="module")
def single(parallel_start, tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), "single", CKPT_LOAD=parallel_start, TRAIN_ITERS=3)


def test_vision_tp1_under_tp2_matches_one_process(parallel_start, single, tmp_path):
    ref, ref_norms = single
    run, norms = _run(tmp_path, "layout", CKPT_LOAD=parallel_start, TRAIN_ITERS=3, **LAYOUT)
    differences = _first_step_agrees(run, norms, ref, ref_norms)
    later = [_rel(run.losses[i], ref.losses[i]) for i in (2, 3)]
    print(f"VISION_TP=1 TP=2: losses {run.losses} vs {ref.losses}; grad norm {run.grad_norms[1]!r} vs "
          f"{ref.grad_norms[1]!r}; vision grad norm {norms[1]!r} vs {ref_norms[1]!r}; first step {differences}")
    assert "TP=1 DP=2 (on the language model's ranks)" in run.output, run.output[-2000:]
    assert all(rel < REL for rel in differences.values()), differences
    assert max(later) < 1e-4, later
    assert run.tokens == ref.tokens
    assert ref_norms[1] > 0.01 * ref.grad_norms[1]  # the tower's share is big enough to see


def test_a_cut_gradient_path_to_the_tower_is_caught(parallel_start, single, tmp_path):
    ref, ref_norms = single
    run, norms = _run(tmp_path, "cut", CKPT_LOAD=parallel_start, TRAIN_ITERS=1, CUT_VISION_GRAD=1, **LAYOUT)
    differences = _first_step_agrees(run, norms, ref, ref_norms)
    print(f"features detached at the bridge: vision grad norm {norms[1]!r}; first step {differences}")
    assert differences["lm loss"] < REL  # the forward is untouched
    assert differences["vision grad norm"] > REL and norms[1] == 0.0


def test_resumes_exactly_and_in_the_ordinary_layout(parallel_start, tmp_path):
    flags = ("--use-distributed-optimizer", *NO_EVAL)
    common = dict(CKPT_LOAD=parallel_start, TRAIN_ITERS=3, **LAYOUT)
    straight, _ = _run(tmp_path, "straight", flags, CKPT_SAVE=tmp_path / "straight", **common)
    first, _ = _run(tmp_path, "first", (*flags, "--exit-interval", "2"), CKPT_RESUME=tmp_path / "resumed", **common)
    shutil.copytree(tmp_path / "resumed", tmp_path / "ordinary")
    second, _ = _run(tmp_path, "second", flags, CKPT_RESUME=tmp_path / "resumed", **common)
    assert sorted(first.losses) == [1, 2] and sorted(second.losses) == [3]
    print("straight:", straight.losses, straight.grad_norms, "\nresumed:", {**first.losses, **second.losses},
          {**first.grad_norms, **second.grad_norms})
    assert {**first.losses, **second.losses} == straight.losses  # full-precision floats, bitwise
    assert {**first.grad_norms, **second.grad_norms} == straight.grad_norms
    a = entries(tmp_path / "straight" / "iter_0000003", tmp_path)
    b = entries(tmp_path / "resumed" / "iter_0000003", tmp_path)
    assert [k for k in a if "optimizer" in k and torch.is_tensor(a[k])] and any(k.startswith("vision_model") or
                                                                                  ".vision_model." in k for k in a)
    differing = state_differences(a, b)
    assert not differing, differing

    # the same step-2 checkpoint in one process: weights and optimizer state land whole
    ordinary, _ = _run(tmp_path, "ordinary", flags, CKPT_RESUME=tmp_path / "ordinary", TRAIN_ITERS=3)
    assert sorted(ordinary.losses) == [3]
    loss, norm = _rel(ordinary.losses[3], straight.losses[3]), _rel(ordinary.grad_norms[3], straight.grad_norms[3])
    print(f"one process from the layout's step-2 checkpoint: step 3 loss rel {loss:.1e}, grad norm rel {norm:.1e}")
    assert loss < REL and norm < 5e-5  # TP=2's reductions move the norm's last fp32 bits (test_resume_layouts)
