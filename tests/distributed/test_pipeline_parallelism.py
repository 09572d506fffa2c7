"""Pipeline parallelism against one process, from one checkpoint: 1F1B, interleaved (VP), an
uneven split, and PP combined with TP + SP, CP and EP.

Every run is ``run_qwen35_vl.sh`` (torchrun, gloo, fp32) on the ``tiny`` MoE model with the MTP
head (4 decoder layers, Gated DeltaNet x3 then attention), from the checkpoint of
``parallel_start``, on the mock data's first global batch of 8 samples in micro-batches of ONE
sample: 8 micro-batches a step at DP=1, so the schedules run warm-up, steady state and
cool-down, and micro-batches 0 and 4 carry no image (checked below) while the others carry one
or two. The single process runs the same micro-batches (the MoE load-balancing loss is per
micro-batch, so the micro-batch size must match). Compared: lm loss and grad norm of the first
step (1e-5 relative), MTP loss (1e-5), the real tokens counted once, and the lm loss of every
later step (1e-4: "tracks", see test_parallelism.py for why).

Stage contents: the even split (the TP, CP and EP mixes) puts layers 0-1 (Gated DeltaNet only)
on stage 0 with the vision tower, 2-3 on stage 1 with the output layer and MTP head;
``PP_FIRST=1`` leaves one GDN layer on stage 0; VP=2 runs layers 0 | 2 on rank 0, 1 | 3 on rank 1.
The interleaved run records (tests/hooks) every rank's parameters and every tensor it sends to
another stage: vision parameters exist on the first stage's first chunk only, and only decoder
activations [T, 1, H] cross stages.

Tied embeddings (dense ``tiny`` with ``tie_word_embeddings`` and the MTP head, as 0.8b, 2b and 4b):
the word embedding lives on stage 0 and a copy on stage 1, which the output layer and the MTP head
read; their gradients must be summed across the two (megatron's finalize_model_grads) for PP=2 to
train like one process. That run starts from a Hugging Face import (an import trains directly at
PP>1), saves at PP=2, and the saved checkpoint resumes in one process onto the straight run's
next step: megatron-core 0.19.2 allocates an unused output weight on that stage, whose checkpoint
it then refuses, until the model drops it (``qwen35_vl/model.py``).
"""

import dataclasses
import json
import os

import pytest
import torch
from hf_checkpoints import write_hf_checkpoint
from launch import NO_EVAL, PARALLEL_MODEL, run_script

from examples.multimodal_dev.checkpoint.hf_import import import_hf
from examples.multimodal_dev.data import get_dataset_provider
from examples.multimodal_dev.data.sample import VisionTokens
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant

MODEL = dict(PARALLEL_MODEL, MBS=1, GBS=8)
REL, REL_LATER_STEPS = 1e-5, 1e-4
ITERS = 3

# name -> environment
SETTINGS = {
    "PP=2 1F1B, uneven 1+3 layers": dict(PP=2, PP_FIRST=1),
    "PP=2 VP=2 interleaved": dict(PP=2, VP=2),
    "PP=2 x TP=2 SP": dict(PP=2, TP=2),
    "PP=2 x CP=2": dict(PP=2, CP=2),
    "PP=2 x EP=2 (DP=2)": dict(PP=2, EP=2, NPROC=4),
}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def single(one_process_per_sample):
    return one_process_per_sample[0]  # the same model, batches and ITERS steps (conftest.py)


