"""Tiny random Hugging Face Qwen3.5-VL references and matching inputs, built in-process."""

from __future__ import annotations

import torch

from models.qwen35_vl.configuration import Qwen35VLShape, to_hf_config_dict
from models.qwen35_vl.mrope import padded_batch_position_ids


def build_hf_model(shape: Qwen35VLShape, seed: int = 0):
    """HF model with every weight random (norm weights too, so zero-centring is exercised)."""
    import transformers

    cfg_dict = to_hf_config_dict(shape)
    is_moe = cfg_dict["model_type"] == "qwen3_5_moe"
    config_cls = transformers.Qwen3_5MoeConfig if is_moe else transformers.Qwen3_5Config
    model_cls = transformers.Qwen3_5MoeForConditionalGeneration if is_moe else transformers.Qwen3_5ForConditionalGeneration
    config = config_cls(**{k: v for k, v in cfg_dict.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 2.0).log())
            elif "norm" in name or name.endswith("dt_bias"):
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def image_tokens(shape: Qwen35VLShape, h: int, w: int) -> list[int]:
    """Placeholder run of one image of (h, w) patches, wrapped in vision start/end tokens."""
    n = (h // shape.vision.spatial_merge_size) * (w // shape.vision.spatial_merge_size)
    return [shape.vision_start_token_id] + [shape.image_token_id] * n + [shape.vision_end_token_id]


def pixel_values_for(shape: Qwen35VLShape, grids, generator=None) -> torch.Tensor:
    v = shape.vision
    n_patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(n_patches, v.patch_dim, generator=generator)


def hf_forward(model, shape: Qwen35VLShape, input_ids, attention_mask, pixel_values=None, image_grid_thw=None):
    mm = torch.zeros_like(input_ids)
    mm[input_ids == shape.image_token_id] = 1
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, mm_token_type_ids=mm)
    if pixel_values is not None:
        kwargs.update(pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    with torch.no_grad():
        return model(**kwargs).logits


def megatron_position_ids(shape, input_ids, attention_mask, image_grid_thw):
    return padded_batch_position_ids(input_ids, attention_mask, image_grid_thw, None, shape.image_token_id,
                                     shape.video_token_id, shape.vision.spatial_merge_size)


def hf_rope_index(shape: Qwen35VLShape, input_ids, attention_mask, image_grid_thw):
    """transformers' ``get_rope_index`` for ``shape`` (the benchmark's reference, reused)."""
    from tools.bench_collate import hf_rope_index_fn

    return hf_rope_index_fn(shape)(input_ids, attention_mask, image_grid_thw)
