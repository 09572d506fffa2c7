"""MoE token dispatch that never waits for the GPU, where every expert is on this rank and no token is
dropped.

megatron-core's allgather dispatcher sizes its permutation from the routing map: it reads the tokens
per expert back to the host (``.cpu()``), their total (``.item()``), and selects the routing
probabilities with ``masked_select`` (an output sized by the data): three syncs a MoE layer and
micro-batch, each of which drains the GPU's queue before the host can go on. Where every expert is
local (expert-parallel size 1) and routing is dropless (no capacity factor), each token is sent to
exactly ``topk`` experts, so the permuted length is ``tokens * topk``, known on the host, and
megatron-core's own argsort permutation (the one it uses for CUDA graphs) needs nothing read back.
The tokens per expert stay on the device, which the grouped experts (``grouped_experts.py``) take
as they are; ``SequentialMLP`` and Transformer Engine's grouped GEMM split on the host and keep
megatron-core's dispatcher.
"""

from __future__ import annotations

from megatron.core.transformer.moe.moe_layer import MoELayer, get_default_pg_collection
from megatron.core.transformer.moe.moe_utils import permute
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from .grouped_experts import GroupedExperts


class DroplessLocalDispatcher(MoEAllGatherTokenDispatcher):
    """The allgather dispatcher (its gathers over TP are kept) with the permutation sized on the host."""

    def dispatch_postprocess(self, hidden_states, probs):
        self.hidden_shape_before_permute = hidden_states.shape
        self.local_map = self.routing_map  # every expert is local
        tokens_per_expert = self.local_map.sum(dim=0)
        # probs come out in masked_select's order (expert-major, tokens ascending) without its sync
        permuted, self.local_probs, self.reversed_local_input_permutation_mapping, _, _ = permute(
            hidden_states, self.local_map, probs=probs, num_out_tokens=self.local_map.shape[0] * self.router_topk
        )
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs


def dispatches_without_sync(layer: MoELayer) -> bool:
    """Whether ``DroplessLocalDispatcher`` computes what megatron-core's dispatcher would for this layer."""
    config = layer.config
    return (
        config.moe_token_dispatcher_type == "allgather"
        and layer.num_local_experts == config.num_moe_experts
        and config.moe_expert_capacity_factor is None
        and not config.moe_shared_expert_overlap
        and isinstance(layer.experts, GroupedExperts)
        and not hasattr(layer, "_inference_token_dispatcher")
    )


class LocalExpertsMoELayer(MoELayer):
    """megatron-core's MoELayer, with ``DroplessLocalDispatcher`` wherever it applies."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs):
        pg_collection = pg_collection or get_default_pg_collection()  # as megatron-core's __init__ does
        super().__init__(config, submodules, layer_number, pg_collection, **kwargs)
        if dispatches_without_sync(self):
            self.token_dispatcher = DroplessLocalDispatcher(
                self.num_local_experts, self.local_expert_indices, config=self.config, pg_collection=pg_collection
            )
