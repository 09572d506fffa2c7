"""The playground's command-line flags, added to megatron.training's parser.

Megatron's own model flags (``--num-layers``, ``--hidden-size``, ...) stay required by its argument
validation and must equal the chosen shape: ``models/megatron_args.py`` checks them, naming both
values, and ``checkpoint/run_shape.py`` resolves the shape these flags describe.
"""

from __future__ import annotations


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
    group.add_argument("--dist-ckpt-optim-dp-reshardable", action="store_true",
                       help="save the distributed optimizer in megatron's dp_reshardable layout (its own default): "
                            "cheaper saves, but it resumes at another DP size only; this playground saves "
                            "--dist-ckpt-optim-fully-reshardable otherwise (checkpoint/optimizer_format.py)")
    # No default here: backend.engine_defaults() picks transformer_engine or local by what the
    # host has, and an explicit --transformer-impl always wins.
    parser.set_defaults(transformer_impl=None)
    return parser
