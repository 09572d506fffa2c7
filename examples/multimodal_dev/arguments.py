"""The playground's command-line flags, added to megatron.training's parser, and the checks
that tie megatron's model flags to the chosen variant.

The model shape comes from ``--model-variant`` (or ``--hf-config-path``); megatron's own
model flags (``--num-layers``, ``--hidden-size``, ...) are still required by its argument
validation and must agree with that shape. A disagreement is an error naming both values,
never a silently different model.
"""

from __future__ import annotations

from dataclasses import replace


def _non_negative(text: str) -> float:
    import argparse

    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative (0 turns MFU off)")
    return value


def add_multimodal_args(parser):
    group = parser.add_argument_group("multimodal playground")
    group.add_argument("--model-arch", default="qwen35_vl", help="MODEL_REGISTRY key")
    group.add_argument("--model-variant", default="tiny", help="named shape (tiny, proxy, 0.8b, ..., 397b_a17b)")
    group.add_argument("--variant-moe", choices=("auto", "on", "off"), default="auto",
                       help="force MoE on/off for variants that allow it (tiny); auto keeps the variant's")
    group.add_argument("--hf-config-path", default=None,
                       help="take the model shape from a Hugging Face config.json (file or directory) instead")
    group.add_argument("--dataset-provider", default="mock",
                       help="mock (default, no files), mock_mix, mock_video (images and videos) or cord_v2")
    group.add_argument("--hf-processor-path", default=None,
                       help="processor (tokenizer, chat template, image processor) for real datasets")
    group.add_argument("--min-pixels", type=int, default=None, help="smallest image area after resizing")
    group.add_argument("--max-pixels", type=int, default=None, help="largest image area after resizing")
    group.add_argument("--use-packed-sequence", dest="use_packed_sequence", action="store_true", default=True,
                       help="THD packing: the micro-batch's samples in one row with cu_seqlens (default)")
    group.add_argument("--no-packed-sequence", dest="use_packed_sequence", action="store_false",
                       help="BSHD: pad every sample of the micro-batch to the longest")
    group.add_argument("--packing", choices=("samples", "tokens"), default="samples",
                       help="samples: a micro-batch packs --micro-batch-size conversations (default); tokens: a "
                            "micro-batch is one row of --packed-seq-length tokens filled from a look-ahead buffer, "
                            "rows dealt to data-parallel ranks by cost, --global-batch-size counts rows "
                            "(data/token_budget.py)")
    group.add_argument("--packed-seq-length", type=int, default=None,
                       help="--packing tokens: tokens per row (default: --seq-length)")
    group.add_argument("--packing-window", type=int, default=4096,
                       help="--packing tokens: most conversations the look-ahead buffer holds")
    group.add_argument("--mock-text-tokens", type=int, default=96,
                       help="mock dataset: upper bound of prompt and answer text lengths")
    group.add_argument("--freeze-vision", action="store_true", help="do not train the vision tower")
    group.add_argument("--freeze-language", action="store_true", help="do not train the language model")
    group.add_argument("--peak-tflops", type=_non_negative, default=None,
                       help="GPU peak TFLOP/s to quote MFU against (default: the device's dense bf16 peak from "
                            "throughput.py's table; 0: no MFU)")
    group.add_argument("--metrics-file", default=None,
                       help="append one JSON line per iteration (loss, grad norm, lr, tokens, FLOPs; full precision)")
    # No default here: backend.engine_defaults() picks transformer_engine or local by what the
    # host has, and an explicit --transformer-impl always wins.
    parser.set_defaults(transformer_impl=None)
    return parser


