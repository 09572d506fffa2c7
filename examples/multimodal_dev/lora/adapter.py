"""A LoRA adapter on one of megatron-core's tensor-parallel linears, sharded as its weight is.

``y = W x + (alpha / r) * B A dropout(x)``, with ``W`` frozen, ``A`` [r, in] and ``B`` [out, r]
trained, and ``B = 0`` at the start so the adapted model begins as the base model.

The adapter is put on the linear itself (``attach``: the instance's class becomes a subclass that
adds the adapter), so the base weight keeps its checkpoint key and its ``isinstance``, and the
adapter's parameters sit beside it as ``lora_A`` / ``lora_B``.

How each half is split under tensor parallelism follows from which side of the weight is split:

- **column-parallel** (``W`` split by output rows): ``B`` is split like ``W`` (its rows follow
  ``W``'s rows: the fused Gated DeltaNet ``in_proj`` and the gated MLP's ``linear_fc1`` keep their
  per-rank layouts, and their checkpoint splits apply to ``B`` too); ``A`` is whole on every rank.
  ``A x`` is complete on every rank; its gradient, a sum over the ranks' rows of ``B``, is
  all-reduced (``copy_to_tensor_model_parallel_region``), so ``A``'s gradient and the adapter's
  share of the input gradient are complete, and are not reduced again (under sequence
  parallelism the gathered input's gradient is split back, not reduce-scattered, and the backward
  gathers the input again rather than keep the whole sequence: ``_SequenceGatheredLinear``).
- **row-parallel** (``W`` split by input columns, the input split with it): ``A`` is split like
  ``W``; ``A x`` is summed over the ranks the way ``W x`` is (all-reduce, or reduce-scatter under
  sequence parallelism); ``B`` is whole on every rank. Under sequence parallelism each rank sees
  its own tokens, so ``B``'s gradient is summed over the ranks by megatron's own rule for such
  weights (``sequence_parallel`` on the parameter, ``finalize_model_grads``).

Experts: an expert's linear does no communication of its own; the token dispatcher sums the
partial outputs of a row-parallel expert linear and the partial input gradients of a
column-parallel one over the expert-TP ranks. The adapter leaves those sums to it too, so its own
partial terms stay partial, and only the half that is whole on every expert-TP rank (``A`` of a
column-parallel linear, ``B`` of a row-parallel one), whose gradient each rank sees a part of, has
that gradient summed over the expert-TP group in the backward (``_WeightGradSummed``).

Backends: the local backend's ``ColumnParallelLinear`` / ``RowParallelLinear`` and megatron-core's
Transformer Engine wrappers (``TEColumnParallelLinear``, ``TERowParallelLinear``,
``TELayerNormColumnParallelLinear``) take the same adapter; ``linear_facts`` reads from each what
the adapter needs. TE's LayerNorm-linear normalises its input inside the fused kernel and keeps the
result, so its adapter computes that norm again from the module's own norm weights (once more in
the forward and once in the backward, keeping nothing); TE's own ``return_layernorm_output`` is
left alone, since how TE sums the gradient of a returned norm output over the TP ranks depends on
its version.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from megatron.core.tensor_parallel import layers, mappings
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from ..models.common.norms import normalise
from .switch import adapters_on

COLUMN, ROW = "column", "row"

# megatron-core's Transformer Engine wrappers, by name (importing their module needs TE): the side
# their weight is split on, and whether the linear normalises its input first.
_TE_MODULE = "megatron.core.extensions.transformer_engine"
_TE_LINEARS = {
    "TEColumnParallelLinear": (COLUMN, False),
    "TELayerNormColumnParallelLinear": (COLUMN, True),
    "TERowParallelLinear": (ROW, False),
}


def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gradient of ``w`` in ``linear(x, w)`` from the output's ``grad``, over every leading dim."""
    return grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class _WeightGradSummed(torch.autograd.Function):
    """``linear(x, w)`` whose weight gradient is summed over ``group``: ``w`` is whole on every rank
    of it, while each rank's gradient covers only its part of the product; the input gradient
    stays this rank's part (what the base linear's is)."""

    @staticmethod
    def forward(ctx, x, w, group):
        ctx.save_for_backward(x, w)
        ctx.group = group
        return torch.nn.functional.linear(x, w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_w = _weight_grad(grad, x)
        torch.distributed.all_reduce(grad_w, group=ctx.group)
        return grad @ w, grad_w, None


def _whole_weight_linear(x, w, group):
    return _WeightGradSummed.apply(x, w, group) if group.size() > 1 else torch.nn.functional.linear(x, w)


def _gather_sequence(x, group):
    return mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=group)


