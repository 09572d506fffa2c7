"""The ``transformers`` Qwen3.5-VL reference: its classes per ``model_type``, and a model built
from a shape (random weights), for parity checks and side-by-side benchmarks."""

from __future__ import annotations

import torch

from examples.multimodal_dev.models import model_of


def hf_classes(model_type: str):
    """(config class, model class) of a Qwen3.5 ``model_type`` ('qwen3_5' or 'qwen3_5_moe')."""
    import transformers

    classes = {
        "qwen3_5": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration),
        "qwen3_5_moe": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration),
    }
    if model_type not in classes:
        raise ValueError(f"model_type {model_type!r} is not Qwen3.5; expected one of {sorted(classes)}")
    return classes[model_type]


def hf_model_for_shape(shape, attn_implementation: str = "sdpa", seed: int = 0):
    """``Qwen3_5(Moe)ForConditionalGeneration`` of this shape in fp32, with transformers' own
    random initialisation (seeded)."""
    cfg = model_of(shape).shape_to_hf(shape)
    config_cls, model_cls = hf_classes(cfg.pop("model_type"))
    config = config_cls(**cfg)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return model_cls(config).float()
