"""Vision + language composition shared by the VLMs of this playground.

Legend: B batch, S sequence (BSHD); packed THD batches are B = 1, S = T with
``PackedSeqParams``. N vision tokens after the patch merger, H hidden size.

    input_ids [B, S] -> word embeddings [B, S, H]
    pixel_values, image_grid_thw -> vision tower -> [N_img, H]   (all images, every rank)
    merge: rows of the image placeholder tokens, in reading order, take the vision features
    -> [S, B, H] decoder input -> language model (rotary from position_ids [3, B, S]) -> logits / loss

The merge happens before anything partitions the sequence (context parallelism, sequence
parallelism), so every vision feature lands exactly once.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule


class VisionLanguageModel(MegatronModule):
    def __init__(self, config, vision_model, language_model, image_token_id: int, video_token_id: int):
        super().__init__(config=config)
        self.vision_model = vision_model
        self.language_model = language_model
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id

    def set_input_tensor(self, input_tensor):
        self.language_model.set_input_tensor(input_tensor)

    def _scatter_features(self, embeds_BSH, input_ids_BS, token_id, features, what):
        mask = input_ids_BS == token_id
        n_tokens = int(mask.sum())
        if n_tokens != features.shape[0]:
            raise ValueError(
                f"{what}: the batch has {n_tokens} placeholder tokens (id {token_id}) but the vision tower "
                f"produced {features.shape[0]} features; the processor's token expansion and "
                f"the grid_thw / pixel values disagree"
            )
        embeds_BSH = embeds_BSH.clone()
        embeds_BSH[mask] = features.to(embeds_BSH.dtype)
        return embeds_BSH

    def embed(self, input_ids_BS, pixel_values=None, image_grid_thw=None,
              pixel_values_videos=None, video_grid_thw=None) -> torch.Tensor:
        """Decoder input [S, B, H] with vision features merged at placeholder tokens."""
        embeds_BSH = self.language_model.embedding.word_embeddings(input_ids_BS)
        if pixel_values is not None:
            feats = self.vision_model(pixel_values, image_grid_thw)
            embeds_BSH = self._scatter_features(embeds_BSH, input_ids_BS, self.image_token_id, feats, "images")
        elif bool((input_ids_BS == self.image_token_id).any()):
            raise ValueError("the batch has image placeholder tokens but no pixel_values")
        if pixel_values_videos is not None:
            feats = self.vision_model(pixel_values_videos, video_grid_thw)
            embeds_BSH = self._scatter_features(embeds_BSH, input_ids_BS, self.video_token_id, feats, "videos")
        return embeds_BSH.transpose(0, 1).contiguous()

    def forward(self, input_ids, position_ids, attention_mask=None, labels=None, loss_mask=None,
                pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None,
                packed_seq_params=None):
        """Logits [B, S, V] when ``labels`` is None, else per-token loss [B, S]."""
        decoder_input = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        return self.language_model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
            decoder_input=decoder_input, labels=labels, loss_mask=loss_mask,
            packed_seq_params=packed_seq_params,
        )
