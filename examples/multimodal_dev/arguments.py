"""The playground's command-line flags, added to megatron.training's parser.

Megatron's own model flags (``--num-layers``, ``--hidden-size``, ...) default to the numbers of the
shape ``--model-variant`` / ``--hf-config-path`` names (``models/megatron_args.py``'s
``apply_model_shape``); one given must equal the shape's, and a mismatch names both values.
"""

from __future__ import annotations

import argparse
from typing import cast

from examples.multimodal_dev.lora.targets import DEFAULT_TARGETS


def _non_negative(text: str) -> float:
    import argparse

    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative (0 turns MFU off)")
    return value


def _add_own_data_args(group):
    # megatron's --valid-data-path feeds its GPT datasets and cannot be given with --data-path
    group.add_argument(
        "--eval-data-path",
        default=None,
        help="validation conversations: a .jsonl file, a folder of them or a weighted list, as "
        "--data-path (default: --valid-fraction of the training records, or none)",
    )
    group.add_argument(
        "--valid-fraction",
        type=float,
        default=0.0,
        help="hold this fraction of the training records out for validation (deterministic)",
    )
    group.add_argument(
        "--no-shuffle",
        action="store_true",
        help="jsonl: train on the records in file order (default: a seeded shuffle by --seed, a new one each "
        "pass, the same on every rank and exact on resume)",
    )
    group.add_argument(
        "--media-root",
        default=None,
        help="relative image and video paths resolve here (default: the JSONL file's folder)",
    )
    group.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="fetch http(s) images and videos named in the records (refused otherwise)",
    )
    group.add_argument(
        "--allow-media-anywhere",
        action="store_true",
        help="read media paths outside the JSONL file's folder (or --media-root); refused otherwise, "
        "so a dataset cannot name the host's files",
    )
    group.add_argument(
        "--strict-data",
        action="store_true",
        help="the first bad record stops the run in one line, instead of a counted skip",
    )
    _add_video_args(group)


def _add_video_args(group):
    # how a video is sampled and resized: qwen-vl-utils' fetch_video options (data/video.py)
    group.add_argument("--video-fps", type=float, default=None, help="frames sampled per second of video [2.0]")
    group.add_argument("--video-max-frames", type=int, default=None, help="most frames sampled from a video [768]")
    group.add_argument("--video-min-frames", type=int, default=None, help="fewest frames sampled from a video [4]")
    group.add_argument(
        "--video-max-pixels",
        type=int,
        default=None,
        help="largest area of one video frame after resizing [qwen-vl-utils' default]",
    )
    group.add_argument(
        "--video-min-pixels",
        type=int,
        default=None,
        help="smallest area of one video frame after resizing [qwen-vl-utils' default]",
    )
    group.add_argument(
        "--video-total-pixels",
        type=int,
        default=None,
        help="pixel budget of a whole video, shared by its frames [qwen-vl-utils' default]",
    )


def _add_energon_args(group):
    # None: energon.py's defaults, stated in the help
    group.add_argument(
        "--energon-shuffle-buffer-size",
        type=int,
        default=None,
        help="conversations a loader worker shuffles within [100]",
    )
    group.add_argument(
        "--energon-max-samples-per-sequence",
        type=int,
        default=None,
        help="conversations read in a row from one shard before another is opened [100]",
    )
    group.add_argument(
        "--energon-packing-buffer-size",
        type=int,
        default=None,
        help="under --packing tokens: conversations a loader worker buffers (decoded) to fill its rows from [64]",
    )


OWN_DATA_OPTIONS = (
    "eval_data_path",
    "no_shuffle",
    "valid_fraction",
    "media_root",
    "allow_remote_media",
    "allow_media_anywhere",
    "strict_data",
    "energon_shuffle_buffer_size",
    "energon_max_samples_per_sequence",
    "energon_packing_buffer_size",
)
# every provider's (data/patch_budget.py): a conversation over one is a named skip, rows close under them
PATCH_BUDGET_OPTIONS = (
    "max_vision_patches_per_image",
    "max_vision_patches_per_video",
    "max_vision_patches_per_micro_batch",
)
VIDEO_OPTIONS = (
    "video_fps",
    "video_max_frames",
    "video_min_frames",
    "video_max_pixels",
    "video_min_pixels",
    "video_total_pixels",
)


