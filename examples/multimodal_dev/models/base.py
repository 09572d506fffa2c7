"""Vision + language composition shared by the VLMs of this playground.

Legend: B batch, S sequence (BSHD); packed THD batches are B = 1, S = T with
``PackedSeqParams``. N vision tokens after the patch merger, H hidden size.

    input_ids [B, S] -> word embeddings [B, S, H]
    pixel_values, image_grid_thw -> vision tower -> [N_img, H]   (all images on every rank; under
        context parallelism each image encoded on one CP rank and gathered: vision_context_parallel.py)
    merge: rows of the image placeholder tokens, in reading order, take the vision features
    -> [S, B, H] decoder input -> language model (rotary from position_ids [3, B, S]) -> logits / loss

The merge happens before anything partitions the sequence, so every vision feature lands
exactly once. Then, in this order:
    context parallelism: one ``ContextParallelSplit`` index (per-sample zigzag for THD, row zigzag
        for BSHD) is applied to the decoder input and to every per-token tensor the language model
        reads: input_ids (MTP), labels, loss_mask, position_ids. Nothing else slices them.
    sequence parallelism: the decoder input is scattered over TP ranks, as GPTModel's own
        embedding would have done (a decoder_input handed to GPTModel is used as is).
The per-token loss that comes back covers this rank's tokens only; ``return_loss_mask`` hands
back the matching loss mask so the caller never slices one itself.

Pipeline parallelism: a stage is built with ``pre_process`` / ``post_process`` (megatron.training's
get_model). Only the first stage holds the vision tower and does the merge; later stages take the
decoder activations megatron's schedule hands to ``set_input_tensor`` ([T/cp(/tp), 1, H] THD,
[S/cp(/tp), B, H] BSHD: already split) and read only positions, packed-sequence parameters,
the padding mask and, on the last stage, labels, loss mask (and input_ids for the MTP head).
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from .common import vision_context_parallel
from .common.batch_memo import on_host, to_device
from .common.context_parallel import ContextParallelSplit


class VisionLanguageModel(MegatronModule):
    vision_only = False  # the tower alone is another module (vision_ranks/stage.py)
    # Features encoded elsewhere, by the tower's own ranks: vision_ranks/stage.py's ReceivedFeatures
    # (``take`` the schedule's input, ``pending`` features, ``merge`` them). None: this model encodes.
    received = None
    # Megatron-FSDP gathers a layer's weights when the layer runs, in collectives every data-parallel
    # rank must join in the same order: there (model_provider sets it) the tower runs exactly once per
    # forward on every rank, images and videos together, a stand-in frame where the batch has none.
    tower_once_per_forward = False

    def __init__(self, config, vision_model, language_model, image_token_id: int, video_token_id: int):
        """``vision_model`` is None on pipeline stages other than the first, and where the tower runs on
        ranks of its own."""
        super().__init__(config=config)
        self.vision_model = vision_model
        self.language_model = language_model
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        # megatron's gradient finalisation finds the stage's model by ``pre_process`` and reduces
        # the tied embedding / MTP-shared word embeddings through the two members below.
        self.pre_process = language_model.pre_process
        self.post_process = language_model.post_process
        self.share_embeddings_and_output_weights = language_model.share_embeddings_and_output_weights

    @property
    def pg_collection(self):
        """The decoder's process groups: megatron.training reads them off the model it trains."""
        return self.language_model.pg_collection

    def shared_embedding_or_output_weight(self):
        return self.language_model.shared_embedding_or_output_weight()

    def set_input_tensor(self, input_tensor):
        """The previous stage's activations; with the tower on ranks of its own, what arrives also
        carries its features, which ``received`` keeps for ``embed``."""
        if self.received is not None:
            input_tensor = self.received.take(input_tensor)
        self.language_model.set_input_tensor(input_tensor)

    def scatter_features(self, embeds_BSH, input_ids_BS, token_id, features, what):
        # The placeholders' positions are found on the batch's host copy of the ids: found on the
        # device they are read back (a sync), and a boolean-mask merge reads its mask's count back
        # in forward and again in backward.
        rows = (on_host(input_ids_BS).reshape(-1) == token_id).nonzero().squeeze(1)
        if rows.numel() != features.shape[0]:
            raise ValueError(
                f"{what}: the batch has {rows.numel()} placeholder tokens (id {token_id}) but the vision tower "
                f"produced {features.shape[0]} features; the processor's token expansion and "
                f"the grid_thw / pixel values disagree"
            )
        flat = embeds_BSH.reshape(-1, embeds_BSH.shape[-1])
        merged = flat.index_put((to_device(rows, flat.device),), features.to(flat.dtype))
        return merged.view_as(embeds_BSH)

    def _word_embeddings(self, input_ids_BS) -> torch.Tensor:
        """[B, S, H] for the whole row. Under sequence parallelism megatron-core's embedding
        reduce-scatters over TP (the MTP head relies on that, so it stays on); the merge needs every
        position, so the shards are gathered back here (together: the all-reduce of plain TP).
        Downstream, every TP rank holds the same gradient for the whole row, so the gather's
        backward keeps this rank's shard instead of summing over ranks."""
        embedding = self.language_model.embedding.word_embeddings
        out = embedding(input_ids_BS)
        if getattr(embedding, "reduce_scatter_embeddings", False):
            out = tensor_parallel.gather_from_sequence_parallel_region(
                out, tensor_parallel_output_grad=False, group=self.language_model.pg_collection.tp
            ).transpose(0, 1)
        return out

    def _encode(self, pixels, grids) -> torch.Tensor:
        bridge = getattr(self.vision_model, "bridge", None)
        if bridge is not None:  # its own tensor-parallel size: vision_bridge.py
            return bridge.encode(self.vision_model, pixels, grids)
        return vision_context_parallel.encode(self.vision_model, pixels, grids, self.language_model.pg_collection.cp)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """megatron-core's, except that a vision tower on its own layout numbers its copies by its
        own data-parallel group: its replica ids then name one main copy of each shard."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, sharded_state_dict_default

        bridge = getattr(self.vision_model, "bridge", None)
        if bridge is None:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out = {}
        for name, module in self.named_children():
            own = {**metadata, "dp_cp_group": bridge.dp} if module is self.vision_model else metadata
            out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, own))
        return out

    def vision_item_flops(self, grid_thw) -> float:
        """The tower's forward FLOPs of one item of this (t, h, w) grid, where the tower is elsewhere:
        the cost its replicas deal the items by (``vision_context_parallel.shares_of``)."""
        raise NotImplementedError(f"{type(self).__name__} does not say its vision tower's FLOPs per item")

    def embed_words(self, input_ids_BS) -> torch.Tensor:
        """Decoder input [S, B, H] of word embeddings alone: a decoding step's generated tokens, which
        carry no vision features even where one is a placeholder id (transformers embeds it as a word),
        and need no host-side check of the ids."""
        return self._word_embeddings(input_ids_BS).transpose(0, 1).contiguous()

    def embed(
        self, input_ids_BS, pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None
    ) -> torch.Tensor:
        """Decoder input [S, B, H] with vision features merged at placeholder tokens."""
        embeds_BSH = self._word_embeddings(input_ids_BS)
        if self.received is not None and self.received.pending is not None:  # encoded on the tower's own ranks
            grids = (image_grid_thw, video_grid_thw)
            return self.received.merge(self, embeds_BSH, input_ids_BS, grids).transpose(0, 1).contiguous()
        kinds = (
            ("images", "image", "pixel_values", pixel_values, image_grid_thw, self.image_token_id),
            ("videos", "video", "pixel_values_videos", pixel_values_videos, video_grid_thw, self.video_token_id),
        )
        for _, kind, name, pixels, _, token_id in kinds:
            if pixels is None and bool((on_host(input_ids_BS) == token_id).any()):
                raise ValueError(f"the batch has {kind} placeholder tokens but no {name}")
        given = [(what, pixels, grids, token_id) for what, _, _, pixels, grids, token_id in kinds if pixels is not None]
        if self.tower_once_per_forward and self.vision_model is not None:
            embeds_BSH = self._merge_in_one_tower_call(embeds_BSH, input_ids_BS, given)
        else:
            for what, pixels, grids, token_id in given:
                feats = self._encode(pixels, grids)
                embeds_BSH = self.scatter_features(embeds_BSH, input_ids_BS, token_id, feats, what)
            if not given and torch.is_grad_enabled() and self.vision_model is not None:
                embeds_BSH = embeds_BSH + vision_context_parallel.joined_zero(self.vision_model).to(embeds_BSH)
        return embeds_BSH.transpose(0, 1).contiguous()

    def _merge_in_one_tower_call(self, embeds_BSH, input_ids_BS, given) -> torch.Tensor:
        """The images and videos of ``given`` [(what, pixels, grids, token id)] encoded in one call of the
        tower, and a stand-in frame encoded (its features times zero) where there are none: the tower
        runs once per forward on every rank, whatever the batch holds (``tower_once_per_forward``)."""
        if not given:
            pixels, grids = vision_context_parallel.idle_item(self.vision_model)
            return embeds_BSH + self._encode(pixels, grids).sum().to(embeds_BSH) * 0
        feats = self._encode(torch.cat([p for _, p, _, _ in given]), torch.cat([g for _, _, g, _ in given]))
        merge = self.vision_model.shape.spatial_merge_size
        start = 0
        for what, _, grids, token_id in given:
            rows = int(grids.prod(-1).sum()) // merge**2
            embeds_BSH = self.scatter_features(embeds_BSH, input_ids_BS, token_id, feats[start : start + rows], what)
            start += rows
        return embeds_BSH

    def _partition_sequence(
        self, decoder_input, input_ids, position_ids, labels, loss_mask, padding_mask, packed_seq_params
    ) -> tuple:
        """This rank's part of the row, after the merge (module docstring): the context-parallel split of
        the decoder input and of every per-token tensor, then the sequence-parallel scatter of the decoder
        input. Returns (decoder_input, input_ids, position_ids, labels, loss_mask, padding_mask)."""
        split = ContextParallelSplit.for_row(
            position_ids.shape[-1], self.language_model.pg_collection.cp, packed_seq_params
        )
        if split is not None:
            decoder_input = split.take(decoder_input, 0)
            input_ids, labels, loss_mask, padding_mask = (
                split.take(t, 1) for t in (input_ids, labels, loss_mask, padding_mask)
            )
            position_ids = split.take(position_ids, -1)
        if self.config.sequence_parallel:
            if decoder_input is not None:
                decoder_input = tensor_parallel.scatter_to_sequence_parallel_region(
                    decoder_input, group=self.language_model.pg_collection.tp
                )
            padding_mask = None
        return decoder_input, input_ids, position_ids, labels, loss_mask, padding_mask

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask=None,
        labels=None,
        loss_mask=None,
        pixel_values=None,
        image_grid_thw=None,
        pixel_values_videos=None,
        video_grid_thw=None,
        packed_seq_params=None,
        padding_mask=None,
        return_loss_mask: bool = False,
    ):
        """Logits [B, S_local, V] when ``labels`` is None, else per-token loss [B, S_local]
        (S_local = S / cp), plus the loss mask of those tokens when ``return_loss_mask``.

        ``attention_mask`` must be None: padded batches are right-padded (see the error below).
        ``padding_mask`` [B, S] (True at padding) keeps padding out of the MoE router's
        load-balancing statistics, whose amount of padding would otherwise depend on CP/SP/EP.
        Under sequence parallelism it is dropped: megatron-core's MTP head rolls it with the
        row's global sample offsets, which do not fit an SP-scattered mask."""
        if attention_mask is not None:
            # Gated DeltaNet carries a recurrent state through every position: a padding mask on
            # the attention layers alone would leave the DeltaNet layers reading the padding.
            raise ValueError(
                "attention_mask: the Gated DeltaNet layers cannot honour a padding mask (their state "
                "runs through padded positions); pack samples (THD, cu_seqlens) or right-pad them "
                "(causal layers never see the padding) and pass attention_mask=None"
            )
        decoder_input = None  # later pipeline stages: the activations given to set_input_tensor
        if self.pre_process:
            decoder_input = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        elif pixel_values is not None or pixel_values_videos is not None:
            raise ValueError("pixel values handed to a pipeline stage without the vision tower")
        decoder_input, input_ids, position_ids, labels, loss_mask, padding_mask = self._partition_sequence(
            decoder_input, input_ids, position_ids, labels, loss_mask, padding_mask, packed_seq_params
        )
        output = self.language_model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            decoder_input=decoder_input,
            labels=labels,
            loss_mask=loss_mask,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
        return (output, loss_mask) if return_loss_mask else output
