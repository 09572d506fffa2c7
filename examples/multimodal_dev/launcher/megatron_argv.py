"""A checked ``RunConfig`` as the training script's flags (megatron's and ``arguments.py``'s), and the
lines the launch says about the choices it made.

The model is named (``--model-variant``, ``--hf-config-path``); its numbers come from the one variant
table (``models/qwen35_vl/configuration.py``) or the Hugging Face config, and the training script makes
them the defaults of megatron's model flags (``models/megatron_args.py``)."""

from __future__ import annotations

import os

from ..models import DEFAULT_ARCH
from .from_env import Host, lora_on_experts
from .roll_call import BACKEND
from .run_config import RunConfig
from .variables import SETTINGS

MODULE = "examples.multimodal_dev.pretrain_multimodal"
DEFAULT_PORT = 29500  # where several nodes meet unless MASTER_PORT says otherwise: every node must agree
FLAG = {setting.name: setting.flag for setting in SETTINGS if setting.flag}  # run_config.py's declarations
# The variables whose flags are one-to-one, written where megatron's command shows them: a value as
# it is, a switch as its flag alone, unset and off not at all
SIZES = ("TP", "CP", "EP", "ETP", "PP", "MBS", "GBS")
OWN_DATA = (  # the user's-data settings
    *("VALID_DATA_PATH", "VALID_FRACTION", "MEDIA_ROOT", "STRICT_DATA", "REMOTE_MEDIA", "MEDIA_ANYWHERE"),
    *("VIDEO_FPS", "VIDEO_MAX_FRAMES", "VIDEO_MAX_PIXELS"),
)
DATA = ("DATA_PATH", "HF_PROCESSOR_PATH")
LORA = ("LORA_RANK", "LORA_ALPHA", "LORA_TARGETS", "LORA_BASE")
# The variables whose flags the functions below write in a form of their own (a switch that is the
# flag's absence, a flag only past its default, a value resolved from others)
WRITTEN_BELOW = (
    *("SEQ_LEN", "TRAIN_ITERS", "LR", "LR_WARMUP_ITERS", "LR_DECAY_ITERS", "DATASET", "PACKING", "PACKED_SEQ_LENGTH"),
    *("VP", "PP_FIRST", "PP_LAST", "SP", "FSDP", "VISION_TP", "VISION_NPROC"),
    *("GROUPED_EXPERTS", "MOE_DISPATCHER", "TRANSFORMER_IMPL"),
)
# The rest, written after them: a variable declared with a flag reaches megatron with nothing written here
ONE_TO_ONE_REST = tuple(name for name in FLAG if name not in {*SIZES, *OWN_DATA, *DATA, *LORA, *WRITTEN_BELOW})


def _resolved(config: RunConfig) -> dict[str, object]:
    """Each variable's value as the run uses it: the derived ones followed."""
    values = config.variables()
    values["ETP"] = config.layout.expert_tp
    return values


def one_to_one(config: RunConfig, names: tuple[str, ...]) -> list[str]:
    """The flags of ``names`` (variables declared with a flag), in that order."""
    values, flags = _resolved(config), []
    for name in names:
        value = values[name]
        if value is True:
            flags.append(FLAG[name])
        elif value not in (None, False):
            flags += [FLAG[name], str(value)]
    return flags


def _pairs(*pairs: tuple[str, object]) -> list[str]:
    return [str(word) for pair in pairs for word in pair]


def _model(config: RunConfig) -> list[str]:
    m = config.model
    if m.hf_config:
        return ["--hf-config-path", m.hf_config]
    return ["--variant-moe", "on"] if m.moe else []


