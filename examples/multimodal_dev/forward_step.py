"""Collated batch -> PackedSeqParams -> model -> per-token loss, in megatron.training's form.

``forward_step(data_iterator, model)`` returns ``(output_tensor, loss_func)``; ``loss_func``
returns ``(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})`` so the schedule sums
token losses and token counts over micro-batches and data-parallel ranks before dividing
(``--calculate-per-token-loss``). The reported loss therefore does not depend on how tokens
were packed or split. megatron.training calls it on every host.

Under context parallelism the model returns the losses of this rank's tokens together with their
loss mask (the model splits every per-token tensor once); the loss function uses that mask.

Under pipeline parallelism every stage draws the same micro-batch and keeps only what it reads
(``for_stage``, applied once by each (virtual) stage's collate in pretrain_multimodal.py, so later
stages never move pixels to the device): pixels and grids on the first stage, labels and loss
mask on the last; positions, packed-sequence boundaries, the padding mask and the token ids (the
row's length for MoE dispatch; the MTP head's input on the last stage) everywhere. Only decoder
activations cross stages.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from examples.multimodal_dev.data.collate import pad_row_to

TENSOR_KEYS = (
    "tokens",
    "labels",
    "loss_mask",
    "padding_mask",
    "position_ids",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "cu_seqlens",
    "cu_seqlens_padded",
)


FIRST_STAGE_ONLY = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
PIXELS = ("pixel_values", "pixel_values_videos")
LAST_STAGE_ONLY = ("labels", "loss_mask")


def for_stage(batch: dict, pre_process, post_process: bool) -> dict:
    """The batch without the tensors this pipeline stage never reads (None in their place).
    ``pre_process="grids"``: a first stage whose vision features come from ranks of their own in
    shares, which it orders by the grids (vision_ranks/groups.py)."""
    first = PIXELS if pre_process == "grids" else () if pre_process else FIRST_STAGE_ONLY
    dropped = first + (() if post_process else LAST_STAGE_ONLY)
    return {k: (None if k in dropped else v) for k, v in batch.items()}


def batch_to_device(batch: dict, device) -> dict:
    return {k: (v.to(device, non_blocking=True) if k in TENSOR_KEYS and v is not None else v) for k, v in batch.items()}


def packed_seq_params(batch: dict) -> PackedSeqParams | None:
    """THD batches (``cu_seqlens`` present) -> PackedSeqParams; BSHD -> None."""
    if batch.get("cu_seqlens") is None:
        return None
    max_seqlen = torch.tensor(batch["max_seqlen"], dtype=torch.int32)  # mcore reads it with .item()
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch["cu_seqlens"],
        cu_seqlens_kv=batch["cu_seqlens"],
        cu_seqlens_q_padded=batch["cu_seqlens_padded"],
        cu_seqlens_kv_padded=batch["cu_seqlens_padded"],
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


def run_model(model, batch: dict):
    """(per-token losses [B, S_local], their loss mask [B, S_local]) of one collated batch
    (already on the model's device); S_local = S without context parallelism."""
    return model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=None,
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
        padding_mask=batch.get("padding_mask"),
        pixel_values=batch.get("pixel_values"),
        image_grid_thw=batch.get("image_grid_thw"),
        pixel_values_videos=batch.get("pixel_values_videos"),
        video_grid_thw=batch.get("video_grid_thw"),
        packed_seq_params=packed_seq_params(batch),
        return_loss_mask=True,
    )


def batch_loss(model, batch: dict):
    """``loss_func`` of one batch: (sum of trained-token losses, their count, report)."""
    output, loss_mask = run_model(model, batch)
    return loss_func(loss_mask, output)


def forward_step(data_iterator, model, *_args, **_kwargs):
    from megatron.core.utils import get_attr_wrapped_model

    from examples.multimodal_dev.vision_ranks import groups as vision_ranks

    device = next(model.parameters()).device
    batch = batch_to_device(next(data_iterator), device)
    if get_attr_wrapped_model(model, "vision_only"):  # the tower on ranks of its own: its features go on
        return {"vision": vision_features(model, batch, device)}, None
    batch = equalise_for_expert_dispatch(batch, model)
    output, loss_mask = run_model(model, batch)
    if vision_ranks.active() and not get_attr_wrapped_model(model, "post_process"):
        output = {"language": output}  # megatron's multi-module schedule moves a dict a module
    return output, partial(loss_func, loss_mask)


def vision_features(model, batch: dict, device) -> torch.Tensor:
    """The tower's features of a micro-batch, or under fan-out (``{"served": [...]}``, one micro-batch
    of each language replica this rank serves, vision_ranks/groups.py) of each, joined in that
    order; megatron-core's bridge sends each replica its rows by ``_mimo_bridge_split_sizes``.

    In the pipeline dtype: megatron-core's bridge receives tensors of that dtype, but under --bf16
    megatron's Float16Module hands the output of a last pipeline stage (the tower alone is one)
    back in fp32, whose twice-as-many bytes stopped the receiving rank (bf16 -> fp32 -> bf16 is exact)."""
    from megatron.core.utils import get_attr_wrapped_model

    dtype = get_attr_wrapped_model(model, "config").pipeline_dtype
    if "served" not in batch:
        return model(**{k: batch.get(k) for k in FIRST_STAGE_ONLY}).to(dtype)
    parts = [
        model(**{k: b.get(k) for k in FIRST_STAGE_ONLY})
        for b in (batch_to_device(served, device) for served in batch["served"])
    ]
    features = torch.cat(parts).to(dtype)
    features._mimo_bridge_split_sizes = [part.shape[0] for part in parts]
    return features


def equalise_for_expert_dispatch(batch: dict, model) -> dict:
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
    length = torch.tensor([batch["tokens"].shape[1]], dtype=torch.long, device=batch["tokens"].device)
    torch.distributed.all_reduce(length, op=torch.distributed.ReduceOp.MAX, group=group)
    return pad_row_to(batch, int(length))
