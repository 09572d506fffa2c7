"""Hugging Face <-> Megatron parameter names and layouts for Qwen3.5-VL (dense and MoE).

Megatron names follow Megatron-Bridge (``vision_model.*``, ``language_model.*``); this table
uses the local backend's parameter names (``named_parameters``: separate ``input_layernorm`` /
``pre_mlp_layernorm``). Its checkpoints store those norms under the Transformer Engine keys
(``...linear_qkv.layer_norm_weight`` etc.): ``specs.FUSED_NORM_KEYS``, applied by the layer's
``sharded_state_dict``, is that correspondence. A rule ties a group of Megatron tensors to a group
of HF tensors with a named transform in each direction. Layouts (TP = 1, i.e. full tensors):

  GDN in_proj      Megatron [q; k; v; z; b; a] rows  <-  HF in_proj_qkv [q; k; v], in_proj_z,
                   in_proj_b, in_proj_a
  GDN out_norm     stored zero-centred like every other RMSNorm here: Megatron = HF - 1 (HF's
                   gated norm multiplies by w, initialised to 1)
  attention qkv    Megatron rows per KV group g: [q heads of g; gate heads of g; k_g; v_g]
                   <-  HF q_proj rows per head [q_h; gate_h], k_proj, v_proj
  vision qkv       Megatron rows per head [q_h; k_h; v_h]  <-  HF qkv [Q; K; V]
  SwiGLU fc1       Megatron [gate; up]  <-  HF gate_proj, up_proj (experts: gate_up_proj[e])
  experts          Megatron one tensor per expert  <-  HF one packed [E, ...] tensor (transformers'
                   in-memory layout; hub files store one tensor per expert, which
                   ``checkpoint/hf_safetensors.py`` packs on read and ``per_expert`` unpacks on export).
                   ``per_expert=True``: one rule per expert over the hub's names instead
                   (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``), in the same order, for
                   the streaming tools, which hold one expert at a time, never a layer's experts
  MTP head         HF mtp.fc / pre_fc_norm_embedding / pre_fc_norm_hidden / norm  <->  Megatron
                   mtp.layers.0.eh_proj / enorm / hnorm / final_layernorm (eh_proj input is
                   [embedding; hidden] in both); HF mtp.layers.0.* (a full-attention decoder
                   layer) <-> mtp.layers.0.mtp_model_layer.*, with the decoder-layer rules above
Everything else is copied as is. A shape without MTP maps no ``mtp.*`` tensor, so a checkpoint
that has them is reported as not fully consumed unless ``strict=False``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .configuration import FULL, LINEAR, Qwen35VLShape

HF_LM, HF_VIS, MG_LM, MG_VIS = "model.language_model.", "model.visual.", "language_model.", "vision_model."


def _same(tensors):
    return list(tensors)


def _concat(tensors):
    return [torch.cat(list(tensors), dim=0)]


def _splitter(sizes):
    return lambda tensors: list(torch.split(tensors[0], sizes, dim=0))


def _shift(delta):
    return lambda tensors: [tensors[0] + delta]


def _stack(tensors):
    return [torch.stack(list(tensors), dim=0)]


def _unstack(tensors):
    return list(tensors[0].unbind(0))


def _gated_qkv_to_megatron(num_heads, num_groups, head_dim):
    def fn(tensors):
        q_proj, k_proj, v_proj = tensors
        hidden = q_proj.shape[-1]
        per_group = num_heads // num_groups
        qg = q_proj.view(num_groups, per_group, 2, head_dim, hidden)  # [g, head, (q|gate), d, H]
        q, gate = qg[:, :, 0].reshape(num_groups, -1, hidden), qg[:, :, 1].reshape(num_groups, -1, hidden)
        k, v = k_proj.view(num_groups, head_dim, hidden), v_proj.view(num_groups, head_dim, hidden)
        return [torch.cat([q, gate, k, v], dim=1).reshape(-1, hidden)]

    return fn


def _gated_qkv_to_hf(num_heads, num_groups, head_dim):
    def fn(tensors):
        (qkv,) = tensors
        hidden = qkv.shape[-1]
        per_group = num_heads // num_groups
        grouped = qkv.view(num_groups, -1, hidden)
        q, gate, k, v = torch.split(grouped, [per_group * head_dim, per_group * head_dim, head_dim, head_dim], dim=1)
        q = q.reshape(num_groups, per_group, 1, head_dim, hidden)
        gate = gate.reshape(num_groups, per_group, 1, head_dim, hidden)
        q_proj = torch.cat([q, gate], dim=2).reshape(-1, hidden)
        return [q_proj, k.reshape(-1, hidden), v.reshape(-1, hidden)]

    return fn


def _vision_qkv_to_megatron(num_heads):
    # works for weights [3D, H] and biases [3D]: per-head interleave of the leading dim
    return lambda t: [t[0].view(3, num_heads, -1, *t[0].shape[1:]).transpose(0, 1).reshape(t[0].shape)]


def _vision_qkv_to_hf(num_heads):
    return lambda t: [t[0].view(num_heads, 3, -1, *t[0].shape[1:]).transpose(0, 1).reshape(t[0].shape)]


@dataclass(frozen=True)
class Rule:
    megatron: tuple[str, ...]
    hf: tuple[str, ...]
    to_megatron: Callable = _same
    to_hf: Callable = _same
    # The transforms pick, reorder and join elements, never compute one: they give the same bits in
    # any dtype, so a tool may run them in the stored dtype instead of fp32 (half the memory).
    moves_only: bool = True


def _copy(mg: str, hf: str) -> Rule:
    return Rule((mg,), (hf,))


def _fuse(mg: str, hf: tuple[str, ...], sizes) -> Rule:
    return Rule((mg,), hf, _concat, _splitter(sizes))


def _decoder_layer_rules(t, layer_type: str, mg: str, hf: str, per_expert: bool = False) -> list[Rule]:
    """One decoder layer: Megatron names under ``mg``, HF names under ``hf`` (both end in '.')."""
    rules = [
        _copy(mg + "input_layernorm.weight", hf + "input_layernorm.weight"),
        _copy(mg + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"),
    ]
    if layer_type == LINEAR:
        rules += _gated_delta_net_rules(t, mg + "self_attention.", hf + "linear_attn.")
    elif layer_type == FULL:
        rules += _full_attention_rules(t, mg + "self_attention.", hf + "self_attn.")
    else:
        raise ValueError(f"{hf}: unknown layer type {layer_type!r}")
    if t.is_moe:
        rules += _moe_rules(t, mg + "mlp.", hf + "mlp.", per_expert)
    else:
        rules += _dense_mlp_rules(t, mg + "mlp.", hf + "mlp.")
    return rules


def _gated_delta_net_rules(t, a: str, la: str) -> list[Rule]:
    """A linear-attention (Gated DeltaNet) layer's attention: Megatron ``a``, HF ``la``."""
    qk, v = t.linear_num_key_heads * t.linear_key_head_dim, t.linear_num_value_heads * t.linear_value_head_dim
    nv = t.linear_num_value_heads
    return [
        _fuse(
            a + "in_proj.weight",
            (la + "in_proj_qkv.weight", la + "in_proj_z.weight", la + "in_proj_b.weight", la + "in_proj_a.weight"),
            [2 * qk + v, v, nv, nv],
        ),
        _copy(a + "conv1d.weight", la + "conv1d.weight"),
        _copy(a + "A_log", la + "A_log"),
        _copy(a + "dt_bias", la + "dt_bias"),
        Rule((a + "out_norm.weight",), (la + "norm.weight",), _shift(-1.0), _shift(1.0), moves_only=False),
        _copy(a + "out_proj.weight", la + "out_proj.weight"),
    ]


