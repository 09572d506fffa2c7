"""A run of ``run_qwen35_vl.sh`` as one typed value, and the one declaration of every setting.

Each field that a variable sets is declared once, here, with everything about it: the variable, the
recipe default (the field's), its parser (``parsers.py``), the largest value it may take, the training
script's flag it writes, and its line in README.md's table. ``variables.py`` (the table, the names,
the near misses), ``from_env.py`` (the parse), ``megatron_argv.py`` (the flags) and ``launch.py`` (the
flags refused as extras) read these declarations; none keeps a list of its own. The other fields are
recipe settings that no variable reaches (the optimizer's betas, the evaluation cadence, the seed).

A recipe (``recipes.py``) gives the defaults, ``from_env.py`` lays the environment over them,
``checks.py`` refuses what cannot run, and ``megatron_argv.py`` writes megatron's flags. ``None`` in a
field marked *derived* means "follow the other settings" (``etp`` is ``tp``), resolved where it is
read, so a recipe's value is never lost to a default computed too early.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import Any

from . import parsers as p
from .parsers import LaunchError, Parser

__all__ = ["LaunchError", "RunConfig", "Setting", "settings", "variable", "variable_fields"]

INT32, INT64 = 2**31 - 1, 2**63 - 1
RANKS = (INT32, "torch.distributed numbers ranks in int32")
ITERATIONS = (INT64, "megatron counts iterations in int64")
POSITIONS = (2**24, "rotary positions are exact in fp32 up to 2^24")


@dataclass(frozen=True)
class Setting:
    """One variable of the run script: everything the launcher and its docs know about it."""

    name: str  # the environment variable
    parse: Parser  # its text to the field's type, refusing a malformed value by name
    default: str  # README: the default, as users read it ("" where unset means off)
    meaning: str  # README: what it does; "" where it shares the row of ``row``
    flag: str | None = None  # the training script's flag it writes: refused among the extra flags
    limit: tuple[int, str] | None = None  # the largest value, and what holds it there
    row: str | None = None  # README: the variable whose row this one shares


def variable(
    name: str,
    default: Any = None,
    *,
    parse: Parser,
    doc: tuple[str, str] | str,
    flag: str | None = None,
    limit: tuple[int, str] | None = None,
) -> Any:
    """A field the environment variable ``name`` sets. ``doc``: README's (default, meaning), or the
    name of the variable whose row it shares."""
    shared = isinstance(doc, str)
    shown, meaning = ("", "") if shared else doc
    setting = Setting(name, parse, shown, meaning, flag, limit, doc if isinstance(doc, str) else None)
    assert shared or meaning, f"{name}: a row of its own needs a meaning"
    return field(default=default, metadata={"setting": setting})


@dataclass(frozen=True)
class Model:
    variant: str = variable(  # "hf_config" where HF_CONFIG gives the shape
        "MODEL_VARIANT",
        "tiny",
        parse=p.text,
        doc=(
            "`tiny` without a GPU, `proxy` with one (the script says which)",
            "`tiny`, `proxy`, `0.8b`, `2b`, `4b`, `9b`, `27b`, `35b_a3b`, `122b_a10b`, `397b_a17b`",
        ),
    )
    hf_config: str | None = variable(
        "HF_CONFIG",
        parse=p.text,
        doc=(
            "`CKPT_LOAD/hf_config.json` if present",
            "take the model shape from a Hugging Face `config.json` instead of `MODEL_VARIANT`",
        ),
    )
    moe: bool = variable(  # tiny only: 4 experts (top-2)
        "MOE", False, parse=p.switch(), doc=("0", "`tiny` only: 4 experts (top-2) so EP runs on CPU")
    )
    mtp: bool | None = variable(  # derived: on where the Hugging Face config has an MTP head
        "MTP",
        parse=p.switch(" (Qwen3.5 has one MTP layer)"),
        doc=(
            "1 if `HF_CONFIG` has an MTP head (not under `TRAIN_MODE=dpo` or `grpo`), else 0",
            "1 also trains the multi-token-prediction head (`--mtp-num-layers 1`); its loss is logged as `mtp_1 loss`",
        ),
    )


@dataclass(frozen=True)
class Layout:
    tp: int = variable(
        "TP",
        1,
        parse=p.positive,
        doc=("1", "tensor / context / expert / pipeline parallel sizes"),
        flag="--tensor-model-parallel-size",
        limit=RANKS,
    )
    cp: int = variable("CP", 1, parse=p.positive, doc="TP", flag="--context-parallel-size", limit=RANKS)
    ep: int = variable("EP", 1, parse=p.positive, doc="TP", flag="--expert-model-parallel-size", limit=RANKS)
    pp: int = variable("PP", 1, parse=p.positive, doc="TP", flag="--pipeline-model-parallel-size", limit=RANKS)
    etp: int | None = variable(  # derived: tp
        "ETP",
        parse=p.positive,
        doc=("`TP`", "expert tensor parallel size (1: whole experts per rank)"),
        flag="--expert-tensor-parallel-size",
        limit=RANKS,
    )
    vp: int = variable(
        "VP",
        1,
        parse=p.positive,
        doc=("1", "virtual pipeline stages per pipeline rank (the interleaved schedule)"),
        flag="--num-virtual-stages-per-pipeline-rank",
        limit=RANKS,
    )
    pp_first: int = variable(  # 0: megatron-core's even split
        "PP_FIRST",
        0,
        parse=p.count("decoder layers"),
        doc=("even split", "decoder layers on the first / last pipeline stage"),
        flag="--decoder-first-pipeline-num-layers",
    )
    pp_last: int = variable(
        "PP_LAST", 0, parse=p.count("decoder layers"), doc="PP_FIRST", flag="--decoder-last-pipeline-num-layers"
    )
    sp: bool | None = variable(  # derived: on for MoE with tp > 1 (megatron-core requires it)
        "SP",
        parse=p.switch(),
        doc=("1 for MoE with `TP>1` (megatron-core requires it), else 0", "sequence parallelism over the TP ranks"),
        flag="--sequence-parallel",
    )
    fsdp: bool = variable(  # Megatron-FSDP over the data-parallel ranks
        "FSDP",
        False,
        parse=p.switch(),
        doc=(
            "0",
            "Megatron-FSDP: weights, gradients and optimizer state sharded over the data-parallel ranks, "
            "checkpoints in `fsdp_dtensor` ([docs/parallelism.md](docs/parallelism.md#megatron-fsdp))",
        ),
        flag="--use-megatron-fsdp",
    )
    nproc: int | None = variable(  # on each node; derived: (tp * cp * pp + vision_nproc) / nnodes
        "NPROC",
        parse=p.positive,
        doc=("`TP*CP*PP` (+`VISION_NPROC`) / `NNODES`", "processes (torchrun) on each node"),
        limit=RANKS,
    )
    nnodes: int = variable(
        "NNODES",
        1,
        parse=p.positive,
        doc=(
            "1, 0; in an `srun` step the step's node count and this node's id (`SLURM_STEP_NUM_NODES`, `SLURM_NODEID`)",
            "nodes of the run and this node's place among them: every node runs the script with the same "
            "settings and its own `NODE_RANK` (`NNODES*NPROC` processes in all; "
            "[docs/training.md](docs/training.md#many-nodes))",
        ),
        limit=RANKS,
    )
    vision_tp: int | None = variable(  # None: vision_ranks/layout.py's default
        "VISION_TP",
        parse=p.positive,
        doc=(
            "`TP`; with `VISION_NPROC`: a vision replica for each language one, else 1 where `VISION_NPROC` "
            "divides the language model's DP",
            "the vision tower's tensor-parallel size, the rest of its ranks its data parallelism; on the "
            "language model's ranks a divisor of `TP` (`vision_ranks/layout.py`)",
        ),
        flag="--vision-tensor-parallel-size",
        limit=RANKS,
    )
    vision_nproc: int = variable(
        "VISION_NPROC",
        0,
        parse=p.non_negative,
        doc=(
            "0: the tower runs on the language model's first-stage ranks",
            "ranks 0 .. `VISION_NPROC`-1 run only the vision tower, the others only the language model",
        ),
        flag="--vision-nproc",
        limit=RANKS,
    )

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def per_node(self) -> int:
        """Processes on each node (NPROC): unset, the fewest that hold the layout, shared by the nodes."""
        return (
            -(-(self.tp * self.cp * self.pp + self.vision_nproc) // self.nnodes) if self.nproc is None else self.nproc
        )

    @property
    def processes(self) -> int:
        """The world: every node's processes."""
        return self.per_node * self.nnodes

    @property
    def world_name(self) -> str:
        """How messages name the world: NPROC on one node, NNODES*NPROC on several."""
        return "NPROC" if self.nnodes == 1 else "NNODES*NPROC"

    @property
    def language_ranks(self) -> int:
        return self.processes - self.vision_nproc

    @property
    def dp(self) -> int:
        return self.language_ranks // (self.tp * self.cp * self.pp)

    def own_vision_layout(self) -> bool:
        """The tower has a layout of its own: its rank table is printed, a VISION_TP set is passed on."""
        return self.vision_nproc > 0 or (self.vision_tp or self.tp) != self.tp


