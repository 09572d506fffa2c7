"""megatron.training's model flags as read from a model shape: the numbers a run's flags must equal,
what a checkpoint stores as ``args``, and the run script's per-variant columns.

    python -m examples.multimodal_dev.models.megatron_args shape-row --variant 9b   (the run script's)
    python -m examples.multimodal_dev.models.megatron_args vision-heads --variant 9b

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


# The run script's per-variant columns, in its order; the shape table in configuration.py is the
# only copy of the numbers.
SHAPE_ROW = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "vocab_size",
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "mtp_num_layers",
)


def shape_row(shape) -> str:
    """``SHAPE_ROW`` of a shape, space-separated, 0 for what the shape does not have."""
    t = shape.text
    args = vars(
        checkpoint_args(
            shape, linear_num_key_heads=t.linear_num_key_heads, linear_num_value_heads=t.linear_num_value_heads
        )
    )
    args["ffn_hidden_size"] = 0 if t.is_moe else t.ffn_hidden_size
    args["mtp_num_layers"] = t.mtp_num_layers
    return " ".join(str(args[k] or 0) for k in SHAPE_ROW)


# the commands of ``python -m ...megatron_args``: what each prints of the shape it is given
COMMANDS = {
    "shape-row": ("the run script's model numbers: " + " ".join(SHAPE_ROW), shape_row),
    "vision-heads": ("the vision tower's attention heads", lambda shape: str(shape.vision.num_heads)),
}


def _shape_command(command: str, argv: list[str]) -> str:
    import argparse

    description, output = COMMANDS[command]
    parser = argparse.ArgumentParser(prog=f"megatron_args.py {command}", description=description)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--variant")
    source.add_argument("--hf-config")
    parser.add_argument("--moe", action="store_true", help="tiny only: its 4-expert MoE form")
    args = parser.parse_args(argv)
    from .qwen35_vl.configuration import from_hf_config, get_variant

    if args.hf_config:
        return output(from_hf_config(args.hf_config))
    return output(get_variant(args.variant, moe=True if args.moe else None))


if (
    __name__ == "__main__"
):  # used by run_qwen35_vl.sh: -m examples.multimodal_dev.models.megatron_args shape-row|vision-heads (--variant V [--moe] | --hf-config C)
    import sys

    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        raise SystemExit(
            "usage: megatron_args.py shape-row|vision-heads (--variant NAME [--moe] | --hf-config CONFIG_JSON)"
        )
    try:
        print(_shape_command(sys.argv[1], sys.argv[2:]))
    except (KeyError, ValueError, FileNotFoundError) as err:
        raise SystemExit(f"megatron_args.py: {err.args[0] if err.args else err}")
