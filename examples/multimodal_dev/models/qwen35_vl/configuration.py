"""Qwen3.5-VL model shapes: named variants, Hugging Face ``config.json`` import, and the
megatron-core ``TransformerConfig`` each tower is built from.

The variant table carries the released Hugging Face dimensions; ``from_hf_config`` reads any
``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` config (dense or
MoE, ``layer_types`` or ``full_attention_interval``), which is the authoritative source when a
checkpoint is at hand.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

from ..setting_names import ON_THE_BASE_MODES
from .parallel import validate_parallel

if TYPE_CHECKING:
    from argparse import Namespace

    from megatron.core.transformer.transformer_config import TransformerConfig

    from ..entry import HFConfig

# torch is imported where a config is built, not here: the run script reads this module's variant
# table (launcher/from_env.py) on every launch and dry run, and importing torch costs ~2 s.

LINEAR, FULL = "linear_attention", "full_attention"
# Released Qwen3.5 checkpoints store the GDN decay parameters in fp32 whatever the rest is in; any
# other tensor in a dtype of its own is a conversion accident upstream.
FP32_HF_SUFFIXES = ("A_log", "dt_bias")


@dataclass(frozen=True)
class VisionShape:
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    out_hidden_size: int = 4096  # = text hidden size
    rope_theta: float = 10000.0

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch row of ``pixel_values`` (C * t * p * p)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class TextShape:
    hidden_size: int = 4096
    num_layers: int = 32
    num_attention_heads: int = 16
    num_kv_heads: int = 4
    head_dim: int = 256
    ffn_hidden_size: int = 12288  # dense MLP; unused when num_experts is set
    vocab_size: int = 248320
    layer_types: tuple[str, ...] = ()
    # Gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # Rotary (interleaved MRoPE over the first partial_rotary_factor * head_dim channels)
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    # MoE (None = dense)
    num_experts: int | None = None
    moe_top_k: int = 8
    moe_ffn_hidden_size: int = 512
    shared_expert_ffn_hidden_size: int = 512
    router_aux_loss_coef: float = 1e-3
    mtp_num_layers: int = 0

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", hybrid_pattern(self.num_layers, 4))
        if self.is_moe:  # no dense MLP anywhere: keep one canonical value so shapes compare equal
            object.__setattr__(self, "ffn_hidden_size", 0)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None


@dataclass(frozen=True)
class Qwen35VLShape:
    arch: ClassVar[str] = "qwen35_vl"  # its MODEL_REGISTRY key (models.model_of)
    text: TextShape = field(default_factory=TextShape)
    vision: VisionShape = field(default_factory=VisionShape)
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054


def hybrid_pattern(num_layers: int, full_attention_interval: int) -> tuple[str, ...]:
    """Every ``full_attention_interval``-th layer is full attention, the rest Gated DeltaNet."""
    return tuple(FULL if (i + 1) % full_attention_interval == 0 else LINEAR for i in range(num_layers))


_SMALL_VISION = VisionShape(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12)


def _variant(text: TextShape, vision: VisionShape = VisionShape()) -> Qwen35VLShape:
    return Qwen35VLShape(text=text, vision=replace(vision, out_hidden_size=text.hidden_size))


def _dense(hidden, layers, heads, kv, ffn, v_heads, tie=False, k_heads=16):
    return TextShape(
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=ffn,
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        tie_word_embeddings=tie,
        mtp_num_layers=1,
    )


def _moe(hidden, layers, heads, kv, v_heads, experts, top_k, expert_ffn):
    return TextShape(
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv,
        linear_num_value_heads=v_heads,
        num_experts=experts,
        moe_top_k=top_k,
        moe_ffn_hidden_size=expert_ffn,
        shared_expert_ffn_hidden_size=expert_ffn,
        mtp_num_layers=1,
    )


# Released checkpoints (Qwen/Qwen3.5-*). Dimensions follow their config.json files.
VARIANTS: dict[str, Qwen35VLShape] = {
    "0.8b": _variant(_dense(1024, 24, 8, 2, 3584, 16, tie=True), _SMALL_VISION),
    "2b": _variant(_dense(2048, 24, 8, 2, 6144, 16, tie=True), _SMALL_VISION),
    "4b": _variant(_dense(2560, 32, 16, 4, 9216, 32, tie=True)),
    "9b": _variant(_dense(4096, 32, 16, 4, 12288, 32)),
    "27b": _variant(_dense(5120, 64, 24, 4, 17408, 48)),
    "35b_a3b": _variant(_moe(2048, 40, 16, 2, 32, 256, 8, 512)),
    "122b_a10b": _variant(_moe(3072, 48, 32, 2, 64, 256, 8, 1024)),
    "397b_a17b": _variant(_moe(4096, 60, 32, 2, 64, 512, 10, 1024)),
    # 4 layers (3 GDN + 1 attention) of the 397B shape with few experts: GPU smoke runs.
    "proxy": _variant(_moe(4096, 4, 32, 2, 64, 8, 2, 1024)),
    # A few million parameters, every structural feature present; trains on CPU.
    "tiny": Qwen35VLShape(
        text=TextShape(
            hidden_size=128,
            num_layers=4,
            num_attention_heads=4,
            num_kv_heads=2,
            head_dim=32,
            # 4 key / 8 value GDN heads so TP x CP up to 4 splits them whole
            ffn_hidden_size=256,
            vocab_size=8192,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            mrope_section=(2, 1, 1),
            partial_rotary_factor=0.25,
        ),
        vision=VisionShape(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=2, num_position_embeddings=64, out_hidden_size=128
        ),
        image_token_id=8000,
        video_token_id=8001,
        vision_start_token_id=8002,
        vision_end_token_id=8003,
    ),
}


def get_variant(name: str, moe: bool | None = None, mtp: bool | None = None) -> Qwen35VLShape:
    """A named variant; ``moe``/``mtp`` switch those parts on or off (used for ``tiny``)."""
    if name not in VARIANTS:
        raise KeyError(f"unknown --model-variant {name!r}; valid: {', '.join(VARIANTS)}")
    shape = VARIANTS[name]
    text = shape.text
    if moe is True and not text.is_moe:
        text = replace(
            text,
            num_experts=4,
            moe_top_k=2,
            moe_ffn_hidden_size=text.ffn_hidden_size // 2,
            shared_expert_ffn_hidden_size=text.ffn_hidden_size // 2,
        )
    elif moe is False:
        text = replace(text, num_experts=None)
    if mtp is not None:
        text = replace(text, mtp_num_layers=1 if mtp else 0)
    return replace(shape, text=text)


def from_hf_config(config: HFConfig) -> Qwen35VLShape:
    """Shape from a ``transformers`` config object, a dict, or a directory / config.json path."""
    cfg = _hf_config_dict(config)
    model_type = cfg.get("model_type")
    if model_type not in ("qwen3_5", "qwen3_5_moe"):
        raise ValueError(f"config model_type is {model_type!r}; expected 'qwen3_5' or 'qwen3_5_moe'")
    t, v = cfg["text_config"], cfg["vision_config"]
    return Qwen35VLShape(
        text=_text_shape_from_hf(t, cfg, model_type),
        vision=_vision_shape_from_hf(v),
        image_token_id=cfg["image_token_id"],
        video_token_id=cfg["video_token_id"],
        vision_start_token_id=cfg["vision_start_token_id"],
        vision_end_token_id=cfg["vision_end_token_id"],
    )


def _hf_config_dict(config: HFConfig) -> dict[str, Any]:
    """The config as a dict, read from its config.json when given a directory or a file path."""
    if isinstance(config, (str, os.PathLike)):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        if not os.path.exists(path):
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path) as f:
            config = json.load(f)
    return config if isinstance(config, dict) else config.to_dict()


def _text_shape_from_hf(t: dict, cfg: dict, model_type: str) -> TextShape:
    """The language model's shape from the HF ``text_config`` ``t`` (tied embeddings: the top level's first)."""
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    num_layers = t["num_hidden_layers"]
    layer_types = tuple(t.get("layer_types") or hybrid_pattern(num_layers, t.get("full_attention_interval", 4)))
    moe = _moe_fields_from_hf(t, model_type)
    return TextShape(
        hidden_size=t["hidden_size"],
        num_layers=num_layers,
        num_attention_heads=t["num_attention_heads"],
        num_kv_heads=t["num_key_value_heads"],
        head_dim=t.get("head_dim", 256),
        ffn_hidden_size=t.get("intermediate_size") or 0,
        vocab_size=t["vocab_size"],
        layer_types=layer_types,
        linear_num_key_heads=t["linear_num_key_heads"],
        linear_num_value_heads=t["linear_num_value_heads"],
        linear_key_head_dim=t["linear_key_head_dim"],
        linear_value_head_dim=t["linear_value_head_dim"],
        linear_conv_kernel_dim=t.get("linear_conv_kernel_dim", 4),
        rope_theta=rope.get("rope_theta", 1e7),
        partial_rotary_factor=rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25)),
        mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
        rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
        mtp_num_layers=t.get("mtp_num_hidden_layers", 0),
        **moe,
    )


def _moe_fields_from_hf(t: dict, model_type: str) -> dict:
    """``TextShape``'s MoE fields from the HF ``text_config``; none for a dense model."""
    if model_type == "qwen3_5_moe" or t.get("num_experts"):
        return dict(
            num_experts=t["num_experts"],
            moe_top_k=t["num_experts_per_tok"],
            moe_ffn_hidden_size=t["moe_intermediate_size"],
            shared_expert_ffn_hidden_size=t["shared_expert_intermediate_size"],
            router_aux_loss_coef=t.get("router_aux_loss_coef", 1e-3),
        )
    return {}