@dataclass(frozen=True)
class Batch:
    train_iters: int = variable(
        "TRAIN_ITERS",
        30,
        parse=p.positive,
        doc=(
            "CPU: 30 2 4 1024 2e-3; GPU: 20 1 8 4096 1e-4",
            "iterations, micro / global batch, per-sample token budget, peak LR",
        ),
        flag="--train-iters",
        limit=ITERATIONS,
    )
    mbs: int = variable("MBS", 2, parse=p.positive, doc="TRAIN_ITERS", flag="--micro-batch-size")
    gbs: int = variable("GBS", 4, parse=p.positive, doc="TRAIN_ITERS", flag="--global-batch-size")
    seq_len: int = variable("SEQ_LEN", 1024, parse=p.positive, doc="TRAIN_ITERS", flag="--seq-length", limit=POSITIONS)
    packed: bool = variable(  # THD packing; False: padded BSHD
        "PACKED", True, parse=p.packed, doc=("1", "1: THD packing of each micro-batch; 0: padded BSHD")
    )
    packing: str = variable(  # or "tokens": one row of packed_seq_length a micro-batch
        "PACKING",
        "samples",
        parse=p.one_of("samples", "tokens"),
        doc=(
            "`samples`, `SEQ_LEN`",
            "`samples`: a micro-batch packs `MBS` conversations; `tokens`: a micro-batch is one row of "
            "`PACKED_SEQ_LENGTH` tokens, `GBS` counts rows, `MBS` is 1 ([docs/data.md](docs/data.md))",
        ),
        flag="--packing",
    )
    packed_seq_length: int | None = variable(  # derived: seq_len
        "PACKED_SEQ_LENGTH", parse=p.positive, doc="PACKING", flag="--packed-seq-length", limit=POSITIONS
    )

    @property
    def packed_length(self) -> int:
        return self.seq_len if self.packed_seq_length is None else self.packed_seq_length


