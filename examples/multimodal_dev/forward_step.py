"""Collated batch -> PackedSeqParams -> model -> per-token loss, in megatron.training's form.

``forward_step(data_iterator, model)`` returns ``(output_tensor, loss_func)``; ``loss_func``
returns ``(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})`` so the schedule sums
token losses and token counts over micro-batches and data-parallel ranks before dividing
(``--calculate-per-token-loss``). The reported loss therefore does not depend on how tokens
were packed or split. megatron.training calls it on every host.

Under context parallelism the model returns the losses of this rank's tokens together with their
loss mask (the model splits every per-token tensor once); the loss function uses that mask.

Under pipeline parallelism every stage draws the same micro-batch and keeps only what it reads
(``PackedBatch.for_stage``, applied once by each (virtual) stage's collate in dataset_provider.py,
so later stages never move pixels to the device): pixels and grids on the first stage, labels and
loss mask on the last; positions, packed-sequence boundaries, the padding mask and the token ids
(the row's length for MoE dispatch; the MTP head's input on the last stage) everywhere. Only decoder
activations cross stages.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from examples.multimodal_dev.arguments import megatron_args
from examples.multimodal_dev.data.batch import PackedBatch, PromptBatch, ServedBatches, from_megatron
from examples.multimodal_dev.data.collate import pad_multiple_for, pad_row_to
from examples.multimodal_dev.post_training import dpo, grpo, rollout
from examples.multimodal_dev.post_training.reference_pass import policy_and_reference, stage_output
from examples.multimodal_dev.training.host_collectives import agreed_max
from examples.multimodal_dev.training.throughput import StepFlops


def packed_seq_params(batch: PackedBatch) -> PackedSeqParams | None:
    """THD batches (``cu_seqlens`` present) -> PackedSeqParams; BSHD -> None."""
    if not batch.thd:
        return None
    max_seqlen = torch.tensor(batch.max_seqlen, dtype=torch.int32)  # mcore reads it with .item()
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch.cu_seqlens,
        cu_seqlens_kv=batch.cu_seqlens,
        cu_seqlens_q_padded=batch.cu_seqlens_padded,
        cu_seqlens_kv_padded=batch.cu_seqlens_padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token losses [B, S] -> (sum over trained tokens, their count, report)."""
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(output_tensor.reshape(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().clone(), num_tokens.float()])
    return loss_sum, num_tokens, {"lm loss": report}


def run_model(model, batch: PackedBatch):
    """(per-token losses [B, S_local], their loss mask [B, S_local]) of one collated batch
    (already on the model's device); S_local = S without context parallelism."""
    return model(
        input_ids=batch.tokens,
        position_ids=batch.position_ids,
        attention_mask=None,
        labels=batch.labels,
        loss_mask=batch.loss_mask,
        padding_mask=batch.padding_mask,
        **batch.vision_inputs(),
        packed_seq_params=packed_seq_params(batch),
        return_loss_mask=True,
    )


def batch_loss(model, batch: PackedBatch):
    """``loss_func`` of one batch: (sum of trained-token losses, their count, report)."""
    output, loss_mask = run_model(model, batch)
    return loss_func(loss_mask, output)


def forward_step(data_iterator: Iterator[dict], model, *_args, **_kwargs):
    """``data_iterator``: megatron's, of plain dicts (``batch.to_megatron`` says why)."""
    from megatron.core.utils import get_attr_wrapped_model

    from examples.multimodal_dev.vision_ranks import groups as vision_ranks

    device = next(model.parameters()).device
    item = from_megatron(next(data_iterator))
    if isinstance(item, PromptBatch):  # --train-mode grpo: the answers are drawn here
        return grpo_step(item, model)
    batch = item.to(device)
    if get_attr_wrapped_model(model, "vision_only"):  # the tower on ranks of its own: its features go on
        return {"vision": vision_features(model, batch)}, None
    batch = equalise_for_expert_dispatch(batch, model)
    if megatron_args().train_mode == "dpo":
        return dpo_step(batch, model, multi_module=vision_ranks.active())
    output, loss_mask = run_model(model, batch)
    if vision_ranks.active() and not get_attr_wrapped_model(model, "post_process"):
        output = {"language": output}  # megatron's multi-module schedule moves a dict a module
    return output, partial(loss_func, loss_mask)