def _vision_shape_from_hf(v: dict) -> VisionShape:
    return VisionShape(
        depth=v["depth"],
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_heads=v["num_heads"],
        in_channels=v.get("in_channels", 3),
        patch_size=v["patch_size"],
        temporal_patch_size=v["temporal_patch_size"],
        spatial_merge_size=v["spatial_merge_size"],
        num_position_embeddings=v["num_position_embeddings"],
        out_hidden_size=v["out_hidden_size"],
    )


def to_hf_config_dict(shape: Qwen35VLShape) -> dict:
    """The inverse of ``from_hf_config``: a dict ``transformers`` builds the reference from."""
    t, v = shape.text, shape.vision
    text, vision = _hf_text_config(t), _hf_vision_config(v)
    return dict(
        model_type="qwen3_5_moe" if t.is_moe else "qwen3_5",
        text_config=text,
        vision_config=vision,
        image_token_id=shape.image_token_id,
        video_token_id=shape.video_token_id,
        vision_start_token_id=shape.vision_start_token_id,
        vision_end_token_id=shape.vision_end_token_id,
        tie_word_embeddings=t.tie_word_embeddings,
    )


def _hf_text_config(t: TextShape) -> dict:
    """The HF ``text_config`` dict: MoE sizes for an MoE model, ``intermediate_size`` for a dense one."""
    text: dict[str, Any] = dict(
        hidden_size=t.hidden_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        vocab_size=t.vocab_size,
        layer_types=list(t.layer_types),
        linear_num_key_heads=t.linear_num_key_heads,
        linear_num_value_heads=t.linear_num_value_heads,
        linear_key_head_dim=t.linear_key_head_dim,
        linear_value_head_dim=t.linear_value_head_dim,
        linear_conv_kernel_dim=t.linear_conv_kernel_dim,
        rms_norm_eps=t.rms_norm_eps,
        hidden_act="silu",
        tie_word_embeddings=t.tie_word_embeddings,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=t.rope_theta,
            partial_rotary_factor=t.partial_rotary_factor,
            mrope_section=list(t.mrope_section),
            mrope_interleaved=True,
        ),
        mtp_num_hidden_layers=t.mtp_num_layers,
    )
    if t.is_moe:
        text.update(
            num_experts=t.num_experts,
            num_experts_per_tok=t.moe_top_k,
            moe_intermediate_size=t.moe_ffn_hidden_size,
            shared_expert_intermediate_size=t.shared_expert_ffn_hidden_size,
            router_aux_loss_coef=t.router_aux_loss_coef,
        )
    else:
        text["intermediate_size"] = t.ffn_hidden_size
    return text


