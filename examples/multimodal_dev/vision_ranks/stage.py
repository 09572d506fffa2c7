"""The two modules of the vision tower on ranks of its own (``VISION_NPROC``, ``groups.py``).

- ``VisionStage``: the tower alone, a pipeline stage ahead of the language model. Its output, the
  micro-batch's image features then its video features ([N, H], at least one row), goes to the
  language model's first stage.
- ``ReceivedFeatures``: what the language model does with them. megatron's multi-module schedule
  hands each module a dict, the tower's features (``"vision"``, first stage) and the previous
  stage's activations (``"language"``); the features replace the placeholder tokens' embeddings.

Under fan-in several replicas of the tower serve one language replica: each encodes a share of a
micro-batch's items, dealt by FLOPs (``vision_context_parallel.shares_of``), padded to one width so
the bridge can split the gradient back evenly; the language side, which sees only the grids, deals
the same way and puts the rows back in batch order.

The model itself knows none of this: ``own_ranks_module`` wraps the tower, or gives the language
model its ``received`` features (``models/base.py`` asks for them where it would encode).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from examples.multimodal_dev.models.common import vision_context_parallel


class VisionStage(MegatronModule):
    """The vision tower alone, on ranks of its own: encodes share ``share`` of ``shares``."""

    vision_only = True
    rng_state_key_prefix = "vision."  # megatron.training's checkpoints: the tower's RNG states apart from the LM's

    def __init__(self, vision_model, groups, shares: int = 1, share: int = 0):
        super().__init__(config=vision_model.config)
        self.vision_model, self.groups, self.shares, self.share = vision_model, groups, shares, share
        self.pre_process, self.post_process, self.share_embeddings_and_output_weights = True, False, False

    @property
    def pg_collection(self):
        return self.groups

    def set_input_tensor(self, input_tensor):
        """The first stage of the whole model: nothing arrives."""

    def forward(self, pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None):
        kinds = [
            (pixels, grid)
            for pixels, grid in ((pixel_values, image_grid_thw), (pixel_values_videos, video_grid_thw))
            if pixels is not None
        ]
        width = None
        if self.shares > 1:
            kinds, width = self._my_share(kinds)
        parts = [self.vision_model(pixels, grid) for pixels, grid in kinds]
        if not parts:  # nothing to encode: zero rows, joined to every weight (joined_zero says why)
            return vision_context_parallel.idle_features(self.vision_model, width or 1)
        features = torch.cat(parts) if len(parts) > 1 else parts[0]
        if width is not None:  # the language side splits the gradient back into equal shares
            features = torch.nn.functional.pad(features, (0, 0, 0, width - features.shape[0]))
        return features

    def _my_share(self, kinds):
        """(this replica's items, by kind, as (pixels, grids); the rows every share sends)."""
        grids = [g for _, grid in kinds for g in grid.tolist()]
        owned, _, width = vision_context_parallel.shares_of(
            grids, self.vision_model.item_flops, self.vision_model.shape.spatial_merge_size, self.shares
        )
        mine, offset, out = owned[self.share], 0, []
        for pixels, grid in kinds:
            own = [i - offset for i in mine if offset <= i < offset + grid.shape[0]]
            if own:
                out.append((vision_context_parallel.take_items(pixels, grid, own), grid[own]))
            offset += grid.shape[0]
        return out, width


class ReceivedFeatures:
    """The language model's side: the features the tower's ranks sent for the current micro-batch,
    from ``shares`` replicas (1: one replica sends all), merged at the placeholder tokens.

    ``item_flops(grid_thw)``: the tower's forward FLOPs of one item, which the replicas deal by;
    ``spatial_merge``: the tower's patch merge, which sizes an item's rows."""

    def __init__(self, item_flops, spatial_merge: int, shares: int = 1):
        self.item_flops, self.spatial_merge, self.shares = item_flops, spatial_merge, shares
        self.pending: torch.Tensor | None = None

    def take(self, input_tensor):
        """The activations of megatron's multi-module dict, keeping the tower's features for ``merge``."""
        if isinstance(input_tensor, list) and input_tensor and isinstance(input_tensor[0], dict):
            self.pending = input_tensor[0].get("vision")
            activations = input_tensor[0].get("language")  # [tensor] from megatron's p2p communicator
            input_tensor = activations if isinstance(activations, list) else [activations]
        return input_tensor

    def in_batch_order(self, received, grids) -> torch.Tensor:
        """The items' features in batch order from ``shares`` shares of equal width (each replica's
        items in order, then padding), as the tower's replicas dealt them."""
        grids = [g for part in grids if part is not None for g in part.tolist()]
        owned, tokens, width = vision_context_parallel.shares_of(
            grids, self.item_flops, self.spatial_merge, self.shares
        )
        if received.shape[0] != self.shares * width:
            raise ValueError(
                f"the vision ranks sent {received.shape[0]} feature rows; {self.shares} shares "
                f"of {width} were expected for this micro-batch's grids"
            )
        if not grids:
            return received[:0]
        return received.index_select(0, vision_context_parallel.batch_order(owned, tokens, width).to(received.device))

    def merge(self, model, embeds_BSH, input_ids_BS, grids) -> torch.Tensor:
        """``embeds_BSH`` with the pending features at ``model``'s placeholder tokens: the micro-batch's
        images, then its videos (at least one row: a zero row when it has none; in shares,
        ``in_batch_order``). They join the graph even when no row is used, so their gradient, sent
        back to the tower, always exists."""
        received, self.pending = self.pending, None
        counts = [int((input_ids_BS == token).sum()) for token in (model.image_token_id, model.video_token_id)]
        features = received if self.shares == 1 else self.in_batch_order(received, grids)
        if features.shape[0] != (max(sum(counts), 1) if self.shares == 1 else sum(counts)):
            raise ValueError(
                f"the batch has {counts[0]} image and {counts[1]} video placeholder tokens but the vision "
                f"ranks sent {features.shape[0]} features"
            )
        image, video = features[: counts[0]], features[counts[0] : sum(counts)]
        if counts[0]:
            embeds_BSH = model.scatter_features(embeds_BSH, input_ids_BS, model.image_token_id, image, "images")
        if counts[1]:
            embeds_BSH = model.scatter_features(embeds_BSH, input_ids_BS, model.video_token_id, video, "videos")
        return embeds_BSH + (received.sum() * 0).to(embeds_BSH.dtype)


def own_ranks_module(built, separate):
    """The module this rank trains, from what the model's ``build_fn`` built for ``separate.role``:
    the tower wrapped as a ``VisionStage`` on the tower's ranks; on the language model's, the model
    given the features it receives."""
    if separate.on_vision:
        return VisionStage(built, separate.groups, shares=separate.fan_in, share=separate.share)
    built.received = ReceivedFeatures(
        built.vision_item_flops, built.shape.vision.spatial_merge_size, shares=separate.fan_in
    )
    return built
