"""Qwen3.5-VL on megatron-core: the vision tower of ``vision_encoder`` and a ``GPTModel``
decoder built from ``specs`` (hybrid Gated DeltaNet / gated attention, dense or MoE), whose
rotary module is the interleaved MRoPE of ``mrope``."""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel

from ..base import VisionLanguageModel
from .configuration import Qwen35VLShape
from .mrope import InterleavedMRoPE
from .specs import decoder_block_spec
from .vision_encoder import Qwen35VisionModel


class Qwen35VLModel(VisionLanguageModel):
    def __init__(self, shape: Qwen35VLShape, language_config, vision_config, backend: str = "local",
                 max_sequence_length: int = 4096):
        text = shape.text
        language_model = GPTModel(
            config=language_config,
            transformer_layer_spec=decoder_block_spec(language_config, text.layer_types, backend),
            vocab_size=text.vocab_size,
            max_sequence_length=max_sequence_length,
            position_embedding_type="mrope",
            rotary_percent=text.partial_rotary_factor,
            rotary_base=int(text.rope_theta),
            share_embeddings_and_output_weights=text.tie_word_embeddings,
        )
        # megatron-core's MultimodalRotaryEmbedding concatenates the t/h/w sections; Qwen3.5
        # interleaves them channel by channel. Same call signature, so it drops in.
        language_model.rotary_pos_emb = InterleavedMRoPE(
            text.head_dim, text.partial_rotary_factor, text.rope_theta, text.mrope_section)
        vision_model = Qwen35VisionModel(vision_config, shape.vision, backend)
        super().__init__(language_config, vision_model, language_model, shape.image_token_id, shape.video_token_id)
        self.shape = shape
