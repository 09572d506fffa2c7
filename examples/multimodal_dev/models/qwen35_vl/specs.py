"""Module specs of the Qwen3.5-VL towers, for both backends, chosen in one place.

``backend="te"``: Transformer Engine linears with fused input norms, TE attention, TE norms
(zero-centred gamma supported natively). ``backend="local"``: megatron-core's tensor-parallel
linears, the torch SDPA core attention of ``models/common/sdpa_attention.py`` and the project's
``TorchNorm`` (zero-centred, sequence-parallel aware); the CPU path, and GPUs without TE.

Decoder layer i is a Gated DeltaNet layer or a gated full-attention layer according to
``layer_types[i]``; each has a dense SwiGLU MLP or an MoE with a gated shared expert.
The optional MTP head is megatron-core's MultiTokenPredictionLayer around one gated
full-attention layer of the same kind (Qwen3.5's ``mtp.layers.0`` is a full-attention layer).
"""

from __future__ import annotations

from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from ..common.gated_delta_net_fp32_decay import GatedDeltaNetFp32Decay
from ..common.grouped_experts import GroupedExperts
from ..common.norms import HeadSharedNorm, TorchNorm
from ..common.sized_dispatch import LocalExpertsMoELayer
from .configuration import FULL, LINEAR

BACKENDS = ("local", "te")

# Checkpoint keys of the local backend's separate norms, as Transformer Engine names them where it
# fuses the norm into the next linear (``layer_norm_weight`` / ``layer_norm_bias``). The local
# TransformerLayer renames these key prefixes in its sharded_state_dict (module and parameter
# names stay as they are), so one checkpoint loads into both backends and Megatron-Bridge.
FUSED_NORM_KEYS = {
    "input_layernorm.": {LINEAR: "self_attention.in_proj.layer_norm_", FULL: "self_attention.linear_qkv.layer_norm_"},
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",  # dense MLPs only: MoE keeps its own norm
}


class _LocalProvider(LocalSpecProvider):
    """megatron-core's local modules, with ``--moe-grouped-gemm`` taking effect: its own local provider
    builds ``SequentialMLP`` whatever the flag says (``models/common/grouped_experts.py``)."""

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        return GroupedExperts if moe_use_grouped_gemm else super().grouped_mlp_modules(False)


class _Modules:
    """The building blocks of one backend."""

    def __init__(self, backend: str):
        if backend not in BACKENDS:
            raise ValueError(f"unknown --transformer-impl backend {backend!r}; valid: {', '.join(BACKENDS)}")
        self.fused_norm = backend == "te"
        if backend == "te":
            from megatron.core.extensions.transformer_engine import (
                TEColumnParallelLinear,
                TEDotProductAttention,
                TELayerNormColumnParallelLinear,
                TENorm,
                TERowParallelLinear,
            )
            from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

            self.provider = TESpecProvider()
            self.norm, self.attention = TENorm, TEDotProductAttention
            self.column, self.row = TEColumnParallelLinear, TERowParallelLinear
            self.norm_column = TELayerNormColumnParallelLinear
        else:
            from ..common.sdpa_attention import SDPACoreAttention

            self.provider = _LocalProvider()
            self.norm, self.attention = TorchNorm, SDPACoreAttention
            self.column, self.row = ColumnParallelLinear, RowParallelLinear
            self.norm_column = ColumnParallelLinear

    def input_norm_and_linear(self):
        """(input_layernorm, first linear): fused into one TE module, separate locally."""
        if self.fused_norm:
            return IdentityOp, self.norm_column
        return self.norm, self.column

    def norm_keys_map(self, mixer_type: str, dense_mlp: bool) -> dict:
        """``sharded_state_dict_keys_map`` giving the separate local norms their TE keys
        (empty on TE, whose fused modules already carry those names)."""
        if self.fused_norm:
            return {}
        keys = {"input_layernorm.": FUSED_NORM_KEYS["input_layernorm."][mixer_type]}
        if dense_mlp:
            keys["pre_mlp_layernorm."] = FUSED_NORM_KEYS["pre_mlp_layernorm."]
        return keys


