"""Build a Qwen3.5-VL model from a shape and parallel settings, validating them up front."""

from __future__ import annotations

import torch

from .configuration import Qwen35VLShape, language_transformer_config, vision_transformer_config
from .model import Qwen35VLModel


def validate_parallel(shape: Qwen35VLShape, tp: int = 1, cp: int = 1, ep: int = 1) -> None:
    """Refuse settings the model cannot be split by, naming the flag and the value."""
    t, v = shape.text, shape.vision
    checks = [
        (t.num_attention_heads % tp == 0, f"--tensor-model-parallel-size {tp} must divide num_attention_heads {t.num_attention_heads}"),
        (t.num_kv_heads % tp == 0 or tp % t.num_kv_heads == 0, f"--tensor-model-parallel-size {tp} and num_key_value_heads {t.num_kv_heads} must divide one another"),
        (t.linear_num_key_heads % tp == 0, f"--tensor-model-parallel-size {tp} must divide the Gated DeltaNet key heads {t.linear_num_key_heads}"),
        (t.linear_num_value_heads % tp == 0, f"--tensor-model-parallel-size {tp} must divide the Gated DeltaNet value heads {t.linear_num_value_heads}"),
        (v.num_heads % tp == 0, f"--tensor-model-parallel-size {tp} must divide the vision heads {v.num_heads}"),
        ((t.linear_num_key_heads // tp) % cp == 0 and (t.linear_num_value_heads // tp) % cp == 0,
         f"--context-parallel-size {cp} must divide the per-TP-rank Gated DeltaNet heads "
         f"(key {t.linear_num_key_heads // max(tp, 1)}, value {t.linear_num_value_heads // max(tp, 1)})"),
        (ep == 1 or t.is_moe, f"--expert-model-parallel-size {ep} needs an MoE variant; this one is dense"),
        (not t.is_moe or t.num_experts % ep == 0, f"--expert-model-parallel-size {ep} must divide num_experts {t.num_experts}"),
    ]
    errors = [msg for ok, msg in checks if not ok]
    if errors:
        raise ValueError("invalid parallel settings:\n  " + "\n  ".join(errors))


def build_model(shape: Qwen35VLShape, backend: str = "local", params_dtype=torch.float32,
                max_sequence_length: int = 4096, configs=None, pre_process: bool = True, post_process: bool = True,
                vp_stage: int | None = None, **settings) -> Qwen35VLModel:
    """``configs``: (decoder, vision) TransformerConfigs made from megatron's args (training);
    without them, standalone configs from ``settings`` (TransformerConfig fields such as
    tensor_model_parallel_size) for tests, conversion and benchmarks. ``pre_process`` /
    ``post_process`` / ``vp_stage``: the pipeline stage to build (megatron.training's get_model)."""
    if configs is None:
        configs = (language_transformer_config(shape.text, params_dtype, **settings),
                   vision_transformer_config(shape.vision, params_dtype, **settings))
    language_config, vision_config = configs
    validate_parallel(shape, language_config.tensor_model_parallel_size, language_config.context_parallel_size,
                      language_config.expert_model_parallel_size)
    return Qwen35VLModel(shape, language_config, vision_config, backend, max_sequence_length,
                         pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
