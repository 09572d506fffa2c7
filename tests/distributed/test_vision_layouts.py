"""The vision tower on its own tensor-parallel size, on the language model's ranks: VISION_TP=1 under
TP=2 (2 processes; each rank encodes its share of a micro-batch's images with a whole tower, and
megatron-core's colocated bridge gathers the shares), through ``run_qwen35_vl.sh``; and the tower
alone on a rank of its own, VISION_NPROC=1 with the language model at TP=2 (3 processes; its experts
over EP=2).

- Against one process from the same checkpoint (``parallel_start``: the tiny MoE model with its MTP
  head, THD micro-batches of 4 samples with two images in three of them, or of one sample): the lm
  loss, the grad norm and the vision tower's own grad norm of the first step within 1e-5 relative,
  the later losses within 1e-4 (see ``test_parallelism.py`` for why), the same token counts; also
  VISION_TP=2 under TP=4, and VISION_TP=1 under TP=2 x CP=2 (4 processes); the separate ranks with
  4 samples and with 1 sample a micro-batch (micro-batches without an image), ahead of a language
  model at PP=2, two vision replicas serving one language replica (fan-in) and one serving two
  (fan-out); and every image of a step on one encoder (one image a micro-batch at most), the
  other idle through the step, colocated and under fan-in.
  The vision norm is compared on its own because it is 3% of the total: a gradient that never
  reached the tower would move the total by 0.04% only. ``CUT_VISION_GRAD`` detaches the
  features at the bridge, and that comparison fails.
- With the distributed optimizer, a straight run's step-2 checkpoint resumed equals that run
  bitwise (losses, grad norms, every tensor of the final checkpoint); the step-2 checkpoint
  resumes in one process (the ordinary layout), optimizer state included, onto the same step 3.
  In both layouts: VISION_TP=1 under TP=2, and the tower on a rank of its own ahead of a language
  model at TP=2 with its experts over EP=2. The other way too: one process's step-2 checkpoint
  resumes in each layout onto the same step 3. The straight runs of the colocated and separate-ranks
  cases are also those cases' layout checks above: one launch each.
"""

import os
import shutil

import pytest
import torch
from checkpoint_diff import entries, state_differences
from launch import LAYOUT_MODEL as MODEL
from launch import NO_EVAL, run_recording_vision_norms, stopped_at

