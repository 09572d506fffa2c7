"""LoRA adapters on the grouped experts (``models/common/grouped_experts.py``): one projection's
adapters of every local expert as two 3-D parameters, applied with two more grouped GEMMs, so a
layer's adapters cost a fixed handful of ops whatever its expert count (``SequentialMLP``'s
adapters are two linears per expert, ~30 ops each way at 256 experts a layer).

Per projection of ``E`` local experts, ``x`` the tokens sorted by expert and ``offs`` their end rows:

    lora_A [E, r, in]    lora_B [E, out, r]
    delta = (alpha / r) * grouped_mm(grouped_mm(dropout(x), A^T, offs), B^T, offs)

This is ``adapter.py``'s adapter on each expert's linear, in every respect but the loop:

- ``A`` of each expert is drawn from the seed and the name ``SequentialMLP`` gives that expert's
  linear (``...experts.local_experts.{global e}.linear_fc1``), so either implementation starts alike;
- the splits over expert TP are the expert linears': fc1 is column-parallel (``A`` whole on every
  rank, ``B``'s rows the weight's, its SwiGLU halves included), fc2 row-parallel (``A``'s columns the
  weight's, ``B`` whole), and the whole half's gradient is summed over the expert-TP group, the
  token dispatcher summing the partial outputs and input gradients as for the weights;
- the checkpoint entries are ``SequentialMLP``'s adapters' (each expert's slice under
  ``...experts.linear_fc1.lora_A`` with its expert offset), so a checkpoint of either loads into the
  other, and the conversion tools and the PEFT export read it unchanged.

grouped_mm reads rows at 16-byte strides on CUDA: where ``r`` rows of the intermediate would not be,
``A`` and ``B`` are padded with zero ranks for the product (the padding adds exact zeros, and its
gradient is dropped).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from .adapter import COLUMN, ROW, LinearFacts, _init_a
from .switch import adapters_on


class _GradSummed(torch.autograd.Function):
    """The identity on a tensor that is whole on every rank of ``group``, whose gradient each rank
    sees a part of: the backward sums it over the group."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def _grad_summed(tensor: torch.Tensor, group) -> torch.Tensor:
    return _GradSummed.apply(tensor, group) if group.size() > 1 else tensor


def _rank_padded(a_EIR: torch.Tensor, b_ERO: torch.Tensor):
    """``A^T`` [E, in, r] and ``B^T`` [E, r, out] with zero ranks added until a row of ``r`` values is a
    multiple of 16 bytes (grouped_mm's stride on CUDA)."""
    pad = -a_EIR.shape[-1] % max(1, 16 // a_EIR.element_size())
    if not pad:
        return a_EIR, b_ERO
    return F.pad(a_EIR, (0, pad)), F.pad(b_ERO, (0, 0, 0, pad))


class LoraExpertWeights:
    """Mixed into a ``GroupedExperts`` projection's class by ``attach_grouped``."""

    def project(self, tokens_TI, offsets_E):
        output = super().project(tokens_TI, offsets_E)
        if not adapters_on():
            return output
        return output + self.lora_delta(tokens_TI, offsets_E).to(output.dtype)

    def lora_delta(self, tokens_TI, offsets_E):
        x = self.lora_dropout(tokens_TI)
        group = self.lora_facts.tp_group
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        if self.lora_facts.kind == COLUMN:
            a = _grad_summed(a, group)
        else:
            b = _grad_summed(b, group)
        a_t, b_t = _rank_padded(a.transpose(1, 2), b.transpose(1, 2))
        h = F.grouped_mm(x, a_t, offs=offsets_E)
        return F.grouped_mm(h, b_t, offs=offsets_E) * self.lora_scale

    def checkpoint_tensors(self) -> dict:
        """The weight's entry, and the adapters' split as the weight's sides are (see the top)."""
        tensors = super().checkpoint_tensors()
        if self.lora_facts.kind == COLUMN:
            tensors.update(lora_A=(self.lora_A, None, False), lora_B=(self.lora_B, self.tp_axis, self.glu))
        else:
            tensors.update(lora_A=(self.lora_A, self.tp_axis, False), lora_B=(self.lora_B, None, False))
        return tensors


_CLASSES: dict[type, type] = {}


def attach_grouped(projection, experts, rank: int, alpha: float, dropout: float, generator_of) -> None:
    """Give ``projection`` (``experts.linear_fc1`` or ``.linear_fc2`` of a ``GroupedExperts``) an adapter
    of ``rank`` per local expert and freeze its weight. ``generator_of(e)``: the generator that draws
    local expert ``e``'s ``A``, as ``adapter.attach`` draws it for that expert's own linear."""
    column = projection.tp_axis == 0
    facts = LinearFacts(COLUMN if column else ROW, experts.tp_group, False, True, False)
    weight = projection.weight
    n_experts, out_local, in_local = weight.shape
    lora_A = torch.nn.Parameter(torch.empty((n_experts, rank, in_local), dtype=weight.dtype, device=weight.device))
    lora_B = torch.nn.Parameter(torch.zeros((n_experts, out_local, rank), dtype=weight.dtype, device=weight.device))
    if not weight.is_meta:  # a meta build (the planner's) counts the adapter, it draws nothing
        for e in range(n_experts):
            _init_a(lora_A.data[e], facts, generator_of(e))
    weight.requires_grad_(False)
    # the split half as the expert linear's: fc1's B by its rows (axis 1 here), fc2's A by its columns
    split, dim = (lora_B, 1) if column else (lora_A, 2)
    set_tensor_model_parallel_attributes(split, is_parallel=True, dim=dim, stride=1)
    for param in (lora_A, lora_B):
        param.allreduce = weight.allreduce  # experts: reduced over the expert data-parallel group
    base = type(projection)
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Lora{base.__name__}", (LoraExpertWeights, base), {})
    projection.__class__ = _CLASSES[base]
    projection.lora_A, projection.lora_B = lora_A, lora_B
    projection.lora_facts, projection.lora_rank, projection.lora_scale = facts, rank, alpha / rank
    projection.lora_dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
