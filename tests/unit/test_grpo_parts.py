"""GRPO's parts (post_training/grpo.py, rollout.py, data/prompts.py) against their formulas, and its
settings refused by name by the launcher and the trainer alike."""

import math

import pytest
import torch
from test_checked_once import _launcher_says, _trainer_says

from examples.multimodal_dev.post_training import grpo, rollout


def test_grpo_advantages_are_normalised_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    a = grpo.group_advantages(rewards, 4)
    std = math.sqrt(0.25 * 0.75)  # population std of one 1 among four
    expected = [(1 - 0.25) / (std + 1e-4)] + [(0 - 0.25) / (std + 1e-4)] * 3 + [0.0] * 4
    assert torch.allclose(a, torch.tensor(expected), atol=1e-6), a


def test_grpo_token_losses_equal_the_clipped_objective_and_k3():
    settings = grpo.Settings(clip=0.2, kl_weight=0.5)
    policy = torch.tensor([-1.0, -2.0, -0.5])
    old = torch.tensor([-1.0, -2.5, -0.2])  # ratios 1, e^0.5 (clipped up), e^-0.3 (clipped down)
    reference = torch.tensor([-1.2, -2.0, -0.1])
    advantages = torch.tensor([1.0, 1.0, -1.0])
    losses, kl = grpo.token_losses(policy, old, reference, advantages, settings)
    for t in range(3):
        ratio = math.exp(policy[t] - old[t])
        a = float(advantages[t])
        surrogate = min(ratio * a, min(max(ratio, 0.8), 1.2) * a)
        d = float(reference[t] - policy[t])
        k3 = math.exp(d) - d - 1
        assert abs(float(kl[t]) - k3) < 1e-6 and abs(float(losses[t]) - (-surrogate + 0.5 * k3)) < 1e-6, t


def test_grpo_rewards_by_name_and_a_users_own_only_when_asked():
    assert grpo.reward_function("exact_match")("The 7.", "7") == 1.0
    assert grpo.reward_function("field_f1")('{"a": "1"}', '{"a": "1", "b": "2"}') == pytest.approx(2 / 3)
    assert grpo.reward_function("python:math.hypot")(3, 4) == 5.0  # a dotted path, as asked for
    for name, said in (("exact", "expected one of exact_match"), ("python:nowhere.f", "cannot import 'nowhere.f'")):
        with pytest.raises(ValueError, match=said):
            grpo.reward_function(name)


def test_grpo_answer_seeds_depend_on_seed_index_and_answer_only():
    seeds = {rollout.answer_seed(s, i, k) for s in (1, 2) for i in range(4) for k in range(8)}
    assert len(seeds) == 64 and all(0 <= s < 2**63 for s in seeds)
    assert rollout.answer_seed(1, 3, 5) == rollout.answer_seed(1, 3, 5)


def test_grpo_answered_sample_trains_the_answer_only():
    prompt = {"input_ids": torch.tensor([5, 6, 7]), "pixel_values": None, "image_grid_thw": None}
    sample = rollout.answered_sample(prompt, [8, 9])
    assert sample["input_ids"].tolist() == [5, 6, 7, 8, 9]
    assert sample["labels"].tolist() == [-100, -100, 8, 9, -100]
    assert sample["loss_mask"].tolist() == [0, 0, 1, 1, 0]
    assert sample["image_grid_thw"].shape == (0, 3)


GRPO_ENV = dict(TRAIN_MODE="grpo", DATASET="jsonl", DATA_PATH="/d.jsonl", HF_PROCESSOR_PATH="/p", LORA_RANK="4")
GRPO_ARGV = "--train-mode grpo --dataset-provider jsonl --data-path /d.jsonl --hf-processor-path /p --lora-rank 4"


@pytest.mark.parametrize(
    "environ,argv,world,said",
    [
        (dict(GRPO_SAMPLES="4"), ["--grpo-samples", "4"], 1, "GRPO_SAMPLES=4 without TRAIN_MODE=grpo"),
        (dict(GRPO_ENV, CP="2"), [*GRPO_ARGV.split(), "--context-parallel-size", "2"], 2, "TRAIN_MODE=grpo with CP=2"),
        (
            dict(GRPO_ENV, PP="2"),
            [*GRPO_ARGV.split(), "--pipeline-model-parallel-size", "2"],
            2,
            "TRAIN_MODE=grpo with PP=2: the answers are drawn by the decoder",
        ),
        (
            dict(GRPO_ENV, VISION_NPROC="1"),
            [*GRPO_ARGV.split(), "--vision-nproc", "1"],
            2,
            "TRAIN_MODE=grpo with VISION_NPROC=1: the answers are drawn by the decoder",
        ),
        (
            dict(GRPO_ENV, GRPO_SAMPLES="1"),
            [*GRPO_ARGV.split(), "--grpo-samples", "1"],
            1,
            "GRPO_SAMPLES=1: at least 2",
        ),
        (dict(GRPO_ENV, GRPO_REWARD="bleu"), [*GRPO_ARGV.split(), "--grpo-reward", "bleu"], 1, "GRPO_REWARD=bleu"),
    ],
    ids=["samples alone", "context parallel", "pipeline", "tower on its own ranks", "one answer", "unknown reward"],
)
def test_grpo_settings_it_cannot_run_are_refused_by_name(monkeypatch, environ, argv, world, said):
    """The launcher's line, and the trainer's, which starts with it and names the flags."""
    line = _launcher_says({"MODEL_VARIANT": "tiny", **environ})
    assert line.startswith(said), line
    trainer = _trainer_says(argv, world, monkeypatch)
    assert trainer is not None and trainer.startswith(line + " ("), (line, trainer)
