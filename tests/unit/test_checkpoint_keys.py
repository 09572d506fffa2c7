"""Checkpoint keys of the local (CPU) backend are Transformer Engine's, so one checkpoint loads
into both backends (and Megatron-Bridge): TE fuses a layer's input norm into the mixer's first
linear (``in_proj`` / ``linear_qkv``) and a dense MLP's pre-norm into ``fc1``; the local layer
keeps separate norms and renames their keys (``specs.FUSED_NORM_KEYS``).

The names below are written out, not derived from the spec, so a changed name fails here. They
were checked against megatron-core 0.19.2's TE modules: ``TELayerNormColumnParallelLinear``
holds ``layer_norm_weight`` (and ``layer_norm_bias`` for the ViT's LayerNorm); MoE layers keep
``pre_mlp_layernorm`` on TE too (the router needs the normed input); ``TEDotProductAttention``
adds no tensors. Quirks of megatron-core that hold on both backends: alike ViT blocks are stacked
into one key per tensor (the layer index becomes a leading axis), and the MTP layer's
``mtp_model_layer`` module is saved as ``transformer_layer``."""

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject

from examples.multimodal_dev.models.qwen35_vl.configuration import FULL, LINEAR, get_variant
from examples.multimodal_dev.models.qwen35_vl.factory import build_model

VISION = [
    "vision_model.patch_embed.proj.weight",
    "vision_model.patch_embed.proj.bias",
    "vision_model.pos_embed.weight",
    "vision_model.decoder.layers.self_attention.linear_qkv.layer_norm_weight",
    "vision_model.decoder.layers.self_attention.linear_qkv.layer_norm_bias",
    "vision_model.decoder.layers.self_attention.linear_qkv.weight",
    "vision_model.decoder.layers.self_attention.linear_qkv.bias",
    "vision_model.decoder.layers.self_attention.linear_proj.weight",
    "vision_model.decoder.layers.self_attention.linear_proj.bias",
    "vision_model.decoder.layers.mlp.linear_fc1.layer_norm_weight",
    "vision_model.decoder.layers.mlp.linear_fc1.layer_norm_bias",
    "vision_model.decoder.layers.mlp.linear_fc1.weight",
    "vision_model.decoder.layers.mlp.linear_fc1.bias",
    "vision_model.decoder.layers.mlp.linear_fc2.weight",
    "vision_model.decoder.layers.mlp.linear_fc2.bias",
    "vision_model.merger.patch_norm.weight",
    "vision_model.merger.patch_norm.bias",
    "vision_model.merger.linear_fc1.weight",
    "vision_model.merger.linear_fc1.bias",
    "vision_model.merger.linear_fc2.weight",
    "vision_model.merger.linear_fc2.bias",
]
TEXT = [
    "language_model.embedding.word_embeddings.weight",
    "language_model.decoder.final_layernorm.weight",
    "language_model.output_layer.weight",
    "language_model.mtp.layers.0.enorm.weight",
    "language_model.mtp.layers.0.hnorm.weight",
    "language_model.mtp.layers.0.eh_proj.weight",
    "language_model.mtp.layers.0.final_layernorm.weight",
]
# Per decoder layer, after "language_model.decoder.layers.<i>." (MTP: "...mtp.layers.0.transformer_layer.")
GDN = [
    "self_attention.in_proj.layer_norm_weight",
    "self_attention.in_proj.weight",
    "self_attention.conv1d.weight",
    "self_attention.A_log",
    "self_attention.dt_bias",
    "self_attention.out_norm.weight",
    "self_attention.out_proj.weight",
]
ATTENTION = [
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.weight",
    "self_attention.q_layernorm.weight",
    "self_attention.k_layernorm.weight",
    "self_attention.linear_proj.weight",
]
DENSE_MLP = [
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
]
MOE_MLP = [
    "pre_mlp_layernorm.weight",
    "mlp.router.weight",
    "mlp.experts.experts.linear_fc1.weight",  # one key for all experts (expert index is an axis)
    "mlp.experts.experts.linear_fc2.weight",
    "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_experts.gate_weight",
]
TINY_LAYERS = [GDN, GDN, GDN, ATTENTION]  # tiny's layer_types: three Gated DeltaNet, one full attention


def expected_keys(moe: bool) -> set[str]:
    mlp = MOE_MLP if moe else DENSE_MLP
    keys = set(VISION) | set(TEXT)
    for i, mixer in enumerate(TINY_LAYERS):
        keys |= {f"language_model.decoder.layers.{i}.{name}" for name in mixer + mlp}
    keys |= {f"language_model.mtp.layers.0.transformer_layer.{name}" for name in ATTENTION + mlp}
    return keys


def tensor_keys(model) -> set[str]:
    """Checkpoint keys of the tensors (factories included: they split a key the same way on both
    backends); ``_extra_state`` objects are per-module metadata, not weights."""
    return {v.key for v in model.sharded_state_dict().values() if not isinstance(v, ShardedObject)}


@pytest.fixture(scope="module", params=["dense", "moe"])
def tiny(request, mcore):
    shape = get_variant("tiny", moe=request.param == "moe", mtp=True)
    assert tuple(shape.text.layer_types) == (LINEAR, LINEAR, LINEAR, FULL)
    return request.param, shape


def test_local_checkpoint_keys_are_transformer_engine_names(tiny):
    kind, shape = tiny
    model = build_model(shape, backend="local")
    keys, expected = tensor_keys(model), expected_keys(kind == "moe")
    assert keys == expected, f"unexpected {sorted(keys - expected)}; missing {sorted(expected - keys)}"
    assert not [k for k in keys if "input_layernorm" in k]
    # Only checkpoint keys are renamed: parameter names (what hf_mapping reads) keep the local modules.
    assert "language_model.decoder.layers.0.input_layernorm.weight" in dict(model.named_parameters())
    print(f"{kind}: {len(keys)} checkpoint tensor keys, all in Transformer Engine naming")


def test_dist_checkpoint_round_trip_through_renamed_keys(tiny, tmp_path):
    """Save under the TE keys and load into a model with other weights: every parameter comes
    back, the renamed norms included (random values, so a norm left at its init would show)."""
    kind, shape = tiny
    torch.manual_seed(1)
    source = build_model(shape, backend="local")
    with torch.no_grad():
        for p in source.parameters():
            p.normal_()
    dist_checkpointing.save(source.sharded_state_dict(), str(tmp_path))
    stored = set(dist_checkpointing.load_tensors_metadata(str(tmp_path)))
    assert "language_model.decoder.layers.0.self_attention.in_proj.layer_norm_weight" in stored
    assert not [k for k in stored if "input_layernorm" in k]

    torch.manual_seed(2)
    target = build_model(shape, backend="local")
    before, after = dict(source.named_parameters()), dict(target.named_parameters())
    assert not torch.equal(
        before["vision_model.decoder.layers.1.input_layernorm.bias"],
        after["vision_model.decoder.layers.1.input_layernorm.bias"],
    )
    target.load_state_dict(dist_checkpointing.load(target.sharded_state_dict(), str(tmp_path)))
    differing = [n for n, p in target.named_parameters() if not torch.equal(p, before[n])]
    assert not differing, differing
    print(f"{kind}: {len(before)} parameters equal after save/load through {len(stored)} stored keys")