def _mixer_spec(m: _Modules, layer_type: str):
    input_norm, first_linear = m.input_norm_and_linear()
    if layer_type == LINEAR:
        mixer = ModuleSpec(
            module=GatedDeltaNetFp32Decay,  # A_log / dt_bias in fp32, as the released checkpoints
            # out_norm: the project's head-shared norm on both backends (TP-correct weight grads)
            submodules=GatedDeltaNetSubmodules(in_proj=first_linear, out_norm=HeadSharedNorm, out_proj=m.row),
        )
    elif layer_type == FULL:
        mixer = ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=first_linear,
                core_attention=m.attention,
                linear_proj=m.row,
                q_layernorm=m.norm,
                k_layernorm=m.norm,
            ),
        )
    else:
        raise ValueError(f"unknown layer type {layer_type!r}; expected {LINEAR!r} or {FULL!r}")
    return input_norm, mixer


def _decoder_layer_spec(m: _Modules, layer_type: str, config) -> ModuleSpec:
    is_moe = config.num_moe_experts is not None
    mlp = get_mlp_module_spec_for_backend(
        backend=m.provider, num_experts=config.num_moe_experts, moe_grouped_gemm=bool(config.moe_grouped_gemm)
    )
    if is_moe:  # megatron-core's MoELayer (a partial), dispatching without host syncs where it can
        mlp = partial(LocalExpertsMoELayer, *mlp.args, **mlp.keywords)
    # TE fuses the pre-MLP norm into a dense fc1; the MoE router needs the normed input itself.
    pre_mlp_norm = IdentityOp if (m.fused_norm and not is_moe) else m.norm
    input_norm, mixer = _mixer_spec(m, layer_type)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=input_norm,
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=pre_mlp_norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=m.norm_keys_map(layer_type, dense_mlp=not is_moe),
        ),
    )


def stage_layer_types(config, layer_types, vp_stage=None) -> list:
    """The layer types of the decoder layers this pipeline stage builds, in order: megatron-core's
    split (even, ``--decoder-first/last-pipeline-num-layers``, virtual stages) applied to the global
    pattern, so a layer keeps its Gated DeltaNet / full-attention type wherever it lands."""
    if config.pipeline_model_parallel_size == 1:
        return list(layer_types)
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage)
    return list(layer_types[offset : offset + get_num_layers_to_build(config, vp_stage)])


def decoder_block_spec(config, layer_types, backend: str, vp_stage=None) -> TransformerBlockSubmodules:
    """This stage's decoder layers (megatron's TransformerBlock builds a layer-spec list as given)."""
    m = _Modules(backend)
    return TransformerBlockSubmodules(
        layer_specs=[_decoder_layer_spec(m, lt, config) for lt in stage_layer_types(config, layer_types, vp_stage)],
        layer_norm=m.norm,
    )


def mtp_block_spec(config, backend: str) -> MultiTokenPredictionBlockSubmodules | None:
    """``config.mtp_num_layers`` MTP layers (None when the model has no MTP head): norms of the
    token embedding and of the decoder output, their concatenation projected back to hidden
    size (``eh_proj``), one gated full-attention layer, a final norm; the output layer is shared."""
    if not config.mtp_num_layers:
        return None
    m = _Modules(backend)
    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=m.norm,
            hnorm=m.norm,
            layer_norm=m.norm,
            eh_proj=m.column,
            mtp_model_layer=_decoder_layer_spec(m, FULL, config),
        ),
    )
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * config.mtp_num_layers)


def vision_block_spec(config, backend: str) -> TransformerBlockSubmodules:
    """ViT blocks: bidirectional attention within each image frame (THD segments)."""
    m = _Modules(backend)
    input_norm, first_linear = m.input_norm_and_linear()
    mlp = get_mlp_module_spec_for_backend(backend=m.provider, num_experts=None)
    layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=input_norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.no_mask},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=first_linear, core_attention=m.attention, linear_proj=m.row
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp if m.fused_norm else m.norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            # the ViT uses LayerNorm: the map renames its bias with its weight (layer_norm_bias)
            sharded_state_dict_keys_map=m.norm_keys_map(FULL, dense_mlp=True),
        ),
    )
    return TransformerBlockSubmodules(layer_specs=[layer] * config.num_layers, layer_norm=None)


def linear_classes(backend: str):
    """(column-parallel, row-parallel, norm) classes for modules built outside a block."""
    m = _Modules(backend)
    return m.column, m.row, m.norm