class _SequenceGatheredLinear(torch.autograd.Function):
    """``linear(gather(x), w)``, ``x`` this rank's sequence shard, that keeps the shard for the
    backward and gathers it again there, as megatron's own sequence-parallel linears do, rather
    than keeping the whole sequence (a [s, b, hidden] tensor on every rank, per adapter). The
    output's gradient arrives complete (``copy_to_tensor_model_parallel_region`` after this sums it
    over TP), so the input's gradient is split back to the shard, not reduced."""

    @staticmethod
    def forward(ctx, x, w, group):
        ctx.save_for_backward(x, w)
        ctx.group = group
        return torch.nn.functional.linear(_gather_sequence(x, group), w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_w = _weight_grad(grad, _gather_sequence(x, ctx.group))
        return mappings.scatter_to_sequence_parallel_region(grad @ w, group=ctx.group), grad_w, None


@dataclass(frozen=True)
class LinearFacts:
    """What an adapter needs to know of the linear it sits on."""

    kind: str  # COLUMN or ROW: the side the weight is split on
    tp_group: torch.distributed.ProcessGroup  # the (expert-)TP group the weight is split over
    sequence_parallel: bool  # its input (column) or output (row) is this rank's sequence shard
    is_expert: bool  # a routed expert's: the token dispatcher does its TP communication
    fused_norm: bool  # the linear normalises its input first (TE's LayerNorm-linear)


def linear_facts(linear, is_expert: bool) -> LinearFacts:
    """The facts of one of megatron-core's tensor-parallel linears, local or Transformer Engine.
    ``is_expert``: whether the model puts it in a routed expert (TE's wrappers do not record it)."""
    if isinstance(linear, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
        if linear.is_expert != is_expert:
            raise ValueError(f"{type(linear).__name__}: is_expert is {linear.is_expert}, its place says {is_expert}")
        if isinstance(linear, layers.ColumnParallelLinear) and linear.gather_output:
            raise ValueError("a column-parallel linear that gathers its output has no adapter layout here")
        if isinstance(linear, layers.RowParallelLinear) and not linear.input_is_parallel:
            raise ValueError("a row-parallel linear that splits its own input has no adapter layout here")
        kind = COLUMN if isinstance(linear, layers.ColumnParallelLinear) else ROW
        return LinearFacts(kind, linear.tp_group, bool(linear.sequence_parallel) and not is_expert, is_expert, False)
    te = next(
        (c.__name__ for c in type(linear).__mro__ if c.__module__ == _TE_MODULE and c.__name__ in _TE_LINEARS), None
    )
    if te is None:
        raise TypeError(f"{type(linear).__name__} is not one of megatron-core's tensor-parallel linears")
    kind, fused_norm = _TE_LINEARS[te]
    # megatron's wrappers keep the (expert-)TP group as _tp_group; TE's own is None for experts
    sequence_parallel = bool(linear.config.sequence_parallel) and not is_expert
    return LinearFacts(kind, linear._tp_group, sequence_parallel, is_expert, fused_norm)


class LoraLinear:
    """Mixed into a megatron linear's class by ``attach``; ``lora_*`` attributes are set there."""

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if not adapters_on():
            return output, bias
        return output + self.lora_delta(self.lora_input(input_)).to(output.dtype), bias

    def lora_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the weight multiplies: ``x``, or its norm where the linear normalises first. That
        norm is recomputed in the backward rather than kept: it holds ``x`` alone, which the fused
        linear keeps anyway, instead of its fp32 intermediates."""
        if not self.lora_facts.fused_norm:
            return x
        rms = self.normalization == "RMSNorm"
        bias = None if rms else self.layer_norm_bias
        return torch.utils.checkpoint.checkpoint(
            normalise,
            x,
            self.layer_norm_weight,
            bias,
            self.eps,
            rms=rms,
            zero_centered=self.zero_centered_gamma,
            use_reentrant=False,
        )

    def sequence_parallel_now(self) -> bool:
        """Whether the linear runs sequence parallel at this moment: decoding switches it off for a while
        (``generation/decode.py``'s ``without_sequence_parallelism``, GRPO's answers drawn in training)."""
        own = getattr(self, "sequence_parallel", None)
        return own if isinstance(own, bool) else bool(getattr(self.config, "sequence_parallel", False))

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """``(alpha / r) * B A dropout(x)``, laid out as this linear's output on this rank."""
        x = self.lora_dropout(x)
        facts = self.lora_facts
        group = facts.tp_group
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        if facts.is_expert:  # the dispatcher sums over the expert-TP ranks (its group may be of one)
            if facts.kind == COLUMN:
                return torch.nn.functional.linear(_whole_weight_linear(x, a, group), b) * self.lora_scale
            return _whole_weight_linear(torch.nn.functional.linear(x, a), b, group) * self.lora_scale
        sequence_parallel = facts.sequence_parallel and self.sequence_parallel_now()
        if facts.kind == COLUMN:
            if sequence_parallel:  # the tokens of every TP rank
                h = _SequenceGatheredLinear.apply(x, a, group)
            else:
                h = torch.nn.functional.linear(x, a)
            h = mappings.copy_to_tensor_model_parallel_region(h, group=group)
            return torch.nn.functional.linear(h, b) * self.lora_scale
        h = torch.nn.functional.linear(x, a)
        if sequence_parallel:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=group)
        else:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=group)
        return torch.nn.functional.linear(h, b) * self.lora_scale

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron's, with the adapter's halves sharded as the weight's sides are (and ``B`` split
        into the weight's named sections where the module above splits the weight)."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        axis = 0 if self.lora_facts.kind == COLUMN else 1
        name = "lora_B" if self.lora_facts.kind == COLUMN else "lora_A"
        sharded = make_sharded_tensors_for_checkpoint(
            {name: getattr(self, name)},
            prefix,
            {name: axis},
            sharded_offsets,
            tp_group=self.lora_facts.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        if self.lora_rows is not None and name == "lora_B":
            sharded = {k: self.lora_rows(v, sharded_offsets, metadata) for k, v in sharded.items()}
        state.update(sharded)
        return state

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """This rank's ``(alpha / r) B A`` (its shard of the adapter's change), in float64."""
        return (self.lora_B.double() @ self.lora_A.double()) * self.lora_scale

    @torch.no_grad()
    def merged_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """This rank's ``W + (alpha / r) B A``, summed in float64 and rounded once to ``dtype``
        (the weight's by default)."""
        return merged(self.weight, self.lora_A, self.lora_B, self.lora_scale, dtype or self.weight.dtype)


@torch.no_grad()
def merged(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float, dtype) -> torch.Tensor:
    """``W + scale B A``, summed in float64 and rounded once to ``dtype``: a LoRA linear's merged weight
    from its tensors, for a tool that reads them without the module."""
    return (weight.double() + (lora_B.double() @ lora_A.double()) * scale).to(dtype)


_CLASSES: dict[type, type] = {}


def attach(
    linear, rank: int, alpha: float, dropout: float, generator: torch.Generator, is_expert: bool, rows=None
) -> None:
    """Give ``linear`` (column- or row-parallel, local or TE) a LoRA adapter of ``rank`` and freeze
    its own weights. ``is_expert``: the linear is in a routed expert.

    ``generator`` draws ``A`` (whole, then this rank's slice: see ``_init_a``).
    ``rows(sharded_tensor, sharded_offsets, metadata)``: how the module above splits this linear's
    weight in checkpoints (a gated MLP's gate and up halves, Gated DeltaNet's in_proj sections),
    applied to ``B`` too, whose rows follow the weight's."""
    facts = linear_facts(linear, is_expert)
    base = type(linear)
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Lora{base.__name__}", (LoraLinear, base), {})
    out_local, in_local = linear.weight.shape
    weight = linear.weight
    lora_A = torch.nn.Parameter(torch.empty((rank, in_local), dtype=weight.dtype, device=weight.device))
    lora_B = torch.nn.Parameter(torch.zeros((out_local, rank), dtype=weight.dtype, device=weight.device))
    if not weight.is_meta:  # a meta build (the planner's) counts the adapter, it draws nothing
        _init_a(lora_A, facts, generator)
    for p in linear.parameters():
        p.requires_grad_(False)
    split = lora_B if facts.kind == COLUMN else lora_A
    layers.set_tensor_model_parallel_attributes(split, is_parallel=True, dim=0 if facts.kind == COLUMN else 1, stride=1)
    for param in (lora_A, lora_B):
        if hasattr(weight, "allreduce"):  # experts: reduced over the expert data-parallel group
            param.allreduce = weight.allreduce
    if facts.kind == ROW and facts.sequence_parallel:
        lora_B.sequence_parallel = True  # each TP rank's gradient covers its own tokens: summed over TP
    linear.__class__ = _CLASSES[base]
    linear.lora_A, linear.lora_B = lora_A, lora_B
    linear.lora_facts, linear.lora_rank, linear.lora_scale = facts, rank, alpha / rank
    linear.lora_dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
    linear.lora_rows = rows


def _init_a(lora_A: torch.nn.Parameter, facts: LinearFacts, generator: torch.Generator) -> None:
    """Kaiming-uniform as PEFT's default, drawn whole and sliced under row parallelism: with a
    generator seeded by the linear's name in the whole model, every layout starts from the same
    adapter (the seed, not the layout, decides it)."""
    rank, in_local = lora_A.shape
    fan_in = in_local * (facts.tp_group.size() if facts.kind == ROW else 1)  # an expert's: its expert-TP group
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_ with a = sqrt(5)
    whole = (torch.rand(rank, fan_in, generator=generator, dtype=torch.float64) * 2 - 1) * bound
    if facts.kind == ROW:
        tp_rank = facts.tp_group.rank()
        whole = whole[:, tp_rank * in_local : (tp_rank + 1) * in_local]
    with torch.no_grad():
        lora_A.copy_(whole.to(lora_A.dtype))
