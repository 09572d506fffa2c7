"""Qwen3.5-VL's ``ModelEntry``: its shapes, parallel checks and FLOPs are read directly (their modules
import neither torch nor megatron-core); building, MRoPE and the Hugging Face mapping are imported on
first call."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..entry import ModelEntry, on_first_call
from . import configuration, flops, parallel

if TYPE_CHECKING:
    from .configuration import Qwen35VLShape
    from .flops import FlopsBreakdown
    from .model import Qwen35VLModel
    from .vision_encoder import Qwen35VisionModel


def _factory():
    from . import factory

    return factory


def _mrope():
    from . import mrope

    return mrope


def _hf_mapping():
    from . import hf_mapping

    return hf_mapping


# At this model's own types (its shape, its FLOPs, what it builds): the checker holds each function to its
# seam's signature.
ENTRY: ModelEntry[Qwen35VLShape, FlopsBreakdown, Qwen35VLModel | Qwen35VisionModel] = ModelEntry(
    arch="qwen35_vl",
    variants=configuration.VARIANTS,
    shape_fn=configuration.get_variant,
    shape_from_hf=configuration.from_hf_config,
    shape_to_hf=configuration.to_hf_config_dict,
    configs_fn=configuration.configs_from_args,
    build_fn=on_first_call(lambda: _factory().build_model),
    parallel_problems=parallel.parallel_problems,
    validate_parallel=parallel.validate_parallel,
    packed_position_ids=on_first_call(lambda: _mrope().packed_position_ids),
    padded_position_ids=on_first_call(lambda: _mrope().padded_batch_position_ids),
    run_grids=on_first_call(lambda: _mrope().run_grids),
    split_video_frames=on_first_call(lambda: _mrope().split_video_frames),
    micro_batch_flops=flops.micro_batch_flops,
    vision_flops=flops.vision_flops,
    flops_breakdown=flops.FlopsBreakdown,
    hf_mapping_rules=on_first_call(lambda: _hf_mapping().mapping_rules),
    hf_model_state=on_first_call(lambda: _hf_mapping().model_state),
    hf_fp32_suffixes=configuration.FP32_HF_SUFFIXES,
    load_hf_state=on_first_call(lambda: _hf_mapping().load_hf_into_model),
)