def _hf_vision_config(v: VisionShape) -> dict:
    return dict(
        depth=v.depth,
        hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size,
        num_heads=v.num_heads,
        in_channels=v.in_channels,
        patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size,
        spatial_merge_size=v.spatial_merge_size,
        num_position_embeddings=v.num_position_embeddings,
        out_hidden_size=v.out_hidden_size,
        hidden_act="gelu_pytorch_tanh",
    )


def _gelu_tanh(x):
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh")


def language_architecture(text: TextShape) -> dict:
    """The decoder's ``TransformerConfig`` fields that the Qwen3.5 architecture fixes. A megatron
    flag may not contradict them (``models/common/config_from_args.py`` refuses it)."""
    import torch.nn.functional as F

    arch: dict[str, Any] = dict(
        num_layers=text.num_layers,
        hidden_size=text.hidden_size,
        num_attention_heads=text.num_attention_heads,
        num_query_groups=text.num_kv_heads,
        kv_channels=text.head_dim,
        ffn_hidden_size=text.ffn_hidden_size or text.moe_ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_zero_centered_gamma=True,
        layernorm_epsilon=text.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        attention_output_gate=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[1 if lt == LINEAR else 0 for lt in text.layer_types],
        linear_conv_kernel_dim=text.linear_conv_kernel_dim,
        linear_key_head_dim=text.linear_key_head_dim,
        linear_value_head_dim=text.linear_value_head_dim,
        linear_num_key_heads=text.linear_num_key_heads,
        linear_num_value_heads=text.linear_num_value_heads,
        mrope_section=list(text.mrope_section),
        mtp_num_layers=text.mtp_num_layers or None,
        num_moe_experts=text.num_experts,
    )
    if text.is_moe:
        arch.update(
            moe_router_topk=text.moe_top_k,
            moe_ffn_hidden_size=text.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=text.shared_expert_ffn_hidden_size,
            moe_shared_expert_gate=True,
            moe_router_pre_softmax=False,  # softmax over the top-k
            moe_router_score_function="softmax",
        )
    return arch


