"""MoE token dispatch in front of the grouped experts that reads at most one thing back from the GPU
a MoE layer and micro-batch, and nothing where the routing fixes the sizes.

megatron-core's allgather dispatcher sizes its permutation from the routing map: it reads the tokens
per local expert back to the host (``.cpu()``), their total (``.item()``), and selects the routing
probabilities with ``masked_select`` (an output sized by the data): three syncs a MoE layer and
micro-batch, each of which drains the GPU's queue before the host can go on. The grouped experts
(``grouped_experts.py``) take the tokens per expert on the device, so all the dispatcher needs on the
host is the permuted length, and megatron-core's own argsort permutation (the one it uses for CUDA
graphs) takes that length and needs nothing read back. The length is known on the host

- where every expert is on this rank (EP = 1) and routing is dropless: each token goes to exactly
  ``topk`` experts, so the length is ``tokens * topk``;
- under drop-and-pad (``--moe-expert-capacity-factor`` with ``--moe-pad-expert-input-to-capacity``):
  megatron's router gives every expert exactly its capacity of each rank's tokens (padding with
  tokens at probability zero; every token where the capacity is past them), so after the gather
  over the TP x EP ranks each local expert has ``capacity * TP * EP`` rows.

Elsewhere (dropless, or dropping without padding, with experts split over EP) the counts depend on
the routing, and they are read back once, the total summed on the host. ``SequentialMLP`` and
Transformer Engine's grouped GEMM split on the host and keep megatron-core's dispatcher.
"""

from __future__ import annotations

import math

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer, get_default_pg_collection
from megatron.core.transformer.moe.moe_utils import get_capacity, permute
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from .grouped_experts import GroupedExperts

# how a layer's permuted length is found, by dispatch_mode()
STATIC_DROPLESS, STATIC_PADDED, READ_ONCE = "dropless, every expert local", "drop-and-pad", "dropless, read once"


def dispatch_mode(config, num_local_experts: int) -> str:
    """Which of the three ways ``HostSizedDispatcher`` sizes a layer's permutation (see the top)."""
    if config.moe_expert_capacity_factor is not None and config.moe_pad_expert_input_to_capacity:
        return STATIC_PADDED
    if config.moe_expert_capacity_factor is None and num_local_experts == config.num_moe_experts:
        return STATIC_DROPLESS
    return READ_ONCE


class HostSizedDispatcher(MoEAllGatherTokenDispatcher):
    """The allgather dispatcher (its gathers over TP x EP are kept) with the permutation sized on the
    host, and the tokens per expert left on the device."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
        self.mode = dispatch_mode(config, num_local_experts)

    def dispatch_postprocess(self, hidden_states, probs):
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, first:last].contiguous()
        local_probs = probs[:, first:last]
        gathered = self.local_map.shape[0]
        if self.mode == STATIC_PADDED:
            # the router gave each expert exactly `capacity` of each rank's tokens; the gather stacked
            # TP x EP ranks' worth (this rank's own tokens: the hidden states before the gather)
            own = math.prod(self.hidden_shape[:-1])
            factor = self.config.moe_expert_capacity_factor
            # a capacity past the rank's tokens keeps every token (megatron's apply_router_token_dropping)
            capacity = min(get_capacity(own * self.router_topk, self.config.num_moe_experts, factor), own)
            capacity *= gathered // own
            tokens_per_expert = torch.full((self.num_local_experts,), capacity, device=hidden_states.device)
            length, drop_and_pad = capacity * self.num_local_experts, True
        else:
            tokens_per_expert = self.local_map.sum(dim=0)
            if self.mode == STATIC_DROPLESS:
                length = gathered * self.router_topk
            else:  # the one read: the counts, summed on the host
                length = sum(tokens_per_expert.tolist())
            drop_and_pad = False
        # probs come out in masked_select's order (expert-major, tokens ascending) without its sync
        permuted, self.local_probs, self.reversed_local_input_permutation_mapping, _, _ = permute(
            hidden_states, self.local_map, probs=local_probs, num_out_tokens=length, drop_and_pad=drop_and_pad
        )
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs


def sized_on_host(layer: MoELayer) -> bool:
    """Whether ``HostSizedDispatcher`` computes what megatron-core's dispatcher would for this layer."""
    config = layer.config
    return (
        config.moe_token_dispatcher_type == "allgather"
        and not config.moe_shared_expert_overlap
        and not config.moe_permute_fusion
        and isinstance(layer.experts, GroupedExperts)
        and not hasattr(layer, "_inference_token_dispatcher")
    )


class LocalExpertsMoELayer(MoELayer):
    """megatron-core's MoELayer, with ``HostSizedDispatcher`` wherever it applies."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs):
        pg_collection = pg_collection or get_default_pg_collection()  # as megatron-core's __init__ does
        super().__init__(config, submodules, layer_number, pg_collection, **kwargs)
        if sized_on_host(self):
            self.token_dispatcher = HostSizedDispatcher(
                self.num_local_experts, self.local_expert_indices, config=self.config, pg_collection=pg_collection
            )