def test_first_batch_mixes_micro_batches_with_and_without_images():
    shape = get_variant("tiny", moe=True)
    train = get_dataset_provider("mock")(
        tokens=VisionTokens.from_shape(shape),
        vocab_size=shape.text.vocab_size,
        patch_dim=shape.vision.patch_dim,
        seq_length=512,
        num_samples=(8, 0, 0),
        seed=1234,
        mean_text_tokens=96,
    )[0]
    images = [len(train[i]["image_grid_thw"]) for i in range(8)]
    assert 0 in images and max(images) > 0, images


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")
@pytest.mark.parametrize("name", list(SETTINGS))
def test_pipeline_run_matches_single_process(name, parallel_start, single, tmp_path):
    env = dict(SETTINGS[name])
    if "VP" in env:
        env["RECORD_PIPELINE"] = tmp_path
    run = run_script(NO_EVAL, CKPT_LOAD=parallel_start, TRAIN_ITERS=ITERS, **MODEL, **env).check()
    loss_rel = [_rel(run.losses[i], single.losses[i]) for i in range(1, ITERS + 1)]
    norm_rel = _rel(run.grad_norms[1], single.grad_norms[1])
    mtp_rel = _rel(run.mtp_losses[1], single.mtp_losses[1])
    print(
        f"{name}: losses {[run.losses[i] for i in range(1, ITERS + 1)]} vs "
        f"{[single.losses[i] for i in range(1, ITERS + 1)]} (first rel {loss_rel[0]:.1e}, max rel "
        f"{max(loss_rel):.1e}); grad norm {run.grad_norms[1]} vs {single.grad_norms[1]} (rel {norm_rel:.1e}); "
        f"MTP loss rel {mtp_rel:.1e}"
    )
    assert loss_rel[0] < REL and norm_rel < REL
    assert max(loss_rel) < REL_LATER_STEPS
    assert run.tokens[1] == single.tokens[1], (run.tokens[1], single.tokens[1])
    if "CP" not in name:  # megatron logs the MTP loss as a mean of per-rank means (test_parallelism.py)
        assert mtp_rel < REL
    if "VP" in env:
        _check_stage_contents(tmp_path, hidden=get_variant("tiny", moe=True).text.hidden_size)


def _check_stage_contents(record_dir, hidden: int):
    records = [json.load(open(os.path.join(record_dir, f))) for f in sorted(os.listdir(record_dir))]
    assert len(records) == 2
    for record in records:
        first_chunk_of_first_stage = record["pp_rank"] == 0
        for index, names in enumerate(record["chunks"]):
            vision = [n for n in names if "vision_model." in n]  # names carry the DDP wrapper's prefix
            if first_chunk_of_first_stage and index == 0:
                assert vision, "the first stage's first chunk must hold the vision tower"
            else:
                assert not vision, (record["pp_rank"], index, vision[:3])
        assert record["sent"], "every stage sends activations or their gradients"
        for shape, dtype in record["sent"]:
            # THD activations (or their gradients): [tokens, 1, hidden]; pixels would be [patches, patch_dim]
            assert len(shape) == 3 and shape[1:] == [1, hidden] and dtype == "torch.float32", (shape, dtype)
    print("sent between stages:", sorted({tuple(s) for r in records for s, _ in r["sent"]})[:4], "...")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")
def test_tied_embeddings_train_across_stages(tmp_path, mcore):
    shape = get_variant("tiny", moe=False, mtp=True)
    shape = dataclasses.replace(shape, text=dataclasses.replace(shape.text, tie_word_embeddings=True))
    write_hf_checkpoint(tmp_path / "hf", shape, dtype=torch.float32)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"))
    common = dict(CKPT_LOAD=tmp_path / "imported", TRAIN_ITERS=ITERS + 1, SEQ_LEN=512, MBS=2, GBS=8)
    single = run_script(NO_EVAL, **common).check()
    run = run_script((*NO_EVAL, "--exit-interval", str(ITERS)), PP=2, CKPT_RESUME=tmp_path / "pp2", **common).check()
    resumed = run_script(NO_EVAL, CKPT_RESUME=tmp_path / "pp2", **common).check()  # one process
    loss_rel = [_rel(run.losses[i], single.losses[i]) for i in range(1, ITERS + 1)]
    norm_rel = [_rel(run.grad_norms[i], single.grad_norms[i]) for i in range(1, ITERS + 1)]
    mtp_rel = _rel(run.mtp_losses[1], single.mtp_losses[1])
    resumed_rel = _rel(resumed.losses[ITERS + 1], single.losses[ITERS + 1])
    print(
        f"tied embeddings with MTP, PP=2: loss rel {[f'{r:.1e}' for r in loss_rel]}, grad norm rel "
        f"{[f'{r:.1e}' for r in norm_rel]}, MTP loss rel {mtp_rel:.1e}; its checkpoint in one process: step "
        f"{ITERS + 1} loss rel {resumed_rel:.1e}"
    )
    assert sorted(run.losses) == list(range(1, ITERS + 1)) and sorted(resumed.losses) == [ITERS + 1]
    assert loss_rel[0] < REL and norm_rel[0] < REL and mtp_rel < REL and max(loss_rel) < REL_LATER_STEPS
    assert resumed_rel < REL_LATER_STEPS