@dataclass(frozen=True)
class Optimizer:
    """AdamW with a cosine schedule to lr * min_lr_ratio. ``lr`` prints as written, so the command
    shows the user's number."""

    lr: float = variable("LR", p.Written("2e-3"), parse=p.learning_rate, doc="TRAIN_ITERS", flag="--lr")
    warmup_iters: int | None = variable(  # derived: train_iters // 10
        "LR_WARMUP_ITERS",
        parse=p.count("iterations"),
        doc=(
            "`TRAIN_ITERS`/10, `TRAIN_ITERS`",
            "the LR schedule (cosine to LR/10); when resuming, setting either replaces the checkpoint's schedule",
        ),
        flag="--lr-warmup-iters",
        limit=ITERATIONS,
    )
    decay_iters: int | None = variable(  # derived: train_iters
        "LR_DECAY_ITERS", parse=p.count("iterations"), doc="LR_WARMUP_ITERS", flag="--lr-decay-iters", limit=ITERATIONS
    )
    min_lr_ratio: float = 0.1
    decay_style: str = "cosine"
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    clip_grad: float = 1.0
    seed: int = 1234

    @property
    def schedule_given(self) -> bool:
        """LR_WARMUP_ITERS or LR_DECAY_ITERS set: on resume they replace the checkpoint's schedule."""
        return self.warmup_iters is not None or self.decay_iters is not None