# megatron flag -> how to read the same number from a Qwen35VLShape
_SHAPE_FLAGS = {
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
    for flag, value_of in _SHAPE_FLAGS.items():
        given, expected = getattr(args, flag, None), value_of(shape)
        if flag == "moe_router_topk" and not shape.text.is_moe:
            continue  # megatron defaults it to 2 even for dense models
        if given is not None and given != expected:
            wrong.append(f"--{flag.replace('_', '-')} {given} (the {source} has {expected})")
    if getattr(args, "ffn_hidden_size", None) and not shape.text.is_moe \
            and args.ffn_hidden_size != shape.text.ffn_hidden_size:
        wrong.append(f"--ffn-hidden-size {args.ffn_hidden_size} (the {source} has {shape.text.ffn_hidden_size})")
    if getattr(args, "vocab_size", None) and args.vocab_size != shape.text.vocab_size:
        wrong.append(f"--vocab-size {args.vocab_size} (the {source} has {shape.text.vocab_size})")
    if wrong:
        raise ValueError("model flags disagree with " + source + ": " + "; ".join(wrong))


def resolve_shape(args):
    """The model shape for these args, with the token ids of the processor when one is given."""
    from examples.multimodal_dev.models import get_model_entry

    entry = get_model_entry(args.model_arch)
    if args.hf_config_path:
        shape, source = entry.load("shape_from_hf")(args.hf_config_path), f"--hf-config-path {args.hf_config_path}"
    else:
        moe = {"auto": None, "on": True, "off": False}[args.variant_moe]
        shape, source = entry.load("shape_fn")(args.model_variant, moe=moe), f"variant {args.model_variant!r}"
    # The MTP head is trained only when asked for (megatron's --mtp-num-layers), whatever the
    # checkpoint or variant carries; a converted checkpoint's mtp.* tensors are then left unused.
    shape = replace(shape, text=replace(shape.text, mtp_num_layers=args.mtp_num_layers or 0))
    check_model_flags(args, shape, source)
    if args.hf_processor_path:
        from examples.multimodal_dev.data.processor import load_processor

        tokens = load_processor(args.hf_processor_path)[1].tokens
        if max(tokens.vision_ids + (tokens.vision_start, tokens.vision_end)) >= shape.text.vocab_size:
            raise ValueError(f"--hf-processor-path {args.hf_processor_path}: its vision token ids do not fit "
                             f"the vocabulary of {shape.text.vocab_size}")
        shape = replace(shape, image_token_id=tokens.image, video_token_id=tokens.video,
                        vision_start_token_id=tokens.vision_start, vision_end_token_id=tokens.vision_end)
    return shape


def checkpoint_args(shape, **extra):
    """megatron.training's model args for ``shape`` (what a checkpoint stores as ``args``, so
    ``--use-checkpoint-args`` and megatron's checkpoint checks read the shape back)."""
    from argparse import Namespace

    t = shape.text
    values = {flag: value_of(shape) for flag, value_of in _SHAPE_FLAGS.items()}
    return Namespace(**values, group_query_attention=True, vocab_size=t.vocab_size,
                     ffn_hidden_size=t.ffn_hidden_size or t.moe_ffn_hidden_size,
                     untie_embeddings_and_output_weights=not t.tie_word_embeddings, normalization="RMSNorm",
                     swiglu=True, position_embedding_type="rope", rotary_percent=t.partial_rotary_factor,
                     rotary_base=int(t.rope_theta), mtp_num_layers=t.mtp_num_layers or None, **extra)


def check_checkpoint_matches(load_dir: str | None, shape) -> None:
    """The checkpoint under ``--load`` was saved from this model shape: its stored args (megatron's
    common state) against ``checkpoint_args(shape)``, so a dense checkpoint loaded as MoE (or the
    wrong variant) is one line naming what differs, not a KeyError listing hundreds of tensors."""
    import os

    from examples.multimodal_dev.tools.checkpoint_files import TRACKER, checkpoint_directory, stored_args

    if not load_dir or not os.path.isfile(os.path.join(load_dir, TRACKER)):
        return
    directory = checkpoint_directory(load_dir)
    if not os.path.isdir(directory):
        raise ValueError(f"--load {load_dir}: {TRACKER} names {os.path.basename(directory)}, which does not exist")
    stored = stored_args(directory)
    if stored is None:
        return
    expected = vars(checkpoint_args(shape))
    differ = [f"{flag} {getattr(stored, flag, None) or 0} (checkpoint) vs {expected[flag] or 0} (this run)"
              for flag in (*_SHAPE_FLAGS, "vocab_size") if flag != "moe_router_topk"
              and (getattr(stored, flag, None) or 0) != (expected[flag] or 0)]
    if expected["mtp_num_layers"] and not getattr(stored, "mtp_num_layers", None):
        differ.append("the run trains an MTP head (MTP=1) the checkpoint does not have")
    if differ:
        raise ValueError(f"--load {load_dir} ({os.path.basename(directory)}) was saved from another model: "
                         + "; ".join(differ) + " (MODEL_VARIANT / MOE / MTP / HF_CONFIG must match the checkpoint)")


# The run script's per-variant columns, in its order; the shape table in configuration.py is the
# only copy of the numbers.
SHAPE_ROW = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
             "ffn_hidden_size", "vocab_size", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
             "linear_num_key_heads", "linear_num_value_heads", "mtp_num_layers")


def shape_row(shape) -> str:
    """``SHAPE_ROW`` of a shape, space-separated, 0 for what the shape does not have."""
    t = shape.text
    args = vars(checkpoint_args(shape, linear_num_key_heads=t.linear_num_key_heads,
                                linear_num_value_heads=t.linear_num_value_heads))
    args["ffn_hidden_size"] = 0 if t.is_moe else t.ffn_hidden_size
    args["mtp_num_layers"] = t.mtp_num_layers
    return " ".join(str(args[k] or 0) for k in SHAPE_ROW)


def _shape_row_command(argv: list[str]) -> str:
    import argparse

    parser = argparse.ArgumentParser(prog="arguments.py shape-row",
                                     description="the run script's model numbers: " + " ".join(SHAPE_ROW))
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--variant")
    source.add_argument("--hf-config")
    parser.add_argument("--moe", action="store_true", help="tiny only: its 4-expert MoE form")
    args = parser.parse_args(argv)
    from examples.multimodal_dev.models.qwen35_vl.configuration import from_hf_config, get_variant

    if args.hf_config:
        return shape_row(from_hf_config(args.hf_config))
    return shape_row(get_variant(args.variant, moe=True if args.moe else None))


if __name__ == "__main__":  # used by run_qwen35_vl.sh: arguments.py shape-row (--variant V [--moe] | --hf-config C)
    import sys

    if len(sys.argv) < 2 or sys.argv[1] != "shape-row":
        raise SystemExit("usage: arguments.py shape-row (--variant NAME [--moe] | --hf-config CONFIG_JSON)")
    try:
        print(_shape_row_command(sys.argv[2:]))
    except (KeyError, ValueError, FileNotFoundError) as err:
        raise SystemExit(f"arguments.py: {err.args[0] if err.args else err}")