def _add_patch_budget_args(group):
    # what bounds the vision tower's activations: its input patches (t*h*w of a grid), before the spatial merge
    group.add_argument(
        "--max-vision-patches-per-image",
        type=int,
        default=0,
        help="skip, by name, a conversation with an image of more vision patches (t*h*w) than this (0: no budget)",
    )
    group.add_argument(
        "--max-vision-patches-per-video",
        type=int,
        default=0,
        help="skip, by name, a conversation with a video of more vision patches (t*h*w, all its frames) than "
        "this (a file's video is counted from its header, before it is decoded; 0: no budget)",
    )
    group.add_argument(
        "--max-vision-patches-per-micro-batch",
        type=int,
        default=0,
        help="most vision patches of a micro-batch's images and videos: a conversation over it is skipped by "
        "name, and --packing tokens closes a row before a conversation would take it over (with --packing "
        "samples, --micro-batch-size 1 only; 0: no budget; data/patch_budget.py)",
    )


def add_multimodal_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The training script's own flags, beside megatron's (``--help`` lists them in these groups)."""
    group = parser.add_argument_group("multimodal playground")
    _add_model_and_data_args(group)
    _add_own_data_args(parser.add_argument_group("your own data (--dataset-provider jsonl)"))
    _add_energon_args(parser.add_argument_group("Megatron-Energon shards (--dataset-provider energon)"))
    _add_patch_budget_args(parser.add_argument_group("vision patch budgets (every --dataset-provider)"))
    _add_packing_args(group)
    _add_vision_args(group)
    _add_run_args(group)
    _add_lora_args(parser.add_argument_group("LoRA fine-tuning (lora/)"))
    _add_post_training_args(parser.add_argument_group("post-training (post_training/)"))
    # No default here: backend.engine_defaults() picks transformer_engine or local by what the
    # host has, and an explicit --transformer-impl always wins.
    parser.set_defaults(transformer_impl=None)
    return parser


def _add_model_and_data_args(group):
    # the model (a variant, or a Hugging Face config) and the dataset that feeds it
    group.add_argument("--model-arch", default="qwen35_vl", help="MODEL_REGISTRY key")
    group.add_argument("--model-variant", default="tiny", help="named shape (tiny, proxy, 0.8b, ..., 397b_a17b)")
    group.add_argument(
        "--variant-moe",
        choices=("auto", "on", "off"),
        default="auto",
        help="force MoE on/off for variants that allow it (tiny); auto keeps the variant's",
    )
    group.add_argument(
        "--hf-config-path",
        default=None,
        help="take the model shape from a Hugging Face config.json (file or directory) instead",
    )
    group.add_argument(
        "--dataset-provider",
        default="mock",
        help="mock (default, no files), mock_mix, mock_video (images and videos), cord_v2, jsonl "
        "(your own conversations, data/jsonl.py) or energon (Megatron-Energon shards, "
        "data/energon.py)",
    )
    group.add_argument(
        "--hf-processor-path",
        default=None,
        help="processor (tokenizer, chat template, image processor) for real datasets",
    )
    group.add_argument("--min-pixels", type=int, default=None, help="smallest image area after resizing")
    group.add_argument("--max-pixels", type=int, default=None, help="largest image area after resizing")


def _add_packing_args(group):
    # how a micro-batch's conversations become rows: THD packing by samples or by a token budget
    group.add_argument(
        "--use-packed-sequence",
        dest="use_packed_sequence",
        action="store_true",
        default=True,
        help="THD packing: the micro-batch's samples in one row with cu_seqlens (default)",
    )
    group.add_argument(
        "--no-packed-sequence",
        dest="use_packed_sequence",
        action="store_false",
        help="BSHD: pad every sample of the micro-batch to the longest",
    )
    group.add_argument(
        "--packing",
        choices=("samples", "tokens"),
        default="samples",
        help="samples: a micro-batch packs --micro-batch-size conversations (default); tokens: a "
        "micro-batch is one row of --packed-seq-length tokens filled from a look-ahead buffer, "
        "rows dealt to data-parallel ranks by cost, --global-batch-size counts rows "
        "(data/token_budget.py)",
    )
    group.add_argument(
        "--packed-seq-length", type=int, default=None, help="--packing tokens: tokens per row (default: --seq-length)"
    )
    group.add_argument(
        "--packing-window",
        type=int,
        default=4096,
        help="--packing tokens: most conversations the look-ahead buffer holds",
    )
    group.add_argument(
        "--mock-text-tokens", type=int, default=96, help="mock dataset: upper bound of prompt and answer text lengths"
    )


def _add_vision_args(group):
    # the vision tower's layout, its activation chunks, and what trains
    group.add_argument(
        "--vision-tensor-parallel-size",
        type=int,
        default=None,
        help="tensor-parallel size of the vision tower (default: --tensor-model-parallel-size); "
        "smaller, it runs on the same ranks with a larger data-parallel size, each rank "
        "encoding its share of the images (vision_ranks/layout.py)",
    )
    group.add_argument(
        "--vision-nproc",
        type=int,
        default=0,
        help="ranks 0..N-1 run only the vision tower, the others only the language model "
        "(vision_ranks/layout.py; 0: every rank runs both)",
    )
    group.add_argument(
        "--vision-chunk-patches",
        type=int,
        default=0,
        help="run the vision tower over chunks of whole frames of at most N patches, each recomputed in "
        "backward: its activations are one chunk's at a time (0: all items in one pass)",
    )
    group.add_argument("--freeze-vision", action="store_true", help="do not train the vision tower")
    group.add_argument("--freeze-language", action="store_true", help="do not train the language model")


def _add_run_args(group):
    # what the run reports (MFU, generated answers, metrics) and how it saves the optimizer
    group.add_argument(
        "--peak-tflops",
        type=_non_negative,
        default=None,
        help="GPU peak TFLOP/s to quote MFU against (default: the device's dense bf16 peak from "
        "throughput.py's table; 0: no MFU)",
    )
    group.add_argument(
        "--gen-eval-interval",
        type=int,
        default=0,
        help="every N iterations, answer validation conversations by generation and log their scores "
        "(training/gen_eval.py; 0: never)",
    )
    group.add_argument("--gen-eval-samples", type=int, default=16, help="validation conversations answered")
    group.add_argument("--gen-eval-max-new-tokens", type=int, default=128, help="longest answer generated")
    group.add_argument("--gen-eval-batch-size", type=int, default=4, help="prompts decoded together per replica")
    group.add_argument(
        "--metrics-file",
        default=None,
        help="append one JSON line per iteration (loss, grad norm, lr, tokens, FLOPs; full precision)",
    )
    group.add_argument(
        "--dist-ckpt-optim-dp-reshardable",
        action="store_true",
        help="save the distributed optimizer in megatron's dp_reshardable layout (its own default): "
        "cheaper saves, but it resumes at another DP size only; this playground saves "
        "--dist-ckpt-optim-fully-reshardable otherwise (checkpoint/optimizer_format.py)",
    )


def _add_lora_args(group):
    group.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train LoRA adapters of this rank on the --lora-targets linears, every other weight frozen (0: off)",
    )
    group.add_argument("--lora-alpha", type=float, default=None, help="adapter scale alpha / rank [the rank: scale 1]")
    group.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    group.add_argument(
        "--lora-targets",
        default=",".join(DEFAULT_TARGETS),
        help="linears that get an adapter, by megatron-core's names, comma-separated (lora/targets.py) "
        f"[{','.join(DEFAULT_TARGETS)}: every linear of the language model, Gated DeltaNet included]",
    )
    group.add_argument(
        "--lora-base",
        dest="lora_base_path",
        default=None,
        help="where the base of the adapters a checkpoint holds is now, where it moved since the save "
        "(checkpoints of a LoRA run hold the adapters, not the base: checkpoint/adapters_only.py)",
    )


def _add_post_training_args(group):
    group.add_argument(
        "--train-mode",
        choices=("sft", "dpo", "grpo"),
        default="sft",
        help="sft: the answers' next-token loss; dpo: the sigmoid DPO loss on preference pairs "
        "(post_training/dpo.py); grpo: answers drawn on the training ranks, scored, and the clipped "
        "policy loss (post_training/grpo.py); docs/post_training.md",
    )
    group.add_argument(
        "--dpo-beta", type=float, default=None, help="DPO's beta: how far the policy may move from the reference [0.1]"
    )
    # GRPO's defaults are post_training/grpo.py's Settings: None here is "not given"
    for flag, kind, help_ in (
        ("--grpo-samples", int, "answers drawn for each prompt: the group of its advantages [8]"),
        ("--grpo-max-new-tokens", int, "the longest answer drawn, in tokens [256]"),
        ("--grpo-reward", str, "exact_match, token_f1, anls, field_f1, tree_accuracy, or python:module.function"),
        ("--grpo-kl-weight", float, "the KL term's weight; 0: no reference forward [0.04]"),
        ("--grpo-clip", float, "the clip of the policy's ratio to the decoder's [0.2]"),
    ):
        group.add_argument(flag, type=kind, default=None, help=f"TRAIN_MODE=grpo: {help_}")


def megatron_args() -> argparse.Namespace:
    """megatron's parsed arguments (``megatron.training.get_args``), typed: megatron declares its global
    as None until the arguments are parsed, which they are before any provider runs."""
    from megatron.training import get_args

    return cast(argparse.Namespace, get_args())