DATASETS = ("mock", "mock_mix", "mock_video", "cord_v2", "jsonl", "energon")
MOCK_DATASETS = DATASETS[:3]  # made in the run: they read no files


@dataclass(frozen=True)
class Data:
    dataset: str = variable(
        "DATASET",
        "mock",
        parse=p.one_of(*DATASETS, message=f" must be {', '.join(DATASETS[:-1])} or {DATASETS[-1]}"),
        doc=(
            "`mock`",
            "`mock` (no files), `mock_mix` (no files; the length and image mix of a real SFT set, "
            "`data/mock_mix.py`), `mock_video` (no files; the mock's images plus a video in half the "
            "conversations), `cord_v2`, `jsonl` (your own conversations) or `energon` (Megatron-Energon shards); "
            "the last three need `DATA_PATH`, `HF_PROCESSOR_PATH` ([docs/data.md](docs/data.md))",
        ),
        flag="--dataset-provider",
    )
    data_path: str | None = variable(
        "DATA_PATH",
        parse=p.text,
        doc=(
            "",
            "`cord_v2`, `jsonl`, `energon`: the data, and the Hugging Face processor (tokenizer and image processor)",
        ),
        flag="--data-path",
    )
    hf_processor_path: str | None = variable(
        "HF_PROCESSOR_PATH", parse=p.text, doc="DATA_PATH", flag="--hf-processor-path"
    )
    # the user's own data (jsonl; energon takes the switches and video settings)
    valid_data_path: str | None = variable(
        "VALID_DATA_PATH",
        parse=p.text,
        doc=(
            "none, 0",
            "`jsonl`: the validation records, or the fraction of `DATA_PATH`'s records held out for validation",
        ),
        flag="--eval-data-path",
    )
    valid_fraction: float | None = variable(
        "VALID_FRACTION", parse=p.fraction, doc="VALID_DATA_PATH", flag="--valid-fraction"
    )
    media_root: str | None = variable(
        "MEDIA_ROOT",
        parse=p.text,
        doc=("each JSONL's folder", "`jsonl`: where relative media paths resolve, and the folder media must lie in"),
        flag="--media-root",
    )
    strict: bool = variable(
        "STRICT_DATA",
        False,
        parse=p.switch(),
        doc=("0", "`jsonl`, `energon`: 1 stops the run at the first bad record in one line, instead of a counted skip"),
        flag="--strict-data",
    )
    remote_media: bool = variable(
        "REMOTE_MEDIA",
        False,
        parse=p.switch(),
        doc=("0", "`jsonl`: 1 fetches http(s) images and videos named in the records"),
        flag="--allow-remote-media",
    )
    media_anywhere: bool = variable(
        "MEDIA_ANYWHERE",
        False,
        parse=p.switch(),
        doc=("0", "`jsonl`: 1 admits media paths outside the JSONL's folder or `MEDIA_ROOT`"),
        flag="--allow-media-anywhere",
    )
    # the largest a record's own video keys may ask (data/video.py's OVERRIDE_LIMITS; a test holds them equal)
    video_fps: float | None = variable(
        "VIDEO_FPS",
        parse=p.positive_number("2, 0.5 or 5e-1"),
        doc=(
            "2, 768, qwen-vl-utils'",
            "`jsonl`, `energon`: frames sampled per second of video, the most frames, the largest area of one "
            "frame after resizing",
        ),
        flag="--video-fps",
        limit=(240, "no video needs more frames a second"),
    )
    video_max_frames: int | None = variable(
        "VIDEO_MAX_FRAMES",
        parse=p.positive,
        doc="VIDEO_FPS",
        flag="--video-max-frames",
        limit=(1 << 14, "no video needs more frames"),
    )
    video_max_pixels: int | None = variable(
        "VIDEO_MAX_PIXELS",
        parse=p.positive,
        doc="VIDEO_FPS",
        flag="--video-max-pixels",
        limit=(1 << 26, "a frame of 8192 x 8192"),
    )