def language_recipe(text: TextShape) -> dict:
    """Training settings the released models use, taken unless a megatron flag says otherwise."""
    recipe: dict[str, Any] = dict(hidden_dropout=0.0, attention_dropout=0.0)
    if text.is_moe:
        recipe.update(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=text.router_aux_loss_coef)
    return recipe


def vision_architecture(vision: VisionShape) -> dict:
    """The vision tower's ``TransformerConfig`` fields. It sees whole images on every rank: no
    context, sequence or expert parallelism (its TP linears take the full patch sequence,
    replicated over TP ranks), no experts, no Gated DeltaNet, no MTP."""
    return dict(
        num_layers=vision.depth,
        hidden_size=vision.hidden_size,
        num_attention_heads=vision.num_heads,
        num_query_groups=vision.num_heads,
        kv_channels=vision.hidden_size // vision.num_heads,
        ffn_hidden_size=vision.intermediate_size,
        normalization="LayerNorm",
        layernorm_epsilon=1e-6,
        layernorm_zero_centered_gamma=False,
        gated_linear_unit=False,
        activation_func=_gelu_tanh,
        add_bias_linear=True,
        add_qkv_bias=True,
        qk_layernorm=False,
        attention_output_gate=False,
        experimental_attention_variant=None,
        linear_attention_freq=None,
        mrope_section=None,
        mtp_num_layers=None,
        num_moe_experts=None,
        moe_ffn_hidden_size=None,
        moe_router_topk=2,
        moe_shared_expert_intermediate_size=None,
        moe_shared_expert_gate=False,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        sequence_parallel=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,  # megatron-core fuses bias+GELU (erf) and SwiGLU, not tanh-GELU
    )


# Settings of a model built outside megatron.training (tests, conversion, benchmarks): fp32-exact
# torch paths, no fused kernels that need Transformer Engine or Apex.
STANDALONE_SETTINGS: dict[str, Any] = dict(
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    gradient_accumulation_fusion=False,
    moe_token_dispatcher_type="allgather",
    moe_grouped_gemm=False,
)


def _standalone_config(fields: dict, params_dtype, settings: dict):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    params_dtype = params_dtype or torch.float32
    dtypes: dict[str, Any] = dict(
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16, pipeline_dtype=params_dtype
    )
    return TransformerConfig(**{**STANDALONE_SETTINGS, **dtypes, **settings, **fields})


def language_transformer_config(text: TextShape, params_dtype=None, **settings):
    """TransformerConfig of the decoder built outside megatron.training (``params_dtype``: fp32 when
    None). ``settings``: TP/CP/EP/SP
    sizes and other non-architecture fields (per-token loss, MTP loss scale, dispatcher)."""
    return _standalone_config({**language_recipe(text), **language_architecture(text)}, params_dtype, settings)


def vision_transformer_config(vision: VisionShape, params_dtype=None, **settings):
    """The vision tower's TransformerConfig built outside megatron.training: the decoder's ``settings``
    as a training run gives them to the tower (recompute and TP included, no pipeline split)."""
    from ..common.config_from_args import vision_settings

    return _standalone_config(vision_architecture(vision), params_dtype, vision_settings(settings))


def configs_from_args(
    args: Namespace, shape: Qwen35VLShape, backend: str, given: dict[str, str]
) -> tuple[TransformerConfig, TransformerConfig]:
    """(decoder, vision) TransformerConfigs for a megatron.training run: megatron's args with
    this shape laid over them (``given``: the flags typed on the command line)."""
    from ..common.config_from_args import transformer_configs

    vision_tp = getattr(args, "vision_tensor_parallel_size", None)
    validate_parallel(
        shape, args.tensor_model_parallel_size, args.context_parallel_size, args.expert_model_parallel_size, vision_tp
    )
    source = f"--hf-config-path {args.hf_config_path}" if args.hf_config_path else f"variant {args.model_variant!r}"
    vision = vision_architecture(shape.vision)
    if vision_tp:
        vision["tensor_model_parallel_size"] = vision_tp
    recipe = language_recipe(shape.text)
    if getattr(args, "train_mode", "sft") in ON_THE_BASE_MODES:  # args' own value: dpo.py without_router_loss
        recipe.pop("moe_aux_loss_coeff", None)
    return transformer_configs(args, language_architecture(shape.text), recipe, vision, source, backend, given)