def dpo_step(batch: PackedBatch, model, multi_module: bool = False):
    """DPO's step (``post_training/dpo.py``): the reference's log-probabilities from the same forward
    with the adapters off, without a graph, then the policy's forward, whose loss function compares
    the two; on a pipeline, each stage runs both and sends both on (``reference_pass.py``), in
    megatron's multi-module dict with ``multi_module`` (the tower on ranks of its own). Every rank
    of a layout runs both forwards, so their collectives pair up."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    (output, loss_mask), reference = policy_and_reference(model, partial(run_model, model, batch))
    if not get_attr_wrapped_model(model, "post_process"):
        return stage_output(output, reference[0], multi_module), None
    args = megatron_args()
    log_probs = dpo.SequenceLogProbs(batch, parallel_state.get_context_parallel_group())
    beta = dpo.DEFAULT_BETA if args.dpo_beta is None else args.dpo_beta
    counts = parallel_state.get_context_parallel_rank() == 0
    return output, partial(dpo.loss_func, log_probs, log_probs(*reference), beta, counts, loss_mask)


def grpo_step(prompts: PromptBatch, model):
    """GRPO's step (``post_training/grpo.py``): the answers drawn and scored (``rollout.py``), the
    reference's log-probabilities of them from a forward with the adapters off, without a graph (none
    where the KL term is off), then the policy's forward, whose loss function reads both."""
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model

    args = megatron_args()
    settings = grpo.Settings.of(args)
    pad_multiple = pad_multiple_for(1, args.tensor_model_parallel_size, args.sequence_parallel)
    terms = rollout.roll_out(model, prompts, settings, args, pad_multiple)
    StepFlops.count_in_step(grpo.step_work(terms.batch, unwrap_model(model).shape, settings))
    batch = equalise_for_expert_dispatch(terms.batch.to(terms.positions.device), model)
    assert parallel_state.get_context_parallel_world_size() == 1, "GRPO's checks refuse CP > 1"
    run = partial(run_model, model, batch)
    (output, loss_mask), kept = policy_and_reference(model, run, with_reference=bool(settings.kl_weight))
    reference = None if kept is None else -kept[0].reshape(-1).float().index_select(0, terms.positions)
    return output, partial(grpo.loss_func, terms, reference, settings, loss_mask)


def vision_features(model, batch: PackedBatch | ServedBatches) -> torch.Tensor:
    """The tower's features of a micro-batch (on the model's device), or under fan-out
    (``ServedBatches``, one micro-batch of each language replica this rank serves,
    vision_ranks/groups.py) of each, joined in that order; megatron-core's bridge sends each
    replica its rows by ``_mimo_bridge_split_sizes``.

    In the pipeline dtype: megatron-core's bridge receives tensors of that dtype, but under --bf16
    megatron's Float16Module hands the output of a last pipeline stage (the tower alone is one)
    back in fp32, whose twice-as-many bytes stopped the receiving rank (bf16 -> fp32 -> bf16 is exact)."""
    from megatron.core.utils import get_attr_wrapped_model

    dtype = get_attr_wrapped_model(model, "config").pipeline_dtype
    if isinstance(batch, PackedBatch):
        return model(**batch.vision_inputs()).to(dtype)
    parts = [model(**served.vision_inputs()) for served in batch.batches]
    features = torch.cat(parts).to(dtype)
    features._mimo_bridge_split_sizes = [part.shape[0] for part in parts]
    return features


def equalise_for_expert_dispatch(batch: PackedBatch, model) -> PackedBatch:
    """MoE's allgather token dispatcher gathers equal-sized token buffers over the TP x EP group,
    but data-parallel ranks of that group carry different rows (packed rows of different lengths).
    Every row is padded with trained-on-nothing tokens to the longest in the group; that padding
    is a multiple of the collate's pad multiple, so the context-parallel split stays exact."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    # under DDP, and under Float16Module too with --bf16 / --fp16 (every GPU run)
    config = get_attr_wrapped_model(model, "language_model").config
    if not config.num_moe_experts or config.moe_token_dispatcher_type != "allgather":
        return batch
    group = parallel_state.get_expert_tensor_and_model_parallel_group()
    if group is None or group.size() == 1:
        return batch
    # the row lengths are the host's: agreed between the hosts, not read back from a device tensor
    return pad_row_to(batch, agreed_max(batch.tokens.shape[1], group))
