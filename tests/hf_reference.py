"""Tiny random Hugging Face Qwen3.5-VL references and matching inputs, built in-process."""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from examples.multimodal_dev.checkpoint.hf_models import hf_model_for_shape
from examples.multimodal_dev.models.qwen35_vl.configuration import Qwen35VLShape
from examples.multimodal_dev.models.qwen35_vl.mrope import padded_batch_position_ids, sample_position_ids


def build_hf_model(shape: Qwen35VLShape, seed: int = 0):
    """HF model with every weight random (norm weights too, so zero-centring is exercised)."""
    model = hf_model_for_shape(shape, seed=seed).eval()
    _randomize(model)
    return model


def _randomize(module) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 2.0).log())
            elif "norm" in name or name.endswith("dt_bias"):
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))


class HFMtpHead(torch.nn.Module):
    """Qwen3.5's MTP head under the names released checkpoints use (``mtp.*``), made of the
    reference's own decoder-layer and norm classes. ``transformers`` skips these weights when it
    loads a checkpoint, so this module is the reference the Megatron MTP head is checked against:

        h'_i = norm(layer(fc([norm_e(embed(token_{i+1})); norm_h(h_i)])))  -> lm_head -> token_{i+2}
    """

    def __init__(self, hf_model, seed: int = 1):
        super().__init__()
        text = hf_model.config.text_config
        lm = hf_model.model.language_model
        full = list(text.layer_types).index("full_attention")
        layer_cls, norm_cls = type(lm.layers[full]), type(lm.norm)
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(2 * text.hidden_size, text.hidden_size, bias=False)
        self.pre_fc_norm_embedding = norm_cls(text.hidden_size, eps=text.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(text.hidden_size, eps=text.rms_norm_eps)
        self.layers = torch.nn.ModuleList([layer_cls(text, full)])
        self.norm = norm_cls(text.hidden_size, eps=text.rms_norm_eps)
        self.float().eval()
        _randomize(self)

    def checkpoint_state(self) -> dict:
        return {f"mtp.{k}": v for k, v in self.state_dict().items()}

    @torch.no_grad()
    def logits(self, hf_model, shape, input_ids, pixel_values=None, image_grid_thw=None):
        """MTP logits [1, S, V] of one unpadded sample; the token after the last is id 0, as
        megatron-core's roll leaves it."""
        mask = torch.ones_like(input_ids)
        mm = (input_ids == shape.image_token_id).long()
        hidden = hf_model.model(
            input_ids=input_ids,
            attention_mask=mask,
            mm_token_type_ids=mm,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
        ).last_hidden_state
        lm = hf_model.model.language_model
        next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
        x = torch.cat([self.pre_fc_norm_embedding(lm.embed_tokens(next_ids)), self.pre_fc_norm_hidden(hidden)], -1)
        x = self.fc(x)
        position_ids = megatron_position_ids(shape, input_ids, mask, image_grid_thw)
        x = self.layers[0](x, position_embeddings=lm.rotary_emb(x, position_ids), attention_mask=None)
        return hf_model.lm_head(self.norm(x))


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
    return padded_batch_position_ids(
        input_ids,
        attention_mask,
        image_grid_thw,
        None,
        shape.image_token_id,
        shape.video_token_id,
        shape.vision.spatial_merge_size,
    )


def hf_rope_index(shape: Qwen35VLShape, input_ids, attention_mask, image_grid_thw):
    """transformers' ``get_rope_index`` for ``shape`` (the benchmark's reference, reused)."""
    from examples.multimodal_dev.benchmarks.bench_collate import hf_rope_index_fn

    return hf_rope_index_fn(shape)(input_ids, attention_mask, image_grid_thw)


def packed_row(shape: Qwen35VLShape, samples, multiple: int = 4):
    """One THD row of ``samples`` [(token list, grids)], each padded to ``multiple`` as the collate
    does. Returns (tokens [1, T], position_ids [3, 1, T], PackedSeqParams, real-token mask [T])."""
    vision_ids = (shape.image_token_id, shape.video_token_id)
    tokens, positions, real, cu, cu_padded = [], [], [], [0], [0]
    for row, grids in samples:
        ids = torch.tensor(row)
        pos = sample_position_ids(
            ids, torch.tensor(grids, dtype=torch.long).reshape(-1, 3), vision_ids, shape.vision.spatial_merge_size
        )
        pad = (-len(row)) % multiple
        tokens.append(torch.cat([ids, torch.zeros(pad, dtype=torch.long)]))
        positions.append(torch.cat([pos, torch.zeros(3, pad, dtype=torch.long)], dim=1))
        real.append(torch.cat([torch.ones(len(row)), torch.zeros(pad)]).bool())
        cu.append(cu[-1] + len(row))
        cu_padded.append(cu_padded[-1] + len(row) + pad)
    cu_t, cu_padded_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(cu_padded, dtype=torch.int32)
    longest = int((cu_padded_t[1:] - cu_padded_t[:-1]).max())
    packed = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_t,
        cu_seqlens_kv=cu_t,
        cu_seqlens_q_padded=cu_padded_t,
        cu_seqlens_kv_padded=cu_padded_t,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    return torch.cat(tokens)[None], torch.cat(positions, dim=1)[:, None], packed, torch.cat(real)