@dataclass(frozen=True)
class Checkpoint:
    load: str | None = variable(  # weights to start from (--finetune)
        "CKPT_LOAD",
        parse=p.text,
        doc=(
            "",
            "start from these weights (`--finetune`: fresh optimizer, iteration 0); an import from Hugging Face "
            "also supplies the model shape",
        ),
    )
    save: str | None = variable(
        "CKPT_SAVE",
        parse=p.text,
        doc=(
            "`TRAIN_ITERS`",
            "save there every `SAVE_INTERVAL` iterations and at the end (with `CKPT_RESUME`: resume from "
            "`CKPT_RESUME`, save here)",
        ),
    )
    save_interval: int | None = variable(  # derived: train_iters
        "SAVE_INTERVAL", parse=p.positive, doc="CKPT_SAVE", limit=ITERATIONS
    )
    resume: str | None = variable(  # load from and save to: exact resume
        "CKPT_RESUME",
        parse=p.text,
        doc=(
            "",
            "load from and save to this directory: exact resume (weights, AdamW, LR schedule, RNG, data "
            "position); with `CKPT_LOAD` too, the first run starts from `CKPT_LOAD`'s weights (megatron's "
            "`--pretrained-checkpoint`) and later runs resume",
        ),
    )


@dataclass(frozen=True)
class Lora:
    rank: int = variable(  # 0: no adapters
        "LORA_RANK",
        0,
        parse=p.lora_rank,
        doc=(
            "0",
            "LoRA fine-tuning: adapters of this rank, every other weight frozen; with `CKPT_LOAD` (an import "
            "from Hugging Face) they adapt its weights ([docs/lora.md](docs/lora.md))",
        ),
        flag="--lora-rank",
        limit=(INT32, "an adapter's rank is a GEMM dimension, int32 in cuBLAS"),
    )
    alpha: float | None = variable(
        "LORA_ALPHA",
        parse=p.positive_number("16"),
        doc=(
            "`LORA_RANK`, every linear of the language model",
            "the adapters' scale alpha / rank, and the linears that get one (`lora/targets.py`)",
        ),
        flag="--lora-alpha",
    )
    targets: str | None = variable(  # None: lora/targets.py's DEFAULT_TARGETS
        "LORA_TARGETS", parse=p.text, doc="LORA_ALPHA", flag="--lora-targets"
    )
    base: str | None = variable(  # None: where the checkpoint's adapters name their base
        "LORA_BASE",
        parse=p.text,
        doc=(
            "where the checkpoint names it",
            "where the base of a LoRA checkpoint's adapters is now, if it moved since the save: a LoRA run's "
            "checkpoints hold the adapters, not the base ([docs/lora.md](docs/lora.md))",
        ),
        flag="--lora-base",
    )


