"""The routed experts of one MoE layer as two grouped GEMMs, on megatron-core's local backend.

megatron-core's local spec always builds ``SequentialMLP``: a Python loop over the experts, each an
``MLP`` of two linears. At 256 experts that is ~11k eager ops per layer and micro-batch, and 512
parameter tensors per layer for the gradient hooks and the optimizer to walk. Here the experts of a
layer are one weight per projection and one ``torch.nn.functional.grouped_mm`` each way, so the
layer's op count does not depend on the expert count:

    tokens_TH  [T, hidden]       tokens sorted by local expert (the dispatcher's permuted input)
    offsets_E  [E] int32         end row of each expert's tokens (cumulative tokens_per_expert)
    weight1    [E, F1, hidden]   linear_fc1 of every local expert; F1 = 2 * ffn / ETP with SwiGLU
                                 ([gate; up] rows of this rank, as ``MLP`` splits its fc1)
    weight2    [E, hidden, F]    linear_fc2 of every local expert; F = ffn / ETP

Each expert's slice is laid out as its ``MLP``'s weight is, and ``sharded_state_dict`` writes it
under that expert's key and offsets (``...experts.linear_fc1.weight`` with the expert axis, the
SwiGLU halves split as ``apply_swiglu_sharded_factory`` splits them): a checkpoint of either
implementation loads into the other, at any EP / ETP, and the conversion and LoRA code that reads
``SequentialMLP`` keep reading the same files. No communication happens here: like the experts'
linears in ``SequentialMLP``, the token dispatcher does every expert-parallel and expert-TP
exchange.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_object_for_checkpoint

# Settings under which SequentialMLP's experts compute something this module does not.
_UNSUPPORTED = {
    "add_bias_linear": "biases on the experts' linears",
    "moe_apply_probs_on_input": "router probabilities applied to the input",
    "fp8": "FP8 experts",
    "fp4": "FP4 experts",
}


class ExpertProjection(torch.nn.Module):
    """One projection of every local expert: ``weight`` [E, out, in] (named as the linear it replaces,
    so parameter names read ``...experts.linear_fc1.weight``). ``tp_axis``: the axis of an expert's
    [out, in] that expert TP splits (0 for fc1, column-parallel; 1 for fc2, row-parallel); ``glu``: the
    out rows are SwiGLU's [gate; up] halves."""

    def __init__(self, experts: int, out_features: int, in_features: int, dtype, device, tp_axis: int, glu: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(experts, out_features, in_features, dtype=dtype, device=device))
        self.tp_axis, self.glu = tp_axis, glu

    def project(self, tokens_TI, offsets_E):
        """Each expert's rows of ``tokens_TI`` times its weight: [T, out]."""
        return F.grouped_mm(tokens_TI, self.weight.transpose(1, 2), offs=offsets_E)

    def checkpoint_tensors(self) -> dict:
        """name -> (tensor [E, ...], the expert-TP axis of one expert's slice or None where whole on every
        expert-TP rank, whether its rows are SwiGLU's halves): what ``sharded_state_dict`` writes."""
        return {"weight": (self.weight, self.tp_axis, self.glu)}

    # megatron's local linears checkpoint an (empty) ``_extra_state`` per expert; this module writes and
    # reads the same entries (sharded_state_dict below) so either implementation's checkpoint loads strictly.
    def get_extra_state(self):
        return None

    def set_extra_state(self, state):
        pass


