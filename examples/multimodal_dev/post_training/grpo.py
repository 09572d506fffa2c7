"""GRPO (Shao et al., 2024) on the training step: for each prompt of a micro-batch, ``N`` answers drawn
on the training ranks by the cached decoder (``rollout.py``), each scored against the prompt's
reference answer, and a clipped policy-gradient loss with a KL term to the reference.

    A_i       = (r_i - mean(r of its group)) / (std(r of its group) + 1e-4)      (population std)
    ratio_t   = exp(log pi(y_t) - log pi_old(y_t))
    loss_t    = -min(ratio_t A_i, clip(ratio_t, 1 - eps, 1 + eps) A_i) + beta * KL_t
    KL_t      = exp(log ref(y_t) - log pi(y_t)) - (log ref(y_t) - log pi(y_t)) - 1   (k3, >= 0)

over every answer token ``t`` of answer ``i``. ``pi_old`` is the decoder's own log-probability of the
token it drew (``generate(keep_log_probs=True)``): one update a rollout, so the ratio is 1 up to the
gap between the decoder and the training forward at the same weights, which is logged
(``logprob gap``: the largest over the micro-batch's tokens) and held to 1e-5 by a test. The reference
is the base with the LoRA adapters off (``lora/switch.py``), as DPO's.

``loss_func`` returns (sum of loss_t, answer tokens, report): with ``--calculate-per-token-loss``
megatron divides by the answer tokens of the whole global batch, a token-level mean (as DAPO and
Dr. GRPO weigh it: a long answer is not diluted). Logged: ``grpo loss``, ``mean reward``,
``reward spread`` (the groups' mean std), ``kl`` (per token), ``answer length`` (tokens),
``logprob gap``, and ``rollout tokens/s`` (this rank's decoding rate).

Rewards are ``evaluation/`` metrics by name (``REWARDS``); a user's own function, called
``fn(prediction: str, reference: str) -> float``, only when asked for as ``python:module.function``:
it runs the user's code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..evaluation.metrics import anls, exact_match, f1_of, field_counts, parse_json, token_f1, tree_accuracy
from ..models.setting_names import REWARD_NAMES

USER_REWARD = "python:"


def _field_f1(prediction: str, reference: str) -> float:
    return f1_of(*field_counts(parse_json(prediction), parse_json(reference)))


REWARDS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match,
    "token_f1": token_f1,
    "anls": lambda prediction, reference: anls(prediction, [reference]),
    "field_f1": _field_f1,  # the JSON answer's fields (a CORD-V2 receipt's)
    "tree_accuracy": lambda prediction, reference: tree_accuracy(parse_json(prediction), parse_json(reference)),
}
assert tuple(REWARDS) == REWARD_NAMES, "the launcher checks the names of models/setting_names.py"


@dataclass(frozen=True)
class Settings:
    """GRPO's settings, from megatron's args (``of``): None there is the default here."""

    samples: int = 8  # answers a prompt: the group
    max_new_tokens: int = 256
    reward: str = "exact_match"
    kl_weight: float = 0.04
    clip: float = 0.2

    @classmethod
    def of(cls, args) -> Settings:
        given = {name: getattr(args, f"grpo_{name}", None) for name in cls.__dataclass_fields__}
        return cls(**{name: value for name, value in given.items() if value is not None})


def step_work(batch, shape, settings: Settings):
    """The stats of a micro-batch of drawn answers (a packed ``PackedBatch``) with the FLOPs of the
    step's work on them, which no collate counted: drawing them (about one forward of every row, the
    cached decoder running each token once), the reference's forward (with the KL term) and the
    policy's forward and backward."""
    from ..training.throughput import batch_flops

    flops = batch_flops(shape, batch)
    return replace(batch.stats, model_flops=flops.training + (1 + bool(settings.kl_weight)) * flops.forward)


def reward_function(name: str) -> Callable[[str, str], float]:
    """The reward ``--grpo-reward`` names; ``ValueError`` in one line where there is none."""
    if name.startswith(USER_REWARD):
        path = name[len(USER_REWARD) :]
        module_name, _, attr = path.rpartition(".")
        try:
            function = getattr(importlib.import_module(module_name), attr) if module_name else None
        except (ImportError, AttributeError) as error:
            raise ValueError(f"--grpo-reward {name}: cannot import {path!r} ({error})") from None
        if not callable(function):
            raise ValueError(f"--grpo-reward {name}: expected module.function, a callable (prediction, reference)")
        return function
    if name not in REWARDS:
        raise ValueError(
            f"--grpo-reward {name}: expected one of {', '.join(REWARDS)}, or {USER_REWARD}module.function "
            "for a function of your own"
        )
    return REWARDS[name]


def group_advantages(rewards: torch.Tensor, samples: int) -> torch.Tensor:
    """Each answer's advantage [P*N] from the rewards [P*N] of P groups of ``samples`` answers in a row;
    a group whose answers all scored the same has none."""
    groups = rewards.double().view(-1, samples)
    mean, std = groups.mean(1, keepdim=True), groups.std(1, unbiased=False, keepdim=True)
    return ((groups - mean) / (std + 1e-4)).reshape(-1).float()


def token_losses(policy, old, reference, advantages, settings: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_t, KL_t) of every answer token [T] from the log-probabilities [T] of the policy, of the
    decoder that drew it, and of the reference (None: no KL term), and its answer's advantage [T]."""
    ratio = torch.exp(policy - old)
    clipped = ratio.clamp(1 - settings.clip, 1 + settings.clip)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    if reference is None:
        return -surrogate, torch.zeros_like(surrogate)
    delta = reference - policy
    kl = torch.exp(delta) - delta - 1
    return -surrogate + settings.kl_weight * kl, kl


def loss_func(terms, reference, settings: Settings, loss_mask, output):
    """megatron's ``loss_func`` of one micro-batch: (sum of the answer tokens' losses, their count,
    report). ``terms``: the micro-batch's ``rollout.Rollout``; ``reference``: the reference's
    log-probabilities of the answer tokens [T] (None without a KL term)."""
    del loss_mask  # the answer tokens are the rollout's ``positions``, known on the host
    policy = -output.reshape(-1).float().index_select(0, terms.positions)
    losses, kl = token_losses(policy, terms.old_log_probs, reference, terms.advantages, settings)
    loss_sum = losses.sum()
    count = torch.tensor(terms.positions.numel(), dtype=torch.int, device=loss_sum.device)
    gap = (policy.detach() - terms.old_log_probs).abs().max()
    on = loss_sum.device
    answers, tokens = float(len(terms.rewards)), float(terms.positions.numel())

    def pair(value, n: float):
        return torch.stack([torch.as_tensor(value, dtype=torch.float32, device=on), torch.tensor(n, device=on)])

    report = {
        "grpo loss": pair(loss_sum.detach(), tokens),
        "mean reward": pair(sum(terms.rewards), answers),
        "reward spread": pair(terms.spread, float(terms.groups)),
        "kl": pair(kl.detach().sum(), tokens),
        "answer length": pair(tokens, answers),
        "logprob gap": pair(gap, 1.0),
        "rollout tokens/s": pair(tokens, terms.seconds),
    }
    return loss_sum, count, report