@dataclass(frozen=True)
class PostTraining:
    mode: str | None = variable(  # derived: sft
        "TRAIN_MODE",
        parse=p.one_of("sft", "dpo", "grpo"),
        doc=(
            "`sft`",
            "`sft`: train on the answers; `dpo`: preference pairs of `DATASET=jsonl`; `grpo`: answers drawn "
            "on the training ranks for prompts of `DATASET=jsonl`, scored against their reference answers; "
            "both with the base, LoRA adapters off, as the reference ([docs/post_training.md](docs/post_training.md))",
        ),
        flag="--train-mode",
    )
    dpo_beta: float | None = variable(  # derived: 0.1 under dpo
        "DPO_BETA",
        parse=p.positive_number("0.1"),
        doc=("0.1", "`TRAIN_MODE=dpo`: beta, how far the policy may move from the reference"),
        flag="--dpo-beta",
    )
    grpo_samples: int | None = variable(  # derived: 8 under grpo
        "GRPO_SAMPLES",
        parse=p.positive,
        doc=("8", "`TRAIN_MODE=grpo`: answers drawn for each prompt (the group its advantages are taken in)"),
        flag="--grpo-samples",
    )
    grpo_max_new_tokens: int | None = variable(  # derived: 256 under grpo
        "GRPO_MAX_NEW_TOKENS",
        parse=p.positive,
        doc=("256", "`TRAIN_MODE=grpo`: the longest answer drawn, in tokens (within `SEQ_LEN` with its prompt)"),
        flag="--grpo-max-new-tokens",
    )
    grpo_reward: str | None = variable(  # derived: exact_match under grpo
        "GRPO_REWARD",
        parse=p.text,
        doc=(
            "`exact_match`",
            "`TRAIN_MODE=grpo`: the answers' reward, `exact_match`, `token_f1`, `anls`, `field_f1` or "
            "`tree_accuracy` against the reference, or `python:module.function` to run a function of yours",
        ),
        flag="--grpo-reward",
    )
    grpo_kl_weight: float | None = variable(  # derived: 0.04 under grpo
        "GRPO_KL_WEIGHT",
        parse=p.non_negative_number("0.04"),
        doc=("0.04", "`TRAIN_MODE=grpo`: the KL term's weight (0: no reference forward)"),
        flag="--grpo-kl-weight",
    )
    grpo_clip: float | None = variable(  # derived: 0.2 under grpo
        "GRPO_CLIP",
        parse=p.fraction,
        doc=("0.2", "`TRAIN_MODE=grpo`: how far the policy's ratio to the decoder's may move before it is clipped"),
        flag="--grpo-clip",
    )


@dataclass(frozen=True)
class Evaluation:
    interval: int | None = None  # derived: train_iters (once, at the end)
    iters: int = 2
    log_interval: int = 1


@dataclass(frozen=True)
class Backend:
    transformer_impl: str | None = variable(  # derived: the host's
        "TRANSFORMER_IMPL",
        parse=p.one_of("transformer_engine", "local"),
        doc=(
            "`transformer_engine` on a GPU host where it imports, else `local` (the script says which)",
            "module backend; both write the same checkpoint keys (Transformer Engine / Megatron-Bridge names)",
        ),
        flag="--transformer-impl",
    )
    grouped_experts: bool | None = variable(  # derived: on unless LoRA adapts experts on TE
        "GROUPED_EXPERTS",
        parse=p.switch(" (1: grouped GEMM experts, 0: SequentialMLP)"),
        doc=(
            "1 for MoE, 0 with LoRA on `linear_fc1` / `linear_fc2` on `transformer_engine`",
            "1: each MoE layer's routed experts as two grouped GEMMs (`--moe-grouped-gemm`: "
            "`models/common/grouped_experts.py` on `local`, megatron's `TEGroupedMLP` on `transformer_engine`); "
            "0: megatron-core's `SequentialMLP`, one MLP call per expert. Same checkpoint keys either way, "
            "LoRA's adapters included (`lora/grouped.py` on the local grouped experts)",
        ),
        flag="--moe-grouped-gemm",
    )
    dispatcher: str | None = variable(  # derived: alltoall on GPUs where ep > 1
        "MOE_DISPATCHER",
        parse=p.one_of("allgather", "alltoall"),
        doc=(
            "`alltoall` on GPUs where `EP>1`, else `allgather` (the script says which)",
            "the MoE token dispatcher (`--moe-token-dispatcher-type`): `allgather` or `alltoall` (GPUs only: "
            "gloo has no uneven all-to-all)",
        ),
        flag="--moe-token-dispatcher-type",
    )


