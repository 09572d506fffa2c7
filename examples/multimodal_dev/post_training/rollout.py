"""GRPO's rollout: a micro-batch of prompts (``data/prompts.py``) -> ``N`` answers a prompt drawn by the
cached decoder on the training ranks at the training layout (``generation/decode.py``), scored, and
packed (THD) as contract samples, each trained on its answer only: the batch the training step's
forwards read, and the terms its loss reads (``grpo.py``).

Answer ``k`` of the item at index ``i`` of the run's sample stream draws from a generator seeded by
(``--seed``, ``i``, ``k``): nothing to save, so a resumed run draws the answers the straight run drew,
whatever the layout (a row's tokens do not depend on the rows beside it). The answers are drawn at
temperature 1 from the model's distribution, the policy whose log-probabilities the loss reads, less
the vision placeholders, which are never drawn (an answer holds no image). The model is in eval mode
while decoding (as evaluation by generation puts it); the run's dropout is 0, so the decoder and the
training forward compute the same function.
"""

from __future__ import annotations

import functools
import hashlib
import time
from dataclasses import dataclass

import torch

from ..data.batch import PackedBatch, PromptBatch
from ..data.collate import pack_thd
from ..data.processor import answer_end_ids, answer_text, load_processor
from ..data.sample import IGNORE_INDEX, VisionTokens
from ..generation.decode import Prompt, Sampling, generate
from . import grpo


@dataclass
class Rollout:
    """One micro-batch's answers, as the training step reads them."""

    batch: PackedBatch  # prompt + answer of every answer, on the host
    positions: torch.Tensor  # [T] the answer tokens' places in the packed row (flattened), on the model's device
    old_log_probs: torch.Tensor  # [T] the decoder's log-probabilities of them
    advantages: torch.Tensor  # [T] each token's answer's
    rewards: list[float]  # [P*N]
    spread: float  # the sum of the groups' reward std
    groups: int
    seconds: float  # decoding's wall time


def answer_seed(seed: int, index: int, k: int) -> int:
    """The generator seed of answer ``k`` to the item at ``index`` of the sample stream."""
    digest = hashlib.blake2b(f"grpo/{seed}/{index}/{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch seeds are below 2**63


@functools.cache
def _processor(path: str, min_pixels, max_pixels):
    return load_processor(path, min_pixels, max_pixels)


def answered_sample(prompt: dict, answer: list[int]) -> dict:
    """The contract sample (data/sample.py) of ``prompt`` followed by ``answer``, trained on the answer."""
    ids = prompt["input_ids"].to(torch.long)
    input_ids = torch.cat([ids, torch.tensor(answer, dtype=torch.long)])
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[ids.numel() - 1 : -1] = input_ids[ids.numel() :]  # position i predicts token i + 1
    sample = {"input_ids": input_ids, "labels": labels, "loss_mask": (labels != IGNORE_INDEX).float()}
    for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        has = prompt.get(grid) is not None
        sample[grid] = prompt[grid] if has else torch.zeros(0, 3, dtype=torch.long)
        sample[pixels] = prompt[pixels] if has else torch.zeros(0)
    return sample


def roll_out(model, prompts: PromptBatch, settings: grpo.Settings, args, pad_multiple: int) -> Rollout:
    """Draw, score and pack the answers of one micro-batch; ``model``: megatron's model chunk."""
    from megatron.core.utils import unwrap_model

    vlm = unwrap_model(model)
    processor, info = _processor(args.hf_processor_path, args.min_pixels, args.max_pixels)
    reward = grpo.reward_function(settings.reward)
    tokens = VisionTokens.from_shape(vlm.shape)
    n = settings.samples
    rows = [
        Prompt(p["input_ids"].tolist(), **{k: v for k, v in p.items() if k != "input_ids"})
        for p in prompts.prompts
        for _ in range(n)
    ]
    samplings = [
        Sampling(temperature=1.0, seed=answer_seed(args.seed, i, k)) for i in prompts.indices for k in range(n)
    ]
    limits = [min(settings.max_new_tokens, args.seq_length - len(row.input_ids)) for row in rows]
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        done = generate(
            model,
            rows,
            settings.max_new_tokens,
            answer_end_ids(processor, info),
            samplings,
            keep_log_probs=True,
            banned_ids=(tokens.image, tokens.video, tokens.vision_start, tokens.vision_end),
            row_limits=limits,
        )
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    references = [r for r in prompts.references for _ in range(n)]
    rewards = [float(reward(answer_text(processor, t), ref)) for t, ref in zip(done.tokens, references)]
    samples = [answered_sample(p, t) for p, t in zip((p for p in prompts.prompts for _ in range(n)), done.tokens)]
    batch = pack_thd(samples, tokens, pad_multiple)
    assert batch.loss_mask is not None
    device = next(vlm.parameters()).device
    lengths = torch.tensor([len(t) for t in done.tokens])
    advantages = grpo.group_advantages(torch.tensor(rewards), n).repeat_interleave(lengths)
    old = torch.tensor([lp for row in done.log_probs for lp in row], dtype=torch.float32)
    spread = torch.tensor(rewards, dtype=torch.float64).view(-1, n).std(1, unbiased=False).sum()
    return Rollout(
        batch=batch,
        positions=batch.loss_mask.reshape(-1).nonzero()[:, 0].to(device),
        old_log_probs=old.to(device),
        advantages=advantages.to(device),
        rewards=rewards,
        spread=float(spread),
        groups=len(prompts.prompts),
        seconds=seconds,
    )