def _full_attention_rules(t, a: str, sa: str) -> list[Rule]:
    """A full-attention layer's gated attention: Megatron ``a``, HF ``sa``."""
    dims = (t.num_attention_heads, t.num_kv_heads, t.head_dim)
    return [
        Rule(
            (a + "linear_qkv.weight",),
            (sa + "q_proj.weight", sa + "k_proj.weight", sa + "v_proj.weight"),
            _gated_qkv_to_megatron(*dims),
            _gated_qkv_to_hf(*dims),
        ),
        _copy(a + "q_layernorm.weight", sa + "q_norm.weight"),
        _copy(a + "k_layernorm.weight", sa + "k_norm.weight"),
        _copy(a + "linear_proj.weight", sa + "o_proj.weight"),
    ]


def _expert_rules(t, m: str, hm: str, per_expert: bool) -> list[Rule]:
    """The routed experts: every fc1, then every fc2 (one rule each per expert with ``per_expert``,
    else one rule each over the packed tensors)."""
    experts = range(t.num_experts)
    fc1 = tuple(f"{m}experts.local_experts.{e}.linear_fc1.weight" for e in experts)
    fc2 = tuple(f"{m}experts.local_experts.{e}.linear_fc2.weight" for e in experts)
    if not per_expert:
        return [
            Rule(fc1, (hm + "experts.gate_up_proj",), _unstack, _stack),
            Rule(fc2, (hm + "experts.down_proj",), _unstack, _stack),
        ]
    ffn = t.moe_ffn_hidden_size
    hub = [f"{hm}experts.{e}." for e in experts]
    gate_up = [_fuse(fc1[e], (hub[e] + "gate_proj.weight", hub[e] + "up_proj.weight"), [ffn, ffn]) for e in experts]
    return gate_up + [_copy(fc2[e], hub[e] + "down_proj.weight") for e in experts]