class GroupedExperts(MegatronModule):
    """``SequentialMLP``'s computation and checkpoint layout with one grouped GEMM per projection."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, name=None):
        super().__init__(config=config)
        for flag, what in _UNSUPPORTED.items():
            if getattr(config, flag, False):
                raise ValueError(
                    f"--moe-grouped-gemm on the local backend does not support {what} (--{flag.replace('_', '-')})"
                )
        if torch.cuda.is_available() and config.params_dtype != torch.bfloat16:
            # torch's grouped_mm takes bfloat16 on CUDA; the CPU kernel takes fp32 and bf16
            raise ValueError(
                f"--moe-grouped-gemm on a GPU needs --bf16 (torch's grouped_mm takes bfloat16 there, not "
                f"{config.params_dtype}); GROUPED_EXPERTS=0 runs the experts as SequentialMLP"
            )
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        tp = self.tp_group.size()
        ffn = config.moe_ffn_hidden_size
        if ffn % tp:
            raise ValueError(f"--moe-ffn-hidden-size {ffn} does not split over expert TP {tp}")
        self.glu = config.gated_linear_unit
        per_rank = ffn // tp
        width = torch.finfo(config.params_dtype).bits // 8
        for what, size in (("--hidden-size", config.hidden_size), ("--moe-ffn-hidden-size / expert TP", per_rank)):
            if size * width % 16:  # grouped_mm's kernels read rows at 16-byte strides
                raise ValueError(
                    f"--moe-grouped-gemm: {what} {size} is not a multiple of {16 // width} ({config.params_dtype} "
                    "rows must be 16-byte aligned for grouped_mm); GROUPED_EXPERTS=0 runs SequentialMLP"
                )
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        dtype = config.params_dtype
        fc1_rows = per_rank * (2 if self.glu else 1)
        self.linear_fc1 = ExpertProjection(num_local_experts, fc1_rows, config.hidden_size, dtype, device, 0, self.glu)
        self.linear_fc2 = ExpertProjection(num_local_experts, config.hidden_size, per_rank, dtype, device, 1, False)
        # As megatron's expert linears mark them: reduced over the expert-DP group when experts are
        # split over EP or have a TP of their own, else over the dense DP group like any weight.
        own_groups = (
            config.expert_model_parallel_size > 1
            or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        for linear, split_dim, init in (
            (self.linear_fc1, 1, config.init_method),
            (self.linear_fc2, 2, config.output_layer_init_method),
        ):
            set_tensor_model_parallel_attributes(linear.weight, is_parallel=True, dim=split_dim, stride=1)
            linear.weight.allreduce = not own_groups
            if config.perform_initialization:
                with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                    for e in range(num_local_experts):  # each expert drawn as its own linear would be
                        init(linear.weight.data[e])

    def forward(self, tokens_TH, tokens_per_expert, permuted_probs):
        """SequentialMLP's forward: per expert, fc1 -> activation -> scale by the router's probability
        -> fc2; returns (output [T, hidden], None)."""
        if tokens_TH.shape[0] == 0:  # no token reached this rank's experts: grouped_mm has no empty backward
            # every parameter (weights, and adapters where LoRA put them) gets a zero gradient, not none
            touched = sum(p.sum() for p in self.parameters())
            return tokens_TH.new_zeros(0, self.config.hidden_size) + 0 * touched, None
        # Device-side offsets: no host sync to split the tokens (SequentialMLP reads the counts back).
        offsets_E = torch.cumsum(tokens_per_expert.to(tokens_TH.device), 0, dtype=torch.int32)
        # Rows past the last expert's end (a dispatcher's padded tail) belong to no group: grouped_mm
        # leaves its output there unwritten (on CUDA, whatever memory held, NaN included) and its input
        # gradient too. Each such tensor is masked on those rows, so nothing of them reaches the output,
        # the router probabilities' gradient or the tokens' (torch.where, not a product: 0 * NaN is NaN).
        kept_T1 = (torch.arange(tokens_TH.shape[0], device=tokens_TH.device) < offsets_E[-1]).unsqueeze(-1)
        tokens_TH = torch.where(kept_T1, tokens_TH, 0)
        fc1 = torch.where(kept_T1, self.linear_fc1.project(tokens_TH, offsets_E), 0)
        hidden = torch.where(kept_T1, self._activate(fc1, permuted_probs.unsqueeze(-1)), 0)
        return torch.where(kept_T1, self.linear_fc2.project(hidden, offsets_E), 0), None

    def _activate(self, fc1, probs_T1):
        """megatron's ``MLP`` activation for experts, branch for branch, so the two implementations agree
        to the bit: the fused weighted SwiGLU under ``--bias-activation-fusion`` (megatron's default), else
        the GLU (with its clamp and offset) or the plain activation, then the router's probability."""
        c = self.config
        if c.bias_activation_fusion:
            if not (self.glu and c.activation_func is F.silu):
                raise ValueError("--moe-grouped-gemm on the local backend fuses SwiGLU only (--no-bias-swiglu-fusion)")
            return weighted_bias_swiglu_impl(fc1, None, probs_T1, c.activation_func_fp8_input_store)
        if self.glu:
            gate, up = torch.chunk(fc1, 2, dim=-1)
            if (clamp := c.activation_func_clamp_value) is not None:
                gate, up = gate.clamp(min=None, max=clamp), up.clamp(min=-clamp, max=clamp)
            hidden = c.activation_func(gate) * (up + c.glu_linear_offset)
        else:
            hidden = c.activation_func(fc1)
        return (hidden * probs_T1).to(fc1.dtype)

    def backward_dw(self):
        """Weight gradients are computed in the backward pass itself (no delayed wgrad)."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Each local expert's slice under ``SequentialMLP``'s key, expert offset and TP split."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        if metadata.get("singleton_local_shards", False):
            raise ValueError(
                "--moe-grouped-gemm on the local backend: singleton_local_shards checkpoints are not supported"
            )
        state = {}
        for name in ("linear_fc1", "linear_fc2"):
            for suffix, (tensor, tp_axis, glu) in getattr(self, name).checkpoint_tensors().items():
                key = f"{name}.{suffix}"
                state[f"{prefix}{key}"] = self._expert_factory(prefix, sharded_offsets, key, tensor, tp_axis, glu)
            state[f"{prefix}{name}._extra_state"] = self._extra_states(prefix, sharded_offsets, name)
        return state

    def _expert_placement(self, sharded_offsets) -> tuple[int, int, int]:
        """(expert axis, global index of this rank's first local expert, experts of the layer)."""
        return (
            len(sharded_offsets),
            self.ep_group.rank() * self.num_local_experts,
            self.ep_group.size() * self.num_local_experts,
        )

    def _expert_factory(
        self, prefix, sharded_offsets, key: str, tensor, tp_axis: int | None, glu: bool
    ) -> ShardedTensorFactory:
        """One [E, ...] tensor written as one sharded tensor per local expert (and SwiGLU half), under
        ``SequentialMLP``'s ``...experts.KEY``: split over expert TP on ``tp_axis`` of an expert's slice,
        or whole on every expert-TP rank (``None``: one replica per rank, as megatron marks such tensors)."""
        expert_axis, first, total = self._expert_placement(sharded_offsets)
        tp_rank, tp = self.tp_group.rank(), self.tp_group.size()
        replica_id = (0, 0 if tp_axis is not None else tp_rank, self.dp_group.rank())

        def build(key, weight, replica, flattened_range):
            if flattened_range is not None:
                raise ValueError(
                    "--moe-grouped-gemm on the local backend: flattened checkpoint tensors are not supported"
                )
            # each expert a list of pieces: [gate; up] of this rank are two (each the rank's share of
            # the global gate and of the global up rows, as apply_swiglu_sharded_factory splits them)
            if tp_axis is None:
                parts, splits = 1, ((),)
            elif glu:
                parts, splits = 2, (((tp_rank, 2 * tp),), ((tp_rank + tp, 2 * tp),))
            else:
                parts, splits = 1, (((tp_rank, tp),),)
            axis = expert_axis + 1 + (tp_axis or 0)
            return [
                [
                    ShardedTensor.from_rank_offsets(
                        key,
                        piece,
                        *sharded_offsets,
                        (expert_axis, first + e, total),
                        *((axis, *split) for split in split_of_piece),
                        replica_id=replica,
                        prepend_axis_num=expert_axis + 1,
                    )
                    for piece, split_of_piece in zip(torch.chunk(weight[e], parts, dim=0), splits)
                ]
                for e in range(self.num_local_experts)
            ]

        def merge(loaded):
            return torch.stack([torch.cat(pieces, dim=0) for pieces in loaded])

        return ShardedTensorFactory(f"{prefix}experts.{key}", tensor, build, merge, replica_id)

    def _extra_states(self, prefix, sharded_offsets, name: str) -> list:
        """The (empty) ``_extra_state`` of each local expert's linear, as ``SequentialMLP`` writes them."""
        expert_axis, first, total = self._expert_placement(sharded_offsets)
        tp_rank = self.tp_group.rank()
        return [
            make_sharded_object_for_checkpoint(
                None,
                f"{prefix}experts.{name}._extra_state",
                (*sharded_offsets, (expert_axis, first + e, total)),
                replica_id=(0, tp_rank, self.dp_group.rank()),
            )
            for e in range(self.num_local_experts)
        ]
