"""GRPO through ``run_qwen35_vl.sh`` (``TRAIN_MODE=grpo``) on the tiny MoE model (a vocabulary of 128),
fp32, LoRA on the default targets, the answers drawn on the training ranks and scored by exact match.

- On a toy task (eight prompts in the three formats, half with an image, whose reference is "7"), the
  mean reward rises from chance (~1/128) to above 0.8 within 20 steps.
- The log-probabilities the training forward computes for the drawn tokens equal the decoder's (the
  logged ``logprob gap``, the largest over the step's tokens at one micro-batch a step) within 1e-5, for
  answers of several tokens, under packing and MRoPE.
- Stopped at step 18 and resumed, the run gives the straight run's steps 19 and 20 bitwise: the
  answers' sampling state is the seed and the sample's index.
- From the trained checkpoint, TP=2 with SP and EP=2 track the single process (``test_parallelism.py``'s
  bounds), the same answers drawn (equal mean reward and answer length) and the same work counted.
"""

import os
from dataclasses import replace

import pytest
import torch
from hf_checkpoints import write_hf_checkpoint
from launch import NO_EVAL, run_script, stopped_at
from post_training import write_grpo_prompts
from test_parallelism import assert_tracks

from examples.multimodal_dev.tools.convert_checkpoint import main

PROMPTS = 8
COMMON = dict(TRAIN_MODE="grpo", LORA_RANK=4, LORA_ALPHA=8, SEQ_LEN=512, MBS=4, GBS=PROMPTS, MOE=1)
TRAINED = dict(TRAIN_ITERS=20, LR=1e-2, GRPO_MAX_NEW_TOKENS=1)  # one token: "7" or not
LONGER = dict(TRAIN_ITERS=2, GRPO_MAX_NEW_TOKENS=6)


@pytest.fixture(scope="module")
def grpo_base(tmp_path_factory):
    """(the import of a random base whose vocabulary is the processor's, rounded up; the data variables)."""
    from tiny_processor import QWEN35_CHAT_TEMPLATE, build_processor, tiny_shape_for

    root = tmp_path_factory.mktemp("grpo")
    hf, imported = root / "hf", root / "imported"
    processor = build_processor(str(hf), chat_template=QWEN35_CHAT_TEMPLATE)
    shape = tiny_shape_for(processor, moe=True)
    write_hf_checkpoint(hf, replace(shape, text=replace(shape.text, vocab_size=128)), dtype=torch.float32)
    assert main(["import", "--hf-path", str(hf), "--megatron-path", str(imported)]) == 0
    data = dict(DATASET="jsonl", DATA_PATH=write_grpo_prompts(str(root / "data")), HF_PROCESSOR_PATH=processor)
    # the shape of every run, a LoRA checkpoint's included (it holds no hf_config.json of its own)
    return imported, dict(data, HF_CONFIG=str(imported / "hf_config.json"))


@pytest.fixture(scope="module")
def grpo_trained(grpo_base, tmp_path_factory):
    imported, data = grpo_base
    path = tmp_path_factory.mktemp("grpo_trained") / "tuned"
    run = run_script(NO_EVAL, CKPT_LOAD=imported, CKPT_SAVE=path, SAVE_INTERVAL=18, **TRAINED, **COMMON, **data)
    return run.check(), path


@pytest.fixture(scope="module")
def grpo_from_trained(grpo_base, grpo_trained):
    """2 steps of answers up to 6 tokens from the trained checkpoint, one process."""
    return run_script(NO_EVAL, CKPT_LOAD=grpo_trained[1], **LONGER, **COMMON, **grpo_base[1]).check()


def test_grpo_mean_reward_rises_from_chance_within_20_steps(grpo_trained):
    run, _ = grpo_trained
    reward = {i: r["mean reward"] for i, r in run.records.items()}
    print(f"GRPO: mean reward by step {[round(reward[i], 3) for i in sorted(reward)]}")
    first, last = sum(reward[i] for i in (1, 2, 3)) / 3, sum(reward[i] for i in (18, 19, 20)) / 3
    assert first < 0.2 and last > 0.8, (first, last)
    assert run.records[1]["kl"] == 0  # the adapters start at B = 0: the policy is its reference
    assert all(run.records[i]["answer length"] == 1 for i in reward)
    # the step's work is counted though no collate packed its answers (grpo.step_work)
    assert all(run.records[i]["model_flops"] > 0 and run.records[i]["real_tokens"] > 0 for i in reward)
    assert "rollout tokens/s" in run.output and "mean reward" in run.output


def test_grpo_recomputed_log_probs_equal_the_decoders(grpo_trained, grpo_from_trained):
    for run in (grpo_trained[0], grpo_from_trained):
        gaps = {i: r["logprob gap"] for i, r in run.records.items()}
        assert max(gaps.values()) <= 1e-5, gaps
    assert all(r["answer length"] > 2 for r in grpo_from_trained.records.values())  # decoded through the cache


def test_grpo_resumes_exactly(grpo_base, grpo_trained, tmp_path):
    imported, data = grpo_base
    straight, saved = grpo_trained
    resumed_path = stopped_at(saved, tmp_path / "resumed", 18)
    resumed = run_script(NO_EVAL, CKPT_LOAD=imported, CKPT_RESUME=resumed_path, **TRAINED, **COMMON, **data).check()
    assert sorted(resumed.losses) == [19, 20], sorted(resumed.losses)
    for i in (19, 20):
        for key in ("grpo loss", "mean reward", "kl", "grad norm"):
            assert resumed.records[i][key] == straight.records[i][key], (i, key)


LAYOUTS = {"TP=2 SP": dict(TP=2), "EP=2": dict(EP=2, NPROC=2)}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_grpo_layout_matches_single_process(name, grpo_base, grpo_trained, grpo_from_trained):
    run = run_script(NO_EVAL, CKPT_LOAD=grpo_trained[1], **LONGER, **COMMON, **grpo_base[1], **LAYOUTS[name])
    assert_tracks(f"GRPO {name}", run.check(), grpo_from_trained, 2)
    for i in (1, 2):
        for key in ("mean reward", "answer length", "real_tokens"):
            assert run.records[i][key] == grpo_from_trained.records[i][key], (name, i, key)
        flops = [r.records[i]["model_flops"] for r in (run, grpo_from_trained)]
        assert abs(flops[0] - flops[1]) <= 1e-9 * flops[1], (name, i, flops)  # summed over DP, not TP
