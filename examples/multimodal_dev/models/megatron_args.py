"""megatron.training's model flags as read from a model shape: the numbers a run's flags must equal,
what a checkpoint stores as ``args``, and the defaults of megatron's model flags that the training
script takes from the shape (``apply_model_shape``).

The shape table (``qwen35_vl/configuration.py``) is the only copy of the numbers; everything here
reads them from a shape.
"""

from __future__ import annotations

# megatron flag -> how to read the same number from a Qwen35VLShape
SHAPE_FLAGS = {
    "num_layers": lambda s: s.text.num_layers,
    "hidden_size": lambda s: s.text.hidden_size,
    "num_attention_heads": lambda s: s.text.num_attention_heads,
    "num_query_groups": lambda s: s.text.num_kv_heads,
    "kv_channels": lambda s: s.text.head_dim,
    "num_experts": lambda s: s.text.num_experts,
    "moe_router_topk": lambda s: s.text.moe_top_k if s.text.is_moe else None,
    "moe_ffn_hidden_size": lambda s: s.text.moe_ffn_hidden_size if s.text.is_moe else None,
}


def check_model_flags(args, shape, source: str) -> None:
    """Every megatron model flag the user set must equal the shape's value."""
    wrong = []
    for flag, value_of in SHAPE_FLAGS.items():
        given, expected = getattr(args, flag, None), value_of(shape)
        if flag == "moe_router_topk" and not shape.text.is_moe:
            continue  # megatron defaults it to 2 even for dense models
        if given is not None and given != expected:
            wrong.append(f"--{flag.replace('_', '-')} {given} (the {source} has {expected})")
    if (
        getattr(args, "ffn_hidden_size", None)
        and not shape.text.is_moe
        and args.ffn_hidden_size != shape.text.ffn_hidden_size
    ):
        wrong.append(f"--ffn-hidden-size {args.ffn_hidden_size} (the {source} has {shape.text.ffn_hidden_size})")
    if getattr(args, "vocab_size", None) and args.vocab_size != shape.text.vocab_size:
        wrong.append(f"--vocab-size {args.vocab_size} (the {source} has {shape.text.vocab_size})")
    if wrong:
        raise ValueError("model flags disagree with " + source + ": " + "; ".join(wrong))


def checkpoint_args(shape, **extra):
    """megatron.training's model args for ``shape`` (what a checkpoint stores as ``args``, so
    ``--use-checkpoint-args`` and megatron's checkpoint checks read the shape back)."""
    from argparse import Namespace

    t = shape.text
    values = {flag: value_of(shape) for flag, value_of in SHAPE_FLAGS.items()}
    return Namespace(
        **values,
        group_query_attention=True,
        vocab_size=t.vocab_size,
        ffn_hidden_size=t.ffn_hidden_size or t.moe_ffn_hidden_size,
        untie_embeddings_and_output_weights=not t.tie_word_embeddings,
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        rotary_percent=t.partial_rotary_factor,
        rotary_base=int(t.rope_theta),
        mtp_num_layers=t.mtp_num_layers or None,
        **extra,
    )


def one_process_checkpoint_args(shape, save: str, hf_config_path: str, **extra):
    """``checkpoint_args`` of a checkpoint written by one process at no parallelism (an import from
    Hugging Face, a test's), which names the shape's architecture and its Hugging Face config."""
    sizes = ("tensor", "pipeline", "context", "expert")
    return checkpoint_args(
        shape,
        save=save,
        model_arch=type(shape).arch,
        hf_config_path=hf_config_path,
        world_size=1,
        **{f"{size}_model_parallel_size": 1 for size in sizes},
        **extra,
    )


def model_flag_defaults(shape, seq_length: int | None) -> dict:
    """The values megatron's model flags take for ``shape`` when the command line does not give them:
    the training script sets them after its parse (``apply_model_shape``), so the numbers reach
    megatron from the one shape table, never typed twice. A flag given still wins, and must agree
    (``check_model_flags``)."""
    t = shape.text
    defaults = {flag: value_of(shape) for flag, value_of in SHAPE_FLAGS.items() if value_of(shape) is not None}
    defaults.update(
        group_query_attention=True,
        vocab_size=t.vocab_size,
        tokenizer_type="NullTokenizer",
        ffn_hidden_size=t.moe_ffn_hidden_size if t.is_moe else t.ffn_hidden_size,
    )
    if seq_length is not None:  # megatron refuses positions beyond max_position_embeddings
        defaults["max_position_embeddings"] = seq_length
    return defaults


def apply_model_shape(args, shape, typed: dict[str, str]) -> None:
    """``args`` with each model flag the command line did not give (``typed``: dest -> the option
    written) set to the shape's value, as parser defaults would have set it."""
    for dest, value in model_flag_defaults(shape, args.seq_length).items():
        if dest not in typed:
            setattr(args, dest, value)