def _moe_rules(t, m: str, hm: str, per_expert: bool = False) -> list[Rule]:
    """The MoE block: router, experts (one Megatron tensor each), shared expert."""
    shared = t.shared_expert_ffn_hidden_size
    return [
        _copy(m + "router.weight", hm + "gate.weight"),
        *_expert_rules(t, m, hm, per_expert),
        _fuse(
            m + "shared_experts.linear_fc1.weight",
            (hm + "shared_expert.gate_proj.weight", hm + "shared_expert.up_proj.weight"),
            [shared, shared],
        ),
        _copy(m + "shared_experts.linear_fc2.weight", hm + "shared_expert.down_proj.weight"),
        _copy(m + "shared_experts.gate_weight", hm + "shared_expert_gate.weight"),
    ]


def _dense_mlp_rules(t, m: str, hm: str) -> list[Rule]:
    ffn = t.ffn_hidden_size
    return [
        _fuse(m + "linear_fc1.weight", (hm + "gate_proj.weight", hm + "up_proj.weight"), [ffn, ffn]),
        _copy(m + "linear_fc2.weight", hm + "down_proj.weight"),
    ]


def _mtp_rules(t, per_expert: bool = False) -> list[Rule]:
    if t.mtp_num_layers > 1:
        raise ValueError(
            f"mtp_num_layers {t.mtp_num_layers}: the Hugging Face Qwen3.5 layout has one MTP "
            "layer (one mtp.fc); use --mtp-num-layers 1"
        )
    if not t.mtp_num_layers:
        return []
    mg = MG_LM + "mtp.layers.0."
    return [
        _copy(mg + "eh_proj.weight", "mtp.fc.weight"),
        _copy(mg + "enorm.weight", "mtp.pre_fc_norm_embedding.weight"),
        _copy(mg + "hnorm.weight", "mtp.pre_fc_norm_hidden.weight"),
        _copy(mg + "final_layernorm.weight", "mtp.norm.weight"),
        *_decoder_layer_rules(t, FULL, mg + "mtp_model_layer.", "mtp.layers.0.", per_expert),
    ]


def _vision_rules(shape: Qwen35VLShape) -> list[Rule]:
    v = shape.vision
    rules = [_copy(MG_VIS + f"patch_embed.proj.{p}", HF_VIS + f"patch_embed.proj.{p}") for p in ("weight", "bias")]
    rules.append(_copy(MG_VIS + "pos_embed.weight", HF_VIS + "pos_embed.weight"))
    for i in range(v.depth):
        mg, hf = f"{MG_VIS}decoder.layers.{i}.", f"{HF_VIS}blocks.{i}."
        for p in ("weight", "bias"):
            rules += [
                _copy(mg + f"input_layernorm.{p}", hf + f"norm1.{p}"),
                _copy(mg + f"pre_mlp_layernorm.{p}", hf + f"norm2.{p}"),
                Rule(
                    (mg + f"self_attention.linear_qkv.{p}",),
                    (hf + f"attn.qkv.{p}",),
                    _vision_qkv_to_megatron(v.num_heads),
                    _vision_qkv_to_hf(v.num_heads),
                ),
                _copy(mg + f"self_attention.linear_proj.{p}", hf + f"attn.proj.{p}"),
                _copy(mg + f"mlp.linear_fc1.{p}", hf + f"mlp.linear_fc1.{p}"),
                _copy(mg + f"mlp.linear_fc2.{p}", hf + f"mlp.linear_fc2.{p}"),
            ]
    for p in ("weight", "bias"):
        rules += [
            _copy(MG_VIS + f"merger.patch_norm.{p}", HF_VIS + f"merger.norm.{p}"),
            _copy(MG_VIS + f"merger.linear_fc1.{p}", HF_VIS + f"merger.linear_fc1.{p}"),
            _copy(MG_VIS + f"merger.linear_fc2.{p}", HF_VIS + f"merger.linear_fc2.{p}"),
        ]
    return rules


