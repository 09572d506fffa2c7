"""Parallelism that does not change the math: CP, TP + SP, EP (with experts split over TP, or not:
ETP), DP with the distributed optimizer and their mix against one process; full activation
recompute, which must not change it either.

Every run is ``run_qwen35_vl.sh`` (torchrun, gloo, fp32) on the ``tiny`` MoE model with the MTP
head, starting from one saved checkpoint, on the mock data's first global batch of 8 samples
in THD micro-batches of 4 (the first: 58..158 tokens, three samples with two images each, grids
from 4x6 to 12x10 patches, one text-only; EP=2 and DP=2 give each of their two data-parallel
ranks one of those micro-batches, the single process runs both). Figures come from the runs'
metrics files (full precision). Compared with the single process: the lm loss and the grad norm
of the first step (1e-5 relative), the real tokens counted for it (the global batch once,
whatever the layout), and for the settings that take several steps, the lm loss of the later
steps (1e-4 relative: "tracks"). Why looser there: AdamW's first update is about lr * sign(g)
per element, so elements whose gradient sits near rounding level move by +-lr either way, and
later losses drift accordingly.

The MTP loss is compared where every rank sees whole samples (TP, EP). megatron-core logs it as
a mean of per-rank means, so under CP it depends on the split by construction; its gradient
is per token and is inside the grad norm that is compared.

The language model alone (text-only batch, no vision inputs) runs under TP=2 with SP through
``language_model_worker.py``: GPTModel must scatter its own embeddings there, so its per-token
loss must cover the whole row and equal the single process's.
"""

import json
import os
import subprocess
import sys

import pytest
from launch import LAYOUT_MODEL as MODEL
from launch import NO_EVAL, ROOT, on_warm_engine, run_script

REL = 1e-5
REL_LATER_STEPS = 1e-4

# name -> (environment, iterations, extra flags)
SETTINGS = {
    "CP=2": (dict(CP=2), 3, ()),
    "CP=4": (dict(CP=4), 1, ()),
    # MoE with TP>1 runs with SP (megatron-core requires it). The experts split as in the 122b / 397b
    # layouts: over EP, not over TP (ETP=1); TP=2 x CP=2 splits them over TP (ETP=TP, the default).
    "TP=2 SP EP=2 ETP=1": (dict(TP=2, EP=2, ETP=1), 3, ()),
    "TP=2 x CP=2": (dict(TP=2, CP=2), 1, ()),
    "EP=2": (dict(EP=2, NPROC=2), 1, ()),
    "DP=2 distributed optimizer": (dict(NPROC=2), 3, ("--use-distributed-optimizer",)),
    "BSHD CP=2": (dict(PACKED=0, CP=2), 1, ()),
    # the layouts above run the experts as grouped GEMMs (the script's default for MoE); megatron-core's
    # SequentialMLP computes the same, from the checkpoint the grouped experts saved
    "SequentialMLP experts": (dict(GROUPED_EXPERTS=0), 3, ()),
    # not parallelism, but the same promise: recomputing every layer (GDN, attention, MoE, the vision
    # tower's blocks) in the backward changes no number
    "recompute full": (
        dict(),
        1,
        ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"),
    ),
}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def start(parallel_start):
    return parallel_start


@pytest.fixture(scope="module")
def single(start, one_process):
    """Single-process references: THD for 3 steps (shared with test_vision_layouts), BSHD for 1."""
    return {
        "thd": one_process[0],
        "bshd": run_script(NO_EVAL, CKPT_LOAD=start, TRAIN_ITERS=1, PACKED=0, **MODEL).check(),
    }