LAYOUT = dict(TP=2, VISION_TP=1)
SEPARATE = dict(LAYOUT, VISION_NPROC=1)
REL = 1e-5
LATER_STEP_NORM = 2e-4  # the grad norm of a step after updates taken in another layout (see its use)
pytestmark = [pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _run(tmp_path, name, flags=NO_EVAL, **env):
    """(run, the tower's grad norm by iteration) of the layouts' model with ``env`` over it."""
    return run_recording_vision_norms(tmp_path, name, flags, **{**MODEL, **env})


def _first_step_agrees(run, norms, ref, ref_norms) -> dict:
    """Relative differences of the first step's figures: lm loss, grad norm, vision grad norm."""
    return {
        "lm loss": _rel(run.losses[1], ref.losses[1]),
        "grad norm": _rel(run.grad_norms[1], ref.grad_norms[1]),
        "vision grad norm": _rel(norms[1], ref_norms[1]),
    }


# name -> (environment, iterations, the table line the run prints, the ordinary layout whose vision grad
# norm it is held to instead of one process's, flags). Tolerances: 1e-5 relative, except where both the
# language model and the tower split their reductions four or two ways (TP=4, VISION_TP=2): 1.2e-5 on
# the grad norm and 5.3e-5 on the vision norm measured with the grouped GEMM experts (1.3e-5 and 2.3e-5
# with SequentialMLP's per-expert GEMMs: the same sums, rounded in another order), so 1e-4 there, the
# bound CP's reductions need below. A copy counted twice or not at all moves the vision norm by a
# factor of 1.4 or more.
# Under CP the tower's norm moves by 5e-5 (TP=2 x CP=2) to 1e-4 (CP=2) from one process's in the
# ordinary layout already (the features' gradients are summed over CP ranks in another order), so
# there it is held to the ordinary layout at the same TP x CP, which differs in where the tower runs
# only.
SETTINGS = {
    "VISION_TP=1 TP=2": (LAYOUT, 3, "TP=1 DP=2 (on the language model's ranks)", None, ()),
    # a sample a micro-batch: the mock draws 0..2 images a sample, so some micro-batches leave a rank
    # of the two with nothing to encode, and some have no image at all (the last of step 2, sample
    # 15, among them). With the distributed optimizer's overlapped reductions, which start a bucket
    # once each of its weights has a gradient from the step's last micro-batch, such a step stopped
    # the run until the idle tower was joined to the graph (vision_context_parallel.joined_zero).
    "VISION_TP=1 TP=2, MBS=1, overlapped reductions": (
        dict(LAYOUT, MBS=1),
        2,
        "TP=1 DP=2 (on the language model's ranks)",
        None,
        ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"),
    ),
    # the copies of a TP-split tower: ranks 2 and 3 hold the same shards as 0 and 1
    "VISION_TP=2 TP=4": (dict(TP=4, VISION_TP=2), 1, "TP=2 DP=2 (on the language model's ranks)", None, ()),
    # the feature gradients of the two CP ranks are summed before the bridge keeps a slot's
    "VISION_TP=1 TP=2 CP=2": (dict(LAYOUT, CP=2), 1, "TP=1 DP=4 (on the language model's ranks)", dict(TP=2, CP=2), ()),
    # the tower alone on rank 0, the language model on ranks 1-2 (3 processes): the features cross through
    # megatron-core's multi-module communicator, one pipeline stage ahead (vision_ranks/groups.py); its
    # experts over EP=2 (ETP=1), as the resume test below runs it
    "VISION_NPROC=1 TP=2 EP=2": (dict(SEPARATE, EP=2, ETP=1), 3, "ranks 0    vision tower    TP=1 DP=1", None, ()),
    # ... with micro-batches that have no image: the tower sends one zero row joined to its weights
    "VISION_NPROC=1 TP=2, MBS=1": (dict(SEPARATE, MBS=1), 2, "ranks 0    vision tower    TP=1 DP=1", None, ()),
    # two vision replicas for the one language replica (fan-in, 4 processes): each encodes its share of every
    # micro-batch's images, dealt by FLOPs and padded to the larger share; the bridge joins the two shares and
    # the language model puts the features back in batch order from the grids
    "VISION_NPROC=2 TP=2, fan-in": (dict(LAYOUT, VISION_NPROC=2), 2, "ranks 0-1  vision tower    TP=1 DP=2", None, ()),
    # ... a sample a micro-batch (3 processes): one share or both with nothing to encode, some micro-batches
    # with every image in one share
    "VISION_NPROC=2, fan-in, MBS=1": (
        dict(VISION_TP=1, VISION_NPROC=2, MBS=1),
        2,
        "ranks 0-1  vision tower    TP=1 DP=2",
        None,
        (),
    ),
    # one vision replica for two language replicas (fan-out, 3 processes): it reads a micro-batch of each,
    # and the bridge splits its features between them by their rows
    "VISION_NPROC=1 DP=2, fan-out": (
        dict(VISION_TP=1, VISION_NPROC=1, NPROC=3),
        2,
        "ranks 1-2  language model  TP=1 CP=1 DP=2 PP=1",
        None,
        (),
    ),
    # ... a sample a micro-batch: one replica's micro-batch, or both, without an image (a zero row each)
    "VISION_NPROC=1 DP=2, fan-out, MBS=1": (
        dict(VISION_TP=1, VISION_NPROC=1, NPROC=3, MBS=1),
        2,
        "ranks 1-2  language model  TP=1 CP=1 DP=2 PP=1",
        None,
        (),
    ),
    # ... ahead of a two-stage language model: the tower is three stages from the loss (warm-up 2)
    "VISION_NPROC=1 PP=2": (dict(PP=2, VISION_NPROC=1), 2, "ranks 1-2  language model  TP=1 CP=1 DP=1 PP=2", None, ()),
}


# The resume test's straight runs: 3 steps from parallel_start with the distributed optimizer, saving
# steps 2 and 3. Two of them are also layouts above (the distributed optimizer at the language model's
# DP=1 changes no number): one launch serves both tests.
STRAIGHT = {
    "colocated": LAYOUT,
    "separate ranks, EP=2": dict(SEPARATE, EP=2, ETP=1),
    "separate ranks, fan-in": dict(VISION_TP=1, VISION_NPROC=2),
}
STRAIGHT_OF_SETTING = {"VISION_TP=1 TP=2": "colocated", "VISION_NPROC=1 TP=2 EP=2": "separate ranks, EP=2"}


@pytest.fixture(scope="module")
def straight_runs(parallel_start, tmp_path_factory):
    """layout id of ``STRAIGHT`` -> (run, the tower's grad norms, its checkpoint folder), each run once."""
    runs = {}

    def straight(layout_id):
        if layout_id not in runs:
            folder = tmp_path_factory.mktemp("straight")
            run, norms = _run(
                folder,
                "straight",
                ("--use-distributed-optimizer", *NO_EVAL),
                CKPT_LOAD=parallel_start,
                TRAIN_ITERS=3,
                CKPT_SAVE=folder / "ckpt",
                SAVE_INTERVAL=2,
                **STRAIGHT[layout_id],
            )
            runs[layout_id] = run, norms, folder / "ckpt"
        return runs[layout_id]

    return straight


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_layout_matches_one_process(
    name, parallel_start, one_process, one_process_per_sample, straight_runs, tmp_path
):
    env, iterations, table, ordinary, flags = SETTINGS[name]
    ref, ref_norms = one_process_per_sample if env.get("MBS") == 1 else one_process
    if name in STRAIGHT_OF_SETTING:
        run, norms, _ = straight_runs(STRAIGHT_OF_SETTING[name])
    else:
        run, norms = _run(
            tmp_path, "layout", (*flags, *NO_EVAL), CKPT_LOAD=parallel_start, TRAIN_ITERS=iterations, **env
        )
    differences = _first_step_agrees(run, norms, ref, ref_norms)
    if ordinary is not None:
        _, same_split = _run(tmp_path, "ordinary", CKPT_LOAD=parallel_start, TRAIN_ITERS=1, **ordinary)
        print(
            f"vision grad norm of one process {ref_norms[1]!r} (rel {differences['vision grad norm']:.1e}); of the "
            f"ordinary layout {same_split[1]!r}"
        )
        differences["vision grad norm"] = _rel(norms[1], same_split[1])
    later = [_rel(run.losses[i], ref.losses[i]) for i in range(2, iterations + 1)]
    print(
        f"{name}: losses {run.losses} vs {ref.losses}; grad norm {run.grad_norms[1]!r} vs {ref.grad_norms[1]!r}; "
        f"vision grad norm {norms[1]!r} vs {ref_norms[1]!r}; first step {differences}"
    )
    assert table in run.output, run.output[-2000:]
    assert all(rel < (1e-4 if env.get("TP") == 4 else REL) for rel in differences.values()), differences
    assert max(later, default=0) < 1e-4, later
    assert all(run.tokens[i] == ref.tokens[i] for i in run.tokens)
    assert ref_norms[1] > 0.01 * ref.grad_norms[1]  # the tower's share is big enough to see


@pytest.mark.parametrize("layout", [LAYOUT, SEPARATE], ids=["colocated", "separate ranks"])
def test_a_cut_gradient_path_to_the_tower_is_caught(layout, parallel_start, one_process, tmp_path):
    ref, ref_norms = one_process
    run, norms = _run(tmp_path, "cut", CKPT_LOAD=parallel_start, TRAIN_ITERS=1, CUT_VISION_GRAD=1, **layout)
    differences = _first_step_agrees(run, norms, ref, ref_norms)
    print(f"features detached at the bridge: vision grad norm {norms[1]!r}; first step {differences}")
    assert differences["lm loss"] < REL  # the forward is untouched
    assert differences["vision grad norm"] > REL and norms[1] == 0.0


@pytest.fixture(scope="module")
def ordinary_step_2(parallel_start, tmp_path_factory):
    """A checkpoint of one process (the ordinary layout) stopped after step 2 of 3."""
    path = tmp_path_factory.mktemp("ordinary") / "step2"
    _run(
        path.parent,
        "ordinary step 2",
        ("--use-distributed-optimizer", "--exit-interval", "2", *NO_EVAL),
        CKPT_LOAD=parallel_start,
        CKPT_RESUME=path,
        TRAIN_ITERS=3,
    )
    return path


# The separate ranks' case splits the language model's experts over its two ranks (EP=2, ETP=1): the tower's
# ranks then hold an expert optimizer with no parameter (megatron's, for the grad-norm reductions), whose
# param groups have no step, and the checkpoint's common state must be the language model's.
# The fan-in case shards the tower's optimizer state over its two data-parallel ranks.
@pytest.mark.parametrize("layout_id", list(STRAIGHT))
def test_resumes_exactly_and_in_the_ordinary_layout(
    layout_id, parallel_start, ordinary_step_2, straight_runs, tmp_path
):
    flags, layout = ("--use-distributed-optimizer", *NO_EVAL), STRAIGHT[layout_id]
    common = dict(CKPT_LOAD=parallel_start, TRAIN_ITERS=3, **layout)
    # the straight run also saves step 2, as a run stopped there would (test_training_runs.py stops one
    # with --exit-interval); that checkpoint resumes in a process of its own
    straight, _, saved = straight_runs(layout_id)
    stopped_at(saved, tmp_path / "resumed", 2)
    shutil.copytree(tmp_path / "resumed", tmp_path / "ordinary")
    second, _ = _run(tmp_path, "second", flags, CKPT_RESUME=tmp_path / "resumed", **common)
    assert sorted(straight.losses) == [1, 2, 3] and sorted(second.losses) == [3]
    print("straight:", straight.losses, straight.grad_norms, "\nresumed at step 3:", second.losses, second.grad_norms)
    assert second.losses[3] == straight.losses[3]  # full-precision floats, bitwise
    assert second.grad_norms[3] == straight.grad_norms[3]
    a = entries(saved / "iter_0000003", tmp_path)
    b = entries(tmp_path / "resumed" / "iter_0000003", tmp_path)
    assert [k for k in a if "optimizer" in k and torch.is_tensor(a[k])] and any(
        k.startswith("vision_model") or ".vision_model." in k for k in a
    )
    differing = state_differences(a, b)
    assert not differing, differing

    # the same step-2 checkpoint in one process: weights and optimizer state land whole
    ordinary, _ = _run(tmp_path, "ordinary", flags, CKPT_RESUME=tmp_path / "ordinary", TRAIN_ITERS=3)
    assert sorted(ordinary.losses) == [3]
    loss, norm = _rel(ordinary.losses[3], straight.losses[3]), _rel(ordinary.grad_norms[3], straight.grad_norms[3])
    print(f"one process from the layout's step-2 checkpoint: step 3 loss rel {loss:.1e}, grad norm rel {norm:.1e}")
    # step 3 follows two AdamW updates taken in another layout (the first is ~lr * sign(g), so elements whose
    # gradient sits at rounding level move either way): the loss tracks to 1e-5, the grad norm to 2e-4
    # (measured 2.3e-5 this way and 1.1e-4 the other, with the grouped GEMM experts; 3.2e-5 with SequentialMLP)
    assert loss < REL and norm < LATER_STEP_NORM

    # and the other way: one process's step-2 checkpoint resumes in the layout (a separate-ranks run
    # reads no tower random state from it, says so, and its experts' empty optimizer on the tower's
    # ranks reads the saved groups alone)
    shutil.copytree(ordinary_step_2, tmp_path / "from_ordinary")
    moved, _ = _run(tmp_path, "from_ordinary", flags, CKPT_RESUME=tmp_path / "from_ordinary", **common)
    assert sorted(moved.losses) == [3]
    loss, norm = _rel(moved.losses[3], straight.losses[3]), _rel(moved.grad_norms[3], straight.grad_norms[3])
    print(f"the layout from one process's step-2 checkpoint: step 3 loss rel {loss:.1e}, grad norm rel {norm:.1e}")
    assert loss < REL and norm < LATER_STEP_NORM
    assert ("start their random state from the seed" in moved.output) == bool(layout.get("VISION_NPROC"))


def _samples_of_the_mock(seed: int, count: int) -> list[tuple[int, int]]:
    """(images, tokens) of the first ``count`` training samples the layouts' runs read at ``--seed seed``
    (the mock's training split through the same skips and truncation)."""
    from examples.multimodal_dev.data.mock import build_datasets
    from examples.multimodal_dev.data.sample import VisionTokens
    from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant

    shape = get_variant("tiny", moe=True, mtp=True)
    train, _, _ = build_datasets(
        VisionTokens.from_shape(shape),
        shape.text.vocab_size,
        shape.vision.patch_dim,
        MODEL["SEQ_LEN"],
        (count, 1, 1),
        seed=seed,
    )
    return [(int(s["image_grid_thw"].shape[0]), int(s["input_ids"].numel())) for s in (train[i] for i in range(count))]


# A sample a micro-batch, 4 a step, 2 steps, at the first mock seed whose 8 samples hold at most one image
# each and at least two a step: the tower's deal hands a micro-batch's one image to its first encoder, so
# every image of a step lands on one rank and the other encoder idles through the whole step.
STEPS, PER_STEP = 2, 4


@pytest.fixture(scope="module")
def one_image_a_micro_batch(parallel_start, tmp_path_factory):
    """(seed, (images, tokens) of each sample read, the flags and settings of the runs, one process's
    (run, vision grad norms))."""

    def at_most_one_image(samples):
        steps = [[n for n, _ in samples[i : i + PER_STEP]] for i in range(0, len(samples), PER_STEP)]
        return all(max(images) <= 1 and sum(images) >= 2 for images in steps)

    for seed in range(1, 1000):
        samples = _samples_of_the_mock(seed, STEPS * PER_STEP)
        if at_most_one_image(samples):
            break
    common = dict(CKPT_LOAD=parallel_start, TRAIN_ITERS=STEPS, MBS=1, GBS=PER_STEP)
    flags = ("--seed", str(seed), *NO_EVAL)
    reference = _run(tmp_path_factory.mktemp("one_image"), "one process", flags, **common)
    return seed, samples, flags, common, reference


@pytest.mark.parametrize(
    "layout", [LAYOUT, dict(VISION_TP=1, VISION_NPROC=2)], ids=["colocated", "separate ranks, fan-in"]
)
def test_every_image_of_a_step_on_one_rank(layout, one_image_a_micro_batch, tmp_path):
    from examples.multimodal_dev.models.common.work_deal import deal

    seed, samples, flags, common, (ref, ref_norms) = one_image_a_micro_batch
    assert all(deal([1.0] * n, 2) == [list(range(n)), []] for n, _ in samples)  # one image: the first encoder's
    run, norms = _run(tmp_path, "layout", flags, **common, **layout)
    differences = _first_step_agrees(run, norms, ref, ref_norms)
    print(
        f"seed {seed}, (images, tokens) of the samples {samples}: losses {run.losses} vs {ref.losses}; "
        f"first step {differences}"
    )
    tokens = [sum(t for _, t in samples[i : i + PER_STEP]) for i in range(0, len(samples), PER_STEP)]
    assert [run.tokens[i] for i in (1, 2)] == [ref.tokens[i] for i in (1, 2)] == tokens  # read just these samples
    assert all(rel < REL for rel in differences.values()), differences
    assert _rel(run.losses[2], ref.losses[2]) < 1e-4  # after AdamW's first update: test_parallelism.py says why
    assert ref_norms[1] > 0.01 * ref.grad_norms[1]


def test_a_fresh_start_gives_every_copy_of_the_tower_the_same_weights(tmp_path):
    """From no checkpoint the TP-split weights are drawn in each language TP rank's random stream, so
    the two copies start apart unless rank 0's are handed to rank 1. A step at LR 0 from the fresh
    start must then equal a step from its saved checkpoint (one copy, loaded into both)."""
    common = dict(TRAIN_ITERS=1, LR=0, **LAYOUT)
    fresh, _ = _run(tmp_path, "fresh", CKPT_SAVE=tmp_path / "fresh", **common)
    again, _ = _run(tmp_path, "again", CKPT_LOAD=tmp_path / "fresh", **common)
    print(
        f"fresh start: loss {fresh.losses[1]!r}, grad norm {fresh.grad_norms[1]!r}; from its checkpoint: "
        f"{again.losses[1]!r}, {again.grad_norms[1]!r}"
    )
    assert fresh.losses[1] == again.losses[1] and fresh.grad_norms[1] == again.grad_norms[1]