def mapping_rules(shape: Qwen35VLShape, per_expert: bool = False) -> list[Rule]:
    """Every rule of the model, in the order the tools read and write tensors (``per_expert``: see
    the top)."""
    t = shape.text
    rules = [
        _copy(MG_LM + "embedding.word_embeddings.weight", HF_LM + "embed_tokens.weight"),
        _copy(MG_LM + "decoder.final_layernorm.weight", HF_LM + "norm.weight"),
    ]
    if not t.tie_word_embeddings:
        rules.append(_copy(MG_LM + "output_layer.weight", "lm_head.weight"))
    for i in range(t.num_layers):
        layer = (f"{MG_LM}decoder.layers.{i}.", f"{HF_LM}layers.{i}.")
        rules += _decoder_layer_rules(t, t.layer_types[i], *layer, per_expert)
    return rules + _mtp_rules(t, per_expert) + _vision_rules(shape)


class MappingError(KeyError):
    pass


def hf_to_megatron(hf_state: dict, shape: Qwen35VLShape, strict: bool = True) -> dict:
    """Full (TP=1) Megatron state dict from HF tensors. With ``strict``, every HF tensor must be
    consumed (``mtp.*`` included, so a shape without MTP refuses a checkpoint that has it)."""
    out, consumed, missing = {}, set(), []
    for rule in mapping_rules(shape):
        absent = [n for n in rule.hf if n not in hf_state]
        if absent:
            missing += absent
            continue
        converted = rule.to_megatron([hf_state[n] for n in rule.hf])
        out.update(zip(rule.megatron, converted))
        consumed.update(rule.hf)
    if shape.text.tie_word_embeddings:
        consumed.add("lm_head.weight")  # the tied head is the embedding itself
    unconsumed = sorted(set(hf_state) - consumed)
    if missing or (strict and unconsumed):
        raise MappingError(
            f"HF -> Megatron: {len(missing)} expected HF tensors missing {missing[:20]}; "
            f"{len(unconsumed)} HF tensors not consumed {unconsumed[:20]}"
        )
    return out


def megatron_to_hf(mg_state: dict, shape: Qwen35VLShape) -> dict:
    out, missing = {}, []
    for rule in mapping_rules(shape):
        absent = [n for n in rule.megatron if n not in mg_state]
        if absent:
            missing += absent
            continue
        out.update(zip(rule.hf, rule.to_hf([mg_state[n] for n in rule.megatron])))
    if missing:
        raise MappingError(f"Megatron -> HF: {len(missing)} Megatron tensors missing {missing[:20]}")
    return out


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters of the model by name, without megatron-core's ``_extra_state`` entries."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def load_hf_into_model(
    model: torch.nn.Module, hf_state: dict[str, torch.Tensor], shape: Qwen35VLShape, strict: bool = True
) -> None:
    """Copy HF tensors into a TP=1 model, keeping each parameter's dtype; any Megatron tensor
    left unfilled or shape mismatch raises, naming the tensors."""
    converted = hf_to_megatron(hf_state, shape, strict=strict)
    target = model_state(model)
    unfilled = sorted(set(target) - set(converted))
    unknown = sorted(set(converted) - set(target))
    bad_shape = [
        f"{k}: {tuple(converted[k].shape)} vs {tuple(target[k].shape)}"
        for k in set(converted) & set(target)
        if converted[k].shape != target[k].shape
    ]
    if unfilled or unknown or bad_shape:
        raise MappingError(
            f"Megatron tensors unfilled {unfilled[:20]}; not in model {unknown[:20]}; shape mismatch {bad_shape[:20]}"
        )
    with torch.no_grad():
        for name, tensor in converted.items():
            target[name].copy_(tensor.to(target[name].dtype))