def _schedule(config: RunConfig) -> list[str]:
    o, b, e = config.optimizer, config.batch, config.evaluation
    warmup = b.train_iters // 10 if o.warmup_iters is None else o.warmup_iters
    return [
        *_pairs(("--train-iters", b.train_iters), ("--lr", o.lr), ("--min-lr", f"{float(o.lr) * o.min_lr_ratio:.6g}")),
        *_pairs(("--lr-decay-style", o.decay_style), ("--lr-warmup-iters", warmup)),
        *_pairs(("--lr-decay-iters", b.train_iters if o.decay_iters is None else o.decay_iters)),
        *_pairs(("--weight-decay", o.weight_decay), ("--adam-beta1", o.beta1), ("--adam-beta2", o.beta2)),
        *_pairs(("--clip-grad", o.clip_grad)),
        "--calculate-per-token-loss",
        *_pairs(("--log-interval", e.log_interval), ("--eval-interval", e.interval or b.train_iters)),
        *_pairs(("--eval-iters", e.iters), ("--dataset-provider", config.data.dataset), ("--seed", o.seed)),
    ]


def _layout(config: RunConfig) -> list[str]:
    lay, b = config.layout, config.batch
    flags = [] if b.packed else ["--no-packed-sequence"]
    flags += [] if b.packing == "samples" else _pairs(("--packing", "tokens"), ("--packed-seq-length", b.packed_length))
    flags += _pairs(("--num-virtual-stages-per-pipeline-rank", lay.vp)) if lay.vp > 1 else []
    if lay.vision_tp and lay.own_vision_layout():
        flags += _pairs(("--vision-tensor-parallel-size", lay.vision_tp))
    # the tower on ranks of its own sums its grad norm over the world's distributed-optimizer shards
    flags += [*_pairs(("--vision-nproc", lay.vision_nproc)), "--use-distributed-optimizer"] if lay.vision_nproc else []
    flags += _pairs(("--decoder-first-pipeline-num-layers", lay.pp_first)) if lay.pp_first else []
    flags += _pairs(("--decoder-last-pipeline-num-layers", lay.pp_last)) if lay.pp_last else []
    flags += ["--sequence-parallel"] if lay.sp else []
    # megatron-core 0.19.2's Megatron-FSDP saves and loads fsdp_dtensor only; optim_grads_params shards all three
    flags += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"] if lay.fsdp else []
    flags += ["--ckpt-format", "fsdp_dtensor"] if lay.fsdp else []
    # megatron's argument check admits MTP only with rotary positions; the model's interleaved MRoPE is
    # built from the variant, so this flag only satisfies that check
    flags += ["--mtp-num-layers", "1", "--position-embedding-type", "rope"] if config.model.mtp else []
    return flags


def _data_and_lora(config: RunConfig) -> list[str]:
    # LORA_RANK=0 writes no flag; the checks refuse the others without it
    return one_to_one(config, DATA) + (one_to_one(config, LORA) if config.lora.rank else [])


def _experts(config: RunConfig) -> list[str]:
    b = config.backend
    if b.dispatcher is None:  # a dense model
        return []
    return ["--moe-token-dispatcher-type", b.dispatcher] + (["--moe-grouped-gemm"] if b.grouped_experts else [])


def _backend(config: RunConfig, host: Host) -> list[str]:
    # --log-throughput: model TFLOP/s from models/qwen35_vl/flops.py (megatron's GPT formula is replaced)
    precision = ["--bf16"] if host.gpu else ["--distributed-backend", "gloo"]
    minutes = config.launcher.collective_timeout
    timeout = _pairs(("--distributed-timeout-minutes", minutes)) if minutes else []
    return ["--transformer-impl", str(config.backend.transformer_impl), "--log-throughput", *precision, *timeout]


def resumes_saved(config: RunConfig) -> bool:
    """CKPT_RESUME holds a checkpoint already (a later run of the same training)."""
    resume = config.checkpoint.resume
    return bool(resume) and os.path.isfile(os.path.join(resume, "latest_checkpointed_iteration.txt"))


