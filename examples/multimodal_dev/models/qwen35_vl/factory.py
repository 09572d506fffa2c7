"""Build a Qwen3.5-VL model from a shape and parallel settings, validating them up front."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .configuration import Qwen35VLShape, language_transformer_config, vision_transformer_config
from .model import Qwen35VLModel
from .parallel import validate_parallel
from .vision_encoder import Qwen35VisionModel

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig


def build_model(
    shape: Qwen35VLShape,
    backend: str = "local",
    params_dtype: torch.dtype = torch.float32,
    max_sequence_length: int = 4096,
    configs: tuple[TransformerConfig, TransformerConfig] | None = None,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    module: str | None = None,
    **settings: Any,
) -> Qwen35VLModel | Qwen35VisionModel:
    """``configs``: (decoder, vision) TransformerConfigs made from megatron's args (training);
    without them, standalone configs from ``settings`` (TransformerConfig fields such as
    tensor_model_parallel_size) for tests, conversion and benchmarks. ``pre_process`` /
    ``post_process`` / ``vp_stage``: the pipeline stage to build (megatron.training's get_model).
    ``module``: "vision" or "language" where the tower runs on ranks of its own
    (vision_ranks/stage.py), the tower alone or the language model without it."""
    if configs is None:
        configs = (
            language_transformer_config(shape.text, params_dtype, **settings),
            vision_transformer_config(shape.vision, params_dtype, **settings),
        )
    language_config, vision_config = configs
    tp, vision_tp = language_config.tensor_model_parallel_size, vision_config.tensor_model_parallel_size
    validate_parallel(
        shape,
        tp,
        language_config.context_parallel_size,
        language_config.expert_model_parallel_size,
        vision_tp if vision_tp != tp else None,
        colocated=module is None,
    )
    if module == "vision":
        return Qwen35VisionModel(vision_config, shape.vision, backend)
    return Qwen35VLModel(
        shape,
        language_config,
        vision_config,
        backend,
        max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        tower=module != "language",
    )
