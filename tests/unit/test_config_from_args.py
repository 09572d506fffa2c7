"""megatron's parsed args -> the decoder and vision TransformerConfigs of the tiny variant, as
pretrain_multimodal.py makes them: megatron's ``validate_args`` with the engine defaults, then
``configuration.configs_from_args`` with the flags typed on the command line. Architecture
fields come from the shape (a contradicting flag is refused by name), recipe fields from the
shape unless given, training flags from megatron, TE-only fusions off on the local backend."""

import contextlib
import io

import pytest

from examples.multimodal_dev.arguments import add_multimodal_args
from examples.multimodal_dev.checkpoint.run_shape import resolve_shape
from examples.multimodal_dev.models.common import config_from_args
from examples.multimodal_dev.models.qwen35_vl import configuration
from examples.multimodal_dev.training import backend

# run_qwen35_vl.sh's flags for MODEL_VARIANT=tiny on a CPU host
TINY = [
    "--model-arch",
    "qwen35_vl",
    "--model-variant",
    "tiny",
    "--num-layers",
    "4",
    "--hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--kv-channels",
    "32",
    "--seq-length",
    "512",
    "--max-position-embeddings",
    "512",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "8192",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--train-iters",
    "4",
    "--lr",
    "1e-4",
    "--distributed-backend",
    "gloo",
    "--transformer-impl",
    "local",
    "--seed",
    "1234",
    # what MTP=1 adds; keeps megatron's apply_rope_fusion default (True) past validate_args
    "--position-embedding-type",
    "rope",
]
DENSE = ["--ffn-hidden-size", "256"]
MOE = [
    "--variant-moe",
    "on",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "128",
    "--ffn-hidden-size",
    "128",
]


def parse(extra=(), model=DENSE, world_size=1):
    """(args, given) as pretrain_multimodal.py has them after megatron's parsing and validation."""
    from megatron.training.arguments import validate_args

    argv = TINY + list(model) + list(extra)
    parser = config_from_args.megatron_parser(add_multimodal_args)
    args = parser.parse_args(argv)
    args.rank, args.world_size = 0, world_size  # megatron's parse_args reads them from the environment
    with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
        validate_args(args, backend.engine_defaults())
    return args, config_from_args.given_flags(parser, argv)


def configs(extra=(), model=DENSE, world_size=1, impl="local"):
    args, given = parse(extra, model, world_size)
    decoder, vision = configuration.configs_from_args(args, resolve_shape(args), impl, given)
    return decoder, vision, args


def test_given_flags_name_the_typed_option():
    parser = config_from_args.megatron_parser(add_multimodal_args)
    given = config_from_args.given_flags(
        parser, ["--hidden-dropout=0.2", "--no-rope-fusion", "--model-variant", "tiny", "0.3", "--norm-epsilon", "1e-5"]
    )
    assert given == {
        "hidden_dropout": "--hidden-dropout",
        "apply_rope_fusion": "--no-rope-fusion",
        "model_variant": "--model-variant",
        "layernorm_epsilon": "--norm-epsilon",
    }


def test_flag_contradicting_the_shape_is_refused_by_name(mcore):
    with pytest.raises(ValueError) as err:
        configs(["--normalization", "LayerNorm"])
    message = str(err.value)
    assert message.startswith("flags contradict the model shape: ")
    assert "--normalization gives normalization='LayerNorm' (the variant 'tiny' has 'RMSNorm')" in message


def test_norm_epsilon_contradicting_the_shape_is_refused(mcore):
    try:
        configs(["--norm-epsilon", "1e-5"])
    except ValueError as err:
        assert "--norm-epsilon gives layernorm_epsilon=1e-05 (the variant 'tiny' has 1e-06)" in str(err)
    else:
        raise AssertionError("--norm-epsilon 1e-5 was not refused")


def test_flags_agreeing_with_the_shape_are_accepted(mcore):
    decoder, _, _ = configs(
        [
            "--normalization",
            "RMSNorm",
            "--swiglu",
            "--qk-layernorm",
            "--attention-output-gate",
            "--disable-bias-linear",
            "--apply-layernorm-1p",
        ]
    )
    assert decoder.normalization == "RMSNorm" and decoder.qk_layernorm and decoder.gated_linear_unit