def assert_tracks(name: str, run, ref, iters: int) -> None:
    """``run`` tracks the single process ``ref``: the first step's loss and grad norm within ``REL``,
    the later steps' losses within ``REL_LATER_STEPS``."""
    loss_rel = [_rel(run.losses[i], ref.losses[i]) for i in range(1, iters + 1)]
    norm_rel = _rel(run.grad_norms[1], ref.grad_norms[1])
    print(
        f"{name}: losses {[run.losses[i] for i in range(1, iters + 1)]} "
        f"vs {[ref.losses[i] for i in range(1, iters + 1)]}"
        f" (max rel {max(loss_rel):.1e}); grad norm {run.grad_norms[1]} vs {ref.grad_norms[1]} (rel {norm_rel:.1e});"
        f" MTP loss {run.mtp_losses.get(1)} vs {ref.mtp_losses.get(1)}"
    )
    assert loss_rel[0] < REL and norm_rel < REL
    assert max(loss_rel) < REL_LATER_STEPS


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")
@pytest.mark.parametrize("name", list(SETTINGS))
def test_parallel_run_matches_single_process(name, start, single):
    env, iters, flags = SETTINGS[name]
    run = run_script((*flags, *NO_EVAL), CKPT_LOAD=start, TRAIN_ITERS=iters, **MODEL, **env).check()
    ref = single["bshd" if env.get("PACKED") == 0 else "thd"]
    assert_tracks(name, run, ref, iters)
    # the throughput accounting counts the global batch's real tokens once, whatever the layout
    assert run.tokens[1] == ref.tokens[1], (run.tokens[1], ref.tokens[1])
    if "CP" not in name:
        assert _rel(run.mtp_losses[1], ref.mtp_losses[1]) < REL


