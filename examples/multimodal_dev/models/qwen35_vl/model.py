"""Qwen3.5-VL on megatron-core: the vision tower of ``vision_encoder`` and a ``GPTModel``
decoder built from ``specs`` (hybrid Gated DeltaNet / gated attention, dense or MoE), whose
rotary module is the interleaved MRoPE of ``mrope``.

With an MTP head (``shape.text.mtp_num_layers``), megatron-core's GPTModel runs it after the
decoder when labels are given: the head embeds the next tokens with the word embeddings (so an
image placeholder is its token embedding; every such position is prompt and carries no loss),
rolls ids, positions and labels per packed sample, and adds the scaled MTP loss to the graph."""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt import GPTModel

from ...megatron_changes import apply
from ..base import VisionLanguageModel
from ..common import vision_bridge
from ..common.batch_memo import on_host
from ..common.context_parallel import ContextParallelSplit
from .configuration import Qwen35VLShape
from .flops import vision_flops
from .mrope import InterleavedMRoPE
from .specs import decoder_block_spec, mtp_block_spec
from .vision_encoder import Qwen35VisionModel


class _LanguageModel(GPTModel):
    """GPTModel whose MTP head is told the packed row's padded sample boundaries.

    megatron-core's MTP rolls ids, labels and masks per sample using ``cu_seqlens_q`` as offsets
    into the row, i.e. it assumes the row has no per-sample padding. Our collate pads every
    sample (to a multiple of 2*CP) and records that in ``cu_seqlens_q_padded``, so the roll must
    use those offsets. Rolling over a sample's padded tail is exact for its real tokens: the
    token after the last real one becomes a pad (id 0, loss mask 0), just what the unpadded roll
    fills in. The MTP layer's attention over the padded segment is causal, so real tokens never
    see the tail."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.share_embeddings_and_output_weights and self.mtp_process and self.post_process and not self.pre_process:
            # A later last stage with tied embeddings and the MTP head: megatron-core 0.19.2 computes its
            # logits with the stage's copy of the word embeddings (the head needs one; the embedding group
            # keeps it equal to the first stage's), yet allocates the output layer's weight too, unused,
            # and its checkpointing asserts that weight is absent: loading or saving such a stage stopped.
            self.output_layer.weight = None

    def _preprocess(self, *args, position_ids=None, packed_seq_params=None, **kwargs):
        """Under context parallelism a THD row's ``position_ids`` arrive already split (every
        per-token tensor is split once, by the VLM). megatron-core's THD rotary, however, slices
        the rotary table itself and so expects it for the global row; the local positions are put
        back at their global places (zeros elsewhere, never read) for that slice to find them."""
        if (
            packed_seq_params is not None
            and packed_seq_params.qkv_format == "thd"
            and position_ids is not None
            and packed_seq_params.cu_seqlens_q_padded is not None
        ):
            total = int(on_host(packed_seq_params.cu_seqlens_q_padded)[-1])
            split = ContextParallelSplit.for_row(total, self.pg_collection.cp, packed_seq_params)
            if split is not None:
                position_ids = split.place(position_ids, -1)
        return super()._preprocess(*args, position_ids=position_ids, packed_seq_params=packed_seq_params, **kwargs)

    def _postprocess(self, *args, packed_seq_params=None, **kwargs):
        if packed_seq_params is not None and packed_seq_params.cu_seqlens_q_padded is not None:
            packed_seq_params = dataclasses.replace(
                packed_seq_params,
                cu_seqlens_q=packed_seq_params.cu_seqlens_q_padded,
                cu_seqlens_kv=packed_seq_params.cu_seqlens_kv_padded,
            )
        return super()._postprocess(*args, packed_seq_params=packed_seq_params, **kwargs)


class Qwen35VLModel(VisionLanguageModel):
    def __init__(
        self,
        shape: Qwen35VLShape,
        language_config,
        vision_config,
        backend: str = "local",
        max_sequence_length: int = 4096,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
        tower: bool = True,
    ):
        """One pipeline stage (the whole model by default): the vision tower only where
        ``pre_process`` and ``tower`` (False: it runs on ranks of its own); GPTModel places the output
        layer, loss and MTP head where ``post_process``."""
        text = shape.text
        if language_config.mtp_num_layers:
            if language_config.mtp_num_layers > 1 and language_config.context_parallel_size > 1:
                raise ValueError(
                    f"--mtp-num-layers {language_config.mtp_num_layers} with --context-parallel-size "
                    f"{language_config.context_parallel_size}: the MTP loss is split-independent for "
                    "one MTP layer only (Qwen3.5 has one)"
                )
            apply("mtp-under-cp")
        language_model = _LanguageModel(
            config=language_config,
            transformer_layer_spec=decoder_block_spec(language_config, text.layer_types, backend, vp_stage),
            vocab_size=text.vocab_size,
            max_sequence_length=max_sequence_length,
            position_embedding_type="mrope",
            rotary_percent=text.partial_rotary_factor,
            rotary_base=int(text.rope_theta),
            share_embeddings_and_output_weights=text.tie_word_embeddings,
            mtp_block_spec=mtp_block_spec(language_config, backend),
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
        )
        # megatron-core's MultimodalRotaryEmbedding concatenates the t/h/w sections; Qwen3.5
        # interleaves them channel by channel. Same call signature, so it drops in.
        language_model.rotary_pos_emb = InterleavedMRoPE(
            text.head_dim, text.partial_rotary_factor, text.rope_theta, text.mrope_section
        )
        bridge = None
        if tower and vision_config.tensor_model_parallel_size != language_config.tensor_model_parallel_size:
            # its own groups, made by every rank (collectively), the vision tower only on the first stage
            bridge = vision_bridge.for_layout(vision_config.tensor_model_parallel_size, language_model.pg_collection)
            language_config.finalize_model_grads_func = vision_bridge.finalize_model_grads
        vision_model = (
            Qwen35VisionModel(vision_config, shape.vision, backend, bridge) if pre_process and tower else None
        )
        super().__init__(language_config, vision_model, language_model, shape.image_token_id, shape.video_token_id)
        self.shape = shape

    def vision_item_flops(self, grid_thw) -> float:
        return vision_flops(self.shape.vision, self.shape.vision.out_hidden_size, [tuple(grid_thw)])