@dataclass(frozen=True)
class Launcher:
    dry_run: bool = variable(
        "DRY_RUN",
        False,
        parse=p.switch(),
        doc=(
            "0",
            "1: print the command and exit, with the layout the planner chooses for `GPUS` H100s "
            "([docs/planner.md](docs/planner.md))",
        ),
    )
    gpus: int | None = variable(  # DRY_RUN: the cluster to plan a layout for
        "GPUS",
        parse=p.positive,
        doc=(
            "`9b` ... `397b_a17b`: the count in [docs/planner.md](docs/planner.md)",
            "`DRY_RUN` only: the cluster's GPU count to plan for",
        ),
        limit=RANKS,
    )
    node_rank: int = variable("NODE_RANK", 0, parse=p.non_negative, doc="NNODES", limit=RANKS)
    master_addr: str | None = variable(  # node 0's host, where several nodes meet
        "MASTER_ADDR",
        parse=p.text,
        doc=(
            "unset; in an `srun` step the first host of `SLURM_STEP_NODELIST`",
            "`NNODES>1`: the host of node 0, where the ranks meet (torchrun's static rendezvous on `MASTER_PORT`)",
        ),
    )
    master_port: int | None = variable(  # None: torchrun --standalone picks a free one
        "MASTER_PORT",
        parse=p.positive,
        doc=(
            "a free port (`torchrun --standalone`); 29500 where `NNODES>1`",
            "rendezvous port on `MASTER_ADDR`, the same on every node",
        ),
        limit=(65535, "the largest TCP port"),
    )
    join_timeout: int = variable(  # seconds node 0 waits for every node to join
        "JOIN_TIMEOUT",
        600,
        parse=p.positive,
        doc=(
            "600",
            "`NNODES>1`: seconds node 0 waits for every node to join; then every node stops on one line naming "
            "the nodes that never joined (a node that cannot reach node 0 in that time names it)",
        ),
        limit=(7 * 24 * 3600, "a week: a node not there by then is not coming"),
    )
    # minutes a collective waits for a rank before the run stops (megatron's --distributed-timeout-minutes)
    collective_timeout: int | None = variable(  # derived: megatron's 10
        "COLLECTIVE_TIMEOUT",
        parse=p.positive,
        doc=(
            "10 (megatron's)",
            "minutes a collective waits for a rank that does not come (a node that hangs) before the run stops "
            "(`--distributed-timeout-minutes`); a node that dies stops the others at once",
        ),
        limit=(7 * 24 * 60, "a week: a rank not there by then is not coming"),
    )
    fork_ranks: bool | None = variable(  # read again by launcher/torchrun.py, which starts the ranks
        "FORK_RANKS",
        parse=p.switch(),
        doc=(
            "1 without CUDA where `NPROC` exceeds the cores, else 0",
            "1: the ranks fork from one process that imported torch, megatron-core and transformers once (about "
            "6 s of CPU saved a rank, where the ranks would queue for the cores to import); 0: each rank is a "
            "fresh interpreter, as torchrun starts it (`launcher/torchrun.py`)",
        ),
    )
    unchecked: tuple[str, ...] = variable(
        "UNCHECKED_VARIABLES",
        (),
        parse=p.names,
        doc=(
            "",
            "variables of your own that the script would take for a misspelling of one of its own (`TRAIN_ITER` "
            "for `TRAIN_ITERS`, `lr` for `LR`), comma-separated: they pass unread",
        ),
    )


@dataclass(frozen=True)
class RunConfig:
    model: Model = field(default_factory=Model)
    layout: Layout = field(default_factory=Layout)
    batch: Batch = field(default_factory=Batch)
    optimizer: Optimizer = field(default_factory=Optimizer)
    data: Data = field(default_factory=Data)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    lora: Lora = field(default_factory=Lora)
    post_training: PostTraining = field(default_factory=PostTraining)
    evaluation: Evaluation = field(default_factory=Evaluation)
    backend: Backend = field(default_factory=Backend)
    launcher: Launcher = field(default_factory=Launcher)

    def variables(self) -> dict[str, Any]:
        """Each variable's value in this run (None where unset and derived)."""
        return {setting.name: getattr(getattr(self, section), name) for section, name, setting in settings()}


@functools.cache
def settings() -> tuple[tuple[str, str, Setting], ...]:
    """Every declared setting as (section, field, declaration), in the order of the declarations."""
    found = []
    for section in fields(RunConfig):
        for f in fields(section.default_factory()):  # type: ignore[misc]
            if "setting" in f.metadata:
                found.append((section.name, f.name, f.metadata["setting"]))
    return tuple(found)


def variable_fields() -> dict[str, tuple[str, str]]:
    """Variable name -> (section, field) of the field it sets."""
    return {setting.name: (section, name) for section, name, setting in settings()}
