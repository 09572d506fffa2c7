"""Pipeline splits: the project's stage table equals megatron-core's own layer placement, every
layer keeps its global Gated DeltaNet / attention type, impossible splits are refused by name,
and the recommended cluster layouts are valid splits of their variants."""

import pytest
import torch
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.planner.pipeline_layout import LAYOUTS, stage_layers

SPLITS = [
    (4, 2, None, None, None),
    (4, 2, 2, None, None),
    (4, 2, None, 1, 3),
    (4, 4, None, None, None),
    (8, 2, 2, 2, None),
    (8, 2, 2, None, 2),
    (48, 8, 2, None, None),
    (60, 8, 4, 4, 8),
    (40, 2, None, 17, 23),
    (12, 3, 2, 4, None),
]


def _megatron_layers(num_layers, pp, vp, first, last):
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=2,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        pipeline_dtype=torch.float32,
    )
    out = []
    for p in range(pp):
        chunks = []
        for v in range(vp or 1):
            stage = v if vp else None
            offset = get_transformer_layer_offset(config, stage, pp_rank=p)
            chunks.append(range(offset, offset + get_num_layers_to_build(config, stage, pp_rank=p)))
        out.append(chunks)
    return out


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_stage_table_is_megatron_core_placement(split):
    ours = stage_layers(*split)
    assert ours == _megatron_layers(*split)
    placed = sorted(i for chunks in ours for chunk in chunks for i in chunk)
    assert placed == list(range(split[0]))  # every layer exactly once


@pytest.mark.parametrize(
    "args, message",
    [
        ((4, 3), "--pipeline-model-parallel-size 3: the 4 decoder layers do not split evenly over 3 stages"),
        ((4, 2, 4), "--num-virtual-stages-per-pipeline-rank 4: pipeline stage 0 holds 2 layers, not a multiple of 4"),
        ((4, 1, 2), "--num-virtual-stages-per-pipeline-rank 2 needs pipeline parallelism"),
        ((4, 2, None, 4), "--decoder-first-pipeline-num-layers 4: must be between 1 and 3"),
        ((4, 2, None, 1, 1), "= 2 layers with --pipeline-model-parallel-size 2, but the model has 4"),
        ((8, 2, 2, 2, 6), "with both --decoder-first-pipeline-num-layers 2 and --decoder-last-pipeline-num-layers 6"),
        ((60, 8, 4, 6, 6), "--num-virtual-stages-per-pipeline-rank 4: pipeline stage 0 holds 6 layers"),
    ],
)
def test_impossible_splits_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        stage_layers(*args)


@pytest.mark.parametrize("variant", list(LAYOUTS))
def test_recommended_layouts_split_their_variant(variant):
    tp, pp, vp, cp, ep, etp, first, last, gpus = LAYOUTS[variant]
    text = get_variant(variant).text
    stage_layers(text.num_layers, pp, vp, first, last)
    assert gpus % (tp * pp * cp) == 0 and (gpus // pp) % (etp * ep) == 0
    assert (text.num_experts or 1) % ep == 0
    assert text.num_attention_heads % tp == 0 and text.linear_num_value_heads % tp == 0


def test_decoder_spec_slices_the_global_pattern():
    """Each stage builds the types of its global layers (tiny: G G G A)."""
    from examples.multimodal_dev.models.qwen35_vl.specs import stage_layer_types

    types = get_variant("tiny").text.layer_types
    for split in [(4, 2, None, None, None), (4, 2, 2, None, None), (4, 2, None, 1, 3)]:
        config = TransformerConfig(
            num_layers=4,
            hidden_size=8,
            num_attention_heads=2,
            pipeline_dtype=torch.float32,
            pipeline_model_parallel_size=split[1],
            virtual_pipeline_model_parallel_size=split[2],
            num_layers_in_first_pipeline_stage=split[3],
            num_layers_in_last_pipeline_stage=split[4],
        )
        for p, chunks in enumerate(stage_layers(*split)):
            for v, chunk in enumerate(chunks):
                from unittest import mock

                with mock.patch("megatron.core.parallel_state.get_pipeline_model_parallel_rank", return_value=p):
                    got = stage_layer_types(config, types, v if split[2] else None)
                assert got == [types[i] for i in chunk], (split, p, v)
