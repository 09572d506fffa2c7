"""The sigmoid DPO loss (Rafailov et al., 2023) on packed preference pairs, in megatron.training's form.

A micro-batch holds ``P`` pairs as ``2P`` packed samples, pair ``k`` at samples ``2k`` (chosen) and
``2k+1`` (rejected) (``data/preferences.py``). The model's output is the per-token loss
``-log p(label)``; a sample's log-probability ``log pi(y | x)`` is minus its sum over the answer's
trained positions. The reference's is the same forward with the LoRA adapters off
(``lora/switch.py``), run first, without a graph: no second copy of the weights, and one model's
kernels and rounding on both sides of the ratio.

    z_k    = beta * ((log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r)))
    loss_k = -log sigmoid(z_k)

``loss_func`` returns ``(sum of loss_k, P, report)``: with ``--calculate-per-token-loss`` megatron
divides by the pairs of the whole global batch, so the step's loss is the mean over pairs whatever
the micro-batches and data-parallel ranks. Logged per pair: ``dpo loss``, ``reward margin`` (z_k,
beta times the log-ratio difference) and ``preference accuracy`` (z_k > 0).

Under context parallelism each rank holds a share of every sample's tokens: the per-sample sums are
summed over the CP group before the sigmoid, with an identity backward, so each rank's tokens get
the whole loss's gradient and megatron's sum of the CP ranks' gradients is the gradient. Only the
first CP rank counts the pairs and reports, since megatron sums both over data and context ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import mappings

from ..data.batch import PackedBatch
from ..models.common.batch_memo import on_host
from ..models.common.context_parallel import ContextParallelSplit
from ..models.setting_names import ON_THE_BASE_MODES

DEFAULT_BETA = 0.1


def sample_ids(batch: PackedBatch, split: ContextParallelSplit | None) -> torch.Tensor:
    """The sample each token of the (CP rank's share of the) row belongs to, ``[B, S_local]`` long, on
    the host: from the packed boundaries (THD), or the row itself (BSHD)."""
    if batch.cu_seqlens_padded is not None:  # THD
        bounds = on_host(batch.cu_seqlens_padded).to(torch.long)
        ids = torch.repeat_interleave(torch.arange(bounds.numel() - 1), torch.diff(bounds)).unsqueeze(0)
    else:
        rows, width = batch.tokens.shape
        ids = torch.arange(rows).unsqueeze(1).expand(rows, width)
    return ids if split is None else ids.index_select(1, split.positions)  # the model's take() of its tokens


class SequenceLogProbs:
    """Per-sample answer log-probabilities of a batch's token losses, the same rule for policy and
    reference: ``__call__(token_losses [B, S_local], loss_mask [B, S_local]) -> [2P]``."""

    def __init__(self, batch: PackedBatch, cp_group):
        assert batch.stats is not None, "the collate's stats carry the batch's sample count"
        self.pairs = batch.stats.samples // 2  # the host's count; a row padded for dispatch adds none
        split = None
        if cp_group is not None and cp_group.size() > 1:  # the model's own split of every per-token tensor
            bounds = batch.cu_seqlens_padded if batch.thd else None
            split = ContextParallelSplit(batch.tokens.shape[1], cp_group.size(), cp_group.rank(), bounds)
        self.cp_group = cp_group if split is not None else None
        ids = sample_ids(batch, split).reshape(-1)
        self.bins = int(ids.max()) + 1 if ids.numel() else 0  # on the host: no read back
        self.ids = ids.to(batch.tokens.device, non_blocking=True)

    def __call__(self, token_losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        log_probs = -(token_losses.float() * loss_mask.float()).reshape(-1)
        sums = log_probs.new_zeros(self.bins).index_add(0, self.ids, log_probs)
        if self.cp_group is not None:  # sum of the shares; each rank's share gets the whole gradient
            sums = mappings.reduce_from_tensor_model_parallel_region(sums, group=self.cp_group)
        return sums[: 2 * self.pairs]


def pair_terms(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> torch.Tensor:
    """z_k of every pair from the [2P] log-probabilities (chosen, rejected, chosen, ...)."""
    ratio = policy - reference.detach()
    return beta * (ratio[0::2] - ratio[1::2])


def loss_func(log_probs: SequenceLogProbs, reference: torch.Tensor, beta: float, counts: bool, loss_mask, output):
    """megatron's ``loss_func`` of one micro-batch: (sum of the pairs' losses, pairs, report).
    ``counts``: this rank reports and counts the pairs (the first of its CP group)."""
    z = pair_terms(log_probs(output, loss_mask), reference, beta)
    losses = -F.logsigmoid(z)
    loss_sum = losses.sum()
    pairs = torch.tensor(z.numel() if counts else 0, dtype=torch.int, device=z.device)
    stats = torch.stack([loss_sum.detach(), z.detach().sum(), (z.detach() > 0).float().sum()])
    stats = stats if counts else torch.zeros_like(stats)
    n = pairs.float()
    report = {
        "dpo loss": torch.stack([stats[0], n]),
        "reward margin": torch.stack([stats[1], n]),
        "preference accuracy": torch.stack([stats[2], n]),
    }
    return loss_sum, pairs, report


def without_router_loss(args, typed) -> str | None:
    """Under DPO (and GRPO) the routers' load-balancing loss is off unless ``--moe-aux-loss-coeff`` is given; the
    line that says so, or None. The routers are frozen under LoRA (DPO's reference needs it), and with
    ``--calculate-per-token-loss`` megatron weighs that loss by the batch's count (here pairs, not
    tokens) and computes it on each CP rank's tokens: its pull on the adapters would change with the
    batch and the layout (measured: the grad norm at CP=2 4e-3 off one process's with it, 1e-7 without)."""
    if args.train_mode not in ON_THE_BASE_MODES or not args.num_experts or "moe_aux_loss_coeff" in typed:
        return None
    args.moe_aux_loss_coeff = 0.0  # the model's recipe leaves it to args under DPO (qwen35_vl/configuration.py)
    return (
        f"TRAIN_MODE={args.train_mode}: the routers' load-balancing loss is off (--moe-aux-loss-coeff 0; give the "
        "flag to keep it): the routers are frozen under LoRA, and its weight would change with the batch and layout"
    )