def _worker(module: str, nproc: int, *args) -> list[dict]:
    """Every ``RESULT`` line of a worker module of this folder, through the project's torchrun launcher on
    the tests' warm engine (the worker a module on PYTHONPATH, so that its ranks fork from the engine)."""
    cmd = [
        sys.executable,
        "-m",
        "examples.multimodal_dev.launcher.torchrun",
        "--nproc-per-node",
        str(nproc),
        "--standalone",
        "--module",
        module,
        *map(str, args),
    ]
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join((here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")))
    env = on_warm_engine({**os.environ, "PYTHONPATH": path})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(line[len("RESULT ") :]) for line in lines]


def _language_model_alone(checkpoint, tp: int, sp: bool) -> dict:
    """The language-model worker's result (its last rank prints it)."""
    return _worker("language_model_worker", tp, checkpoint, tp, int(sp))[-1]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")
def test_language_model_alone_under_tp_and_sp(start):
    checkpoint = start / "iter_0000001"
    one, tp2 = _language_model_alone(checkpoint, 1, False), _language_model_alone(checkpoint, 2, True)
    print("single:", one, "\nTP=2 SP:", tp2)
    # the standalone forward returns a loss for every token of the row: nothing doubled or lost
    assert tp2["lm_loss_shape"] == [1, tp2["row_tokens"]] and one["lm_loss_shape"] == [1, one["row_tokens"]]
    assert _rel(tp2["lm_loss"], one["lm_loss"]) < REL and _rel(tp2["vlm_loss"], one["vlm_loss"]) < REL
    assert _rel(tp2["lm_loss"], tp2["vlm_loss"]) < 1e-6  # text-only VLM == its language model
    assert _rel(tp2["grad_norm"], one["grad_norm"]) < REL


def _generated(checkpoint, tp: int, ep: int, sp: bool, end: int) -> dict:
    """Every prompt's tokens from ``generation_worker`` at TP x EP on TP * EP ranks."""
    tokens = {}
    for result in _worker("generation_worker", tp * ep, checkpoint, tp, ep, int(sp), end):
        tokens.update(result["tokens"])
    return tokens


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")
def test_generation_at_tp_and_ep_equals_one_process(start):
    """Greedy tokens of four prompts (images, text) at TP=2 with sequence parallelism (switched off while
    decoding), at EP=2 with each data-parallel replica answering prompts of its own, and at both on four
    ranks, equal one process's. An end token (prompt 2's third) ends rows early, so a replica keeps
    stepping for the other's experts after its own rows are done."""
    checkpoint = start / "iter_0000001"
    single = _generated(checkpoint, 1, 1, False, -1)
    end = single["2"][2]
    expected = {p: t[: t.index(end) + 1] if end in t else t for p, t in single.items()}
    assert len(expected["2"]) == 3 and any(len(t) == 10 for t in expected.values())
    for tp, ep, sp in ((2, 1, True), (1, 2, False), (2, 2, True)):
        assert _generated(checkpoint, tp, ep, sp, end) == expected, (tp, ep, sp)


@pytest.fixture(scope="module")
def video_runs(start, tmp_path_factory):
    """mock_video (images, and videos whose frames are dealt to CP ranks one by one), one step from one
    checkpoint: {CP: (run, the vision tower's grad norms)} for CP = 1, 2, 4. The MoE's load-balancing
    loss is off: megatron-core computes it from each rank's own tokens, so under CP its gradient, which
    reaches the tower through the features, depends on the split by construction (with it on, the
    tower's grad norm differed by 1.1e-3 at CP=2 and 3.5e-3 at CP=4; with it off, by 5e-9)."""
    from launch import run_recording_vision_norms

    folder = tmp_path_factory.mktemp("video_cp")
    env = dict(MODEL, DATASET="mock_video", CKPT_LOAD=start, TRAIN_ITERS=1)
    flags = (*NO_EVAL, "--moe-aux-loss-coeff", "0")
    return {cp: run_recording_vision_norms(folder, f"cp{cp}", flags, CP=cp, **env) for cp in (1, 2, 4)}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")
def test_video_frames_dealt_over_cp_ranks_track_one_process(video_runs):
    """The loss, the grad norm and the vision tower's own grad norm of the first step at CP=2 and CP=4."""
    ref, ref_norms = video_runs[1]
    differences = {}
    for cp in (2, 4):
        run, norms = video_runs[cp]
        differences[cp] = [
            _rel(run.losses[1], ref.losses[1]),
            _rel(run.grad_norms[1], ref.grad_norms[1]),
            _rel(norms[1], ref_norms[1]),
        ]
    print(f"relative differences (loss, grad norm, vision grad norm) by CP: {differences}")
    assert max(max(d) for d in differences.values()) < REL, differences


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")
def test_a_chunked_tower_on_ranks_of_its_own_tracks_one_process(video_runs, start, tmp_path):
    """The same first step with the tower on a rank of its own (VISION_NPROC=1) running its frames in
    chunks of at most 64 patches (``--vision-chunk-patches``): the recomputed chunks' features cross to
    the language model's rank and their gradients come back as one pass's would."""
    from launch import run_recording_vision_norms

    ref, ref_norms = video_runs[1]
    flags = (*NO_EVAL, "--moe-aux-loss-coeff", "0", "--vision-chunk-patches", "64")
    env = dict(MODEL, DATASET="mock_video", CKPT_LOAD=start, TRAIN_ITERS=1, VISION_NPROC=1)
    run, norms = run_recording_vision_norms(tmp_path, "chunked", flags, **env)
    differences = [
        _rel(run.losses[1], ref.losses[1]),
        _rel(run.grad_norms[1], ref.grad_norms[1]),
        _rel(norms[1], ref_norms[1]),
    ]
    print(f"chunked tower on its own rank against one process (loss, grad norm, vision grad norm): {differences}")
    assert max(differences) < REL, differences


# experts split over EP with a padded capacity: the grouped experts' dispatcher sizes its permutation
# from the capacity (models/common/sized_dispatch.py: no host read), megatron-core's reads the counts
DROP_AND_PAD = ("--moe-expert-capacity-factor", "0.5", "--moe-pad-expert-input-to-capacity", *NO_EVAL)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")
def test_drop_and_pad_at_ep2_grouped_experts_match_sequential_mlp(start):
    """At EP=2 with a capacity that drops tokens and pads: the grouped experts behind the dispatcher
    sized on the host against SequentialMLP behind megatron-core's, from one checkpoint."""
    env = dict(CKPT_LOAD=start, TRAIN_ITERS=2, EP=2, NPROC=2, **MODEL)
    grouped = run_script(DROP_AND_PAD, **env).check()
    sequential = run_script(DROP_AND_PAD, GROUPED_EXPERTS=0, **env).check()
    assert_tracks("EP=2 drop-and-pad, grouped vs SequentialMLP", grouped, sequential, 2)