def test_shape_architecture_in_decoder_and_vision(mcore):
    import torch.nn.functional as F

    # TP 2 x CP 2 with sequence parallelism: the decoder's settings, not the vision tower's
    decoder, vision, _ = configs(
        ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--sequence-parallel"], world_size=4
    )
    assert decoder.linear_attention_freq == [1, 1, 1, 0]  # 3 Gated DeltaNet layers, then attention
    assert decoder.experimental_attention_variant == "gated_delta_net"
    assert decoder.attention_output_gate is True and decoder.layernorm_zero_centered_gamma is True
    assert decoder.qk_layernorm is True and decoder.kv_channels == 32 and decoder.num_query_groups == 2
    assert decoder.normalization == "RMSNorm" and decoder.layernorm_epsilon == 1e-6
    assert decoder.gated_linear_unit is True and decoder.activation_func is F.silu
    assert (decoder.linear_num_key_heads, decoder.linear_num_value_heads) == (4, 8)
    assert decoder.mrope_section == [2, 1, 1] and decoder.add_bias_linear is False
    assert decoder.tensor_model_parallel_size == 2
    assert (decoder.context_parallel_size, decoder.sequence_parallel) == (2, True)

    assert (vision.num_layers, vision.hidden_size, vision.num_attention_heads) == (2, 64, 2)
    assert vision.normalization == "LayerNorm" and vision.layernorm_zero_centered_gamma is False
    assert vision.experimental_attention_variant is None and vision.linear_attention_freq is None
    assert vision.attention_output_gate is False and vision.qk_layernorm is False and vision.add_bias_linear is True
    assert vision.num_moe_experts is None and vision.mtp_num_layers is None
    assert (vision.context_parallel_size, vision.sequence_parallel) == (1, False)
    assert vision.tensor_model_parallel_size == 2  # shared with the decoder


def test_recipe_field_takes_the_shape_value_unless_given(mcore):
    decoder, vision, args = configs()
    assert args.hidden_dropout == 0.1  # megatron's default, replaced by the released models' 0
    assert (decoder.hidden_dropout, decoder.attention_dropout) == (0.0, 0.0)
    decoder, vision, _ = configs(["--hidden-dropout", "0.2"])
    assert (decoder.hidden_dropout, decoder.attention_dropout) == (0.2, 0.0)
    assert vision.hidden_dropout == 0.0  # the vision tower's own shape


def test_training_flags_take_effect(mcore):
    decoder, vision, _ = configs(
        ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    )
    for config in (decoder, vision):
        assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == (
            "full",
            "uniform",
            1,
        )
    decoder, _, _ = configs()
    assert decoder.recompute_granularity is None


def test_a_standalone_build_gives_the_tower_the_settings_training_gives_it(mcore):
    """Tools and tests build the model from TransformerConfig fields (``factory.build_model(**settings)``):
    the tower takes recompute and TP as a training run gives them, and no pipeline split."""
    flags = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    _, trained, _ = configs([*flags, "--tensor-model-parallel-size", "2"], world_size=2)
    shape = configuration.get_variant("tiny")
    standalone = configuration.vision_transformer_config(
        shape.vision,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        num_layers_in_first_pipeline_stage=1,
    )
    fields = (
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "num_layers_in_first_pipeline_stage",
        "num_layers",
    )
    assert {f: getattr(standalone, f) for f in fields} == {f: getattr(trained, f) for f in fields}


def test_moe_tiny_configs(mcore):
    decoder, vision, _ = configs(model=MOE)
    assert decoder.num_moe_experts == 4 and vision.num_moe_experts is None


def test_moe_recipe_and_flags(mcore):
    decoder, vision, args = configs(model=MOE)
    assert args.moe_aux_loss_coeff == 0.0  # megatron's default; the released models use 1e-3
    assert decoder.moe_aux_loss_coeff == 1e-3 and decoder.moe_router_load_balancing_type == "aux_loss"
    assert (decoder.num_moe_experts, decoder.moe_router_topk, decoder.moe_ffn_hidden_size) == (4, 2, 128)
    assert decoder.moe_shared_expert_intermediate_size == 128 and decoder.moe_shared_expert_gate is True
    assert vision.num_moe_experts is None
    decoder, _, _ = configs(["--moe-aux-loss-coeff", "0.05"], model=MOE)
    assert decoder.moe_aux_loss_coeff == 0.05


def test_local_backend_turns_te_fusions_off(mcore):
    decoder, vision, args = configs()
    assert args.apply_rope_fusion is True and args.gradient_accumulation_fusion is True  # megatron's defaults
    for config in (decoder, vision):
        assert config.apply_rope_fusion is False and config.gradient_accumulation_fusion is False
    # turned off explicitly: nothing to refuse
    decoder, _, _ = configs(["--no-rope-fusion", "--no-gradient-accumulation-fusion"])
    assert decoder.apply_rope_fusion is False and decoder.gradient_accumulation_fusion is False


def test_te_backend_keeps_the_fusions(mcore):
    args, given = parse()
    architecture = configuration.language_architecture(resolve_shape(args).text)
    settled = config_from_args._settled_args(args, architecture, given, fused_kernels_ok=True)
    assert settled.apply_rope_fusion is True and settled.gradient_accumulation_fusion is True
    settled = config_from_args._settled_args(args, architecture, given, fused_kernels_ok=False)
    assert settled.apply_rope_fusion is False and settled.gradient_accumulation_fusion is False
    assert args.apply_rope_fusion is True  # a copy: megatron's args stay as parsed
