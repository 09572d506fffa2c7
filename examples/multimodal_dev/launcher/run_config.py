"""A run of ``run_qwen35_vl.sh`` as one typed value: frozen sections of settings, each field that a
variable of ``variables.py`` sets naming it (``variable("TP")``), the rest recipe settings that no
variable reaches (the optimizer's betas, the evaluation cadence, the seed).

A recipe (``recipes.py``) gives the defaults, ``from_env.py`` lays the environment over them,
``checks.py`` refuses what cannot run, and ``megatron_argv.py`` writes megatron's flags. ``None`` in a
field marked *derived* means "follow the other settings" (``etp`` is ``tp``), resolved where it is
read, so a recipe's value is never lost to a default computed too early.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


class LaunchError(ValueError):
    """A setting that cannot run: printed as one line naming it, exit status 2."""


def variable(name: str, default: Any = None) -> Any:
    """A field the environment variable ``name`` sets."""
    return field(default=default, metadata={"variable": name})


@dataclass(frozen=True)
class Model:
    variant: str = variable("MODEL_VARIANT", "tiny")  # "hf_config" where HF_CONFIG gives the shape
    hf_config: str | None = variable("HF_CONFIG")
    moe: bool = variable("MOE", False)  # tiny only: 4 experts (top-2)
    mtp: bool | None = variable("MTP")  # derived: on where the Hugging Face config has an MTP head


@dataclass(frozen=True)
class Layout:
    tp: int = variable("TP", 1)
    cp: int = variable("CP", 1)
    ep: int = variable("EP", 1)
    pp: int = variable("PP", 1)
    etp: int | None = variable("ETP")  # derived: tp
    vp: int = variable("VP", 1)
    pp_first: int = variable("PP_FIRST", 0)  # 0: megatron-core's even split
    pp_last: int = variable("PP_LAST", 0)
    sp: bool | None = variable("SP")  # derived: on for MoE with tp > 1 (megatron-core requires it)
    nproc: int | None = variable("NPROC")  # on each node; derived: (tp * cp * pp + vision_nproc) / nnodes
    nnodes: int = variable("NNODES", 1)
    vision_tp: int | None = variable("VISION_TP")  # None: vision_ranks/layout.py's default
    vision_nproc: int = variable("VISION_NPROC", 0)
    fsdp: bool = variable("FSDP", False)  # Megatron-FSDP over the data-parallel ranks

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
    train_iters: int = variable("TRAIN_ITERS", 30)
    mbs: int = variable("MBS", 2)
    gbs: int = variable("GBS", 4)
    seq_len: int = variable("SEQ_LEN", 1024)
    packed: bool = variable("PACKED", True)  # THD packing; False: padded BSHD
    packing: str = variable("PACKING", "samples")  # or "tokens": one row of packed_seq_length a micro-batch
    packed_seq_length: int | None = variable("PACKED_SEQ_LENGTH")  # derived: seq_len

    @property
    def packed_length(self) -> int:
        return self.seq_len if self.packed_seq_length is None else self.packed_seq_length


@dataclass(frozen=True)
class Optimizer:
    """AdamW with a cosine schedule to lr * min_lr_ratio. ``lr`` stays as written, so the command
    shows the user's number."""

    lr: str = variable("LR", "2e-3")
    warmup_iters: int | None = variable("LR_WARMUP_ITERS")  # derived: train_iters // 10
    decay_iters: int | None = variable("LR_DECAY_ITERS")  # derived: train_iters
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


@dataclass(frozen=True)
class Data:
    dataset: str = variable("DATASET", "mock")
    data_path: str | None = variable("DATA_PATH")
    hf_processor_path: str | None = variable("HF_PROCESSOR_PATH")
    # the user's own data (jsonl; energon takes the switches and video settings)
    valid_data_path: str | None = variable("VALID_DATA_PATH")
    valid_fraction: str | None = variable("VALID_FRACTION")
    media_root: str | None = variable("MEDIA_ROOT")
    strict: bool = variable("STRICT_DATA", False)
    remote_media: bool = variable("REMOTE_MEDIA", False)
    media_anywhere: bool = variable("MEDIA_ANYWHERE", False)
    video_fps: str | None = variable("VIDEO_FPS")
    video_max_frames: int | None = variable("VIDEO_MAX_FRAMES")
    video_max_pixels: int | None = variable("VIDEO_MAX_PIXELS")


@dataclass(frozen=True)
class Checkpoint:
    load: str | None = variable("CKPT_LOAD")  # weights to start from (--finetune)
    save: str | None = variable("CKPT_SAVE")
    save_interval: int | None = variable("SAVE_INTERVAL")  # derived: train_iters
    resume: str | None = variable("CKPT_RESUME")  # load from and save to: exact resume


@dataclass(frozen=True)
class Lora:
    rank: int = variable("LORA_RANK", 0)  # 0: no adapters
    alpha: str | None = variable("LORA_ALPHA")
    targets: str | None = variable("LORA_TARGETS")  # None: lora/targets.py's DEFAULT_TARGETS
    base: str | None = variable("LORA_BASE")  # None: where the checkpoint's adapters name their base


@dataclass(frozen=True)
class Evaluation:
    interval: int | None = None  # derived: train_iters (once, at the end)
    iters: int = 2
    log_interval: int = 1


@dataclass(frozen=True)
class Backend:
    transformer_impl: str | None = variable("TRANSFORMER_IMPL")  # derived: the host's
    grouped_experts: bool | None = variable("GROUPED_EXPERTS")  # derived: on unless LoRA adapts experts
    dispatcher: str | None = variable("MOE_DISPATCHER")  # derived: alltoall on GPUs where ep > 1


@dataclass(frozen=True)
class Launcher:
    master_port: int | None = variable("MASTER_PORT")  # None: torchrun --standalone picks a free one
    node_rank: int = variable("NODE_RANK", 0)
    master_addr: str | None = variable("MASTER_ADDR")  # node 0's host, where several nodes meet
    join_timeout: int = variable("JOIN_TIMEOUT", 600)  # seconds node 0 waits for every node to join
    # minutes a collective waits for a rank before the run stops (megatron's --distributed-timeout-minutes)
    collective_timeout: int | None = variable("COLLECTIVE_TIMEOUT")  # derived: megatron's 10
    dry_run: bool = variable("DRY_RUN", False)
    gpus: int | None = variable("GPUS")  # DRY_RUN: the cluster to plan a layout for


@dataclass(frozen=True)
class RunConfig:
    model: Model = field(default_factory=Model)
    layout: Layout = field(default_factory=Layout)
    batch: Batch = field(default_factory=Batch)
    optimizer: Optimizer = field(default_factory=Optimizer)
    data: Data = field(default_factory=Data)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    lora: Lora = field(default_factory=Lora)
    evaluation: Evaluation = field(default_factory=Evaluation)
    backend: Backend = field(default_factory=Backend)
    launcher: Launcher = field(default_factory=Launcher)

    def variables(self) -> dict[str, Any]:
        """Each variable's value in this run (None where unset and derived)."""
        return {
            f.metadata["variable"]: getattr(getattr(self, section.name), f.name)
            for section in fields(self)
            for f in fields(getattr(self, section.name))
            if "variable" in f.metadata
        }


def variable_fields() -> dict[str, tuple[str, str]]:
    """Variable name -> (section, field) of the field it sets."""
    found = {}
    for section in fields(RunConfig):
        for f in fields(section.default_factory()):  # type: ignore[misc]
            if "variable" in f.metadata:
                found[f.metadata["variable"]] = (section.name, f.name)
    return found