def _checkpoints(config: RunConfig) -> list[str]:
    c = config.checkpoint
    interval = c.save_interval or config.batch.train_iters
    if not c.resume:
        return (["--load", c.load, "--finetune"] if c.load else []) + (
            _pairs(("--save", c.save), ("--save-interval", interval)) if c.save else []
        )
    # CKPT_LOAD with CKPT_RESUME: the first run starts from CKPT_LOAD's weights (megatron loads
    # --pretrained-checkpoint, as --finetune, while the resume directory holds no checkpoint); later runs resume
    flags = _pairs(("--load", c.resume), ("--save", c.save or c.resume), ("--save-interval", interval))
    flags += ["--pretrained-checkpoint", c.load] if c.load else []
    if resumes_saved(config):
        # megatron refuses a schedule that differs from the checkpoint's: keep the saved one (a longer
        # TRAIN_ITERS then extends the run at its final LR) unless the user sets one explicitly
        given = config.optimizer.schedule_given
        flags.append("--override-opt_param-scheduler" if given else "--use-checkpoint-opt_param-scheduler")
    return flags


def to_megatron_argv(config: RunConfig, host: Host) -> list[str]:
    """The training script's arguments for a checked, resolved run (``launch.argv_of`` makes one)."""
    if config.backend.transformer_impl is None:
        raise ValueError("the run is not resolved for a host (launch.argv_of resolves and checks it)")
    b = config.batch
    named = _pairs(
        ("--model-arch", DEFAULT_ARCH), ("--model-variant", config.model.variant), ("--seq-length", b.seq_len)
    )
    return [
        *named,
        *one_to_one(config, SIZES),
        *_schedule(config),
        *_model(config),
        *one_to_one(config, OWN_DATA),
        *_layout(config),
        *_data_and_lora(config),
        *_experts(config),
        *_backend(config, host),
        *_checkpoints(config),
        *one_to_one(config, ONE_TO_ONE_REST),
    ]


def torchrun_argv(config: RunConfig, host: Host, extra: list[str]) -> list[str]:
    """torchrun's own arguments, then the training script's and the user's ``extra`` flags. Several runs
    may share a host: without MASTER_PORT, torchrun --standalone picks a free port."""
    launch, nnodes = config.launcher, config.layout.nnodes
    if nnodes > 1:  # a static rendezvous with a roll call (roll_call.py): node 0 holds the store, ranks by node
        endpoint = f"{launch.master_addr}:{launch.master_port or DEFAULT_PORT}"
        conf = f"rank={launch.node_rank},timeout={launch.join_timeout}"
        rdzv = _pairs(("--nnodes", nnodes), ("--rdzv-backend", BACKEND), ("--rdzv-endpoint", endpoint))
        rdzv += _pairs(("--rdzv-conf", conf))
    else:
        rdzv = ["--master-port", str(launch.master_port)] if launch.master_port else ["--standalone"]
    # the training script runs as a module of the package examples.multimodal_dev (PYTHONPATH holds the
    # repository root), so no folder of the example shadows an installed package
    nproc = ["--nproc-per-node", str(config.layout.per_node)]
    return [*nproc, *rdzv, "--module", MODULE, *to_megatron_argv(config, host), *extra]


def said_after_checks(config: RunConfig) -> tuple[list[str], list[str]]:
    """(the MoE line, the resume line): what the launch says about the experts and the schedule it chose."""
    b, ep = config.backend, config.layout.ep
    moe = []
    if b.dispatcher is not None:
        adapted = " (LoRA adapts them)" if lora_on_experts(config) else ""
        experts = ("grouped GEMM experts" if b.grouped_experts else "SequentialMLP experts") + adapted
        unsynced = " (dropless: no host syncs)" if b.grouped_experts and ep == 1 and b.dispatcher == "allgather" else ""
        moe.append(
            f"MoE: {experts}, {b.dispatcher} token dispatcher at EP={ep}{unsynced} "
            "(GROUPED_EXPERTS, MOE_DISPATCHER override)"
        )
    resume = []
    if resumes_saved(config):
        resume.append(
            "resuming with the LR schedule of LR_WARMUP_ITERS / LR_DECAY_ITERS"
            if config.optimizer.schedule_given
            else "resuming with the checkpoint's LR schedule (LR_WARMUP_ITERS / LR_DECAY_ITERS replace it)"
        )
    return moe, resume
