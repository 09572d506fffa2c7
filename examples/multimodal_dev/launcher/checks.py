"""Every check of a run before any rank starts, once, in the order of ``CHECKS``: each takes the run,
the model's shape and the host, and answers None or one line naming the variables and their values.
``validate`` raises the first. The training script runs the same checks (all but ``nodes``) on the
run it rebuilds from its flags (``from_args.py``), the user's extra flags included, and names the flags
beside the variables; what it checks beyond these concerns megatron's own flags (``checked_args.py``)."""

from __future__ import annotations

from collections.abc import Callable

from ..models import ModelShape, model_of
from ..models.setting_names import FSDP_REFUSALS, REWARD_NAMES, VARIABLES, schedule_problem
from ..planner.pipeline_layout import stage_layers
from ..vision_ranks.layout import env_table
from . import megatron_argv
from .from_env import Host, lora_in_vision, lora_on_experts
from .run_config import MOCK_DATASETS, LaunchError, RunConfig
from .variables import limit_problem

Check = Callable[[RunConfig, ModelShape, Host], "str | None"]


def within_limits(config: RunConfig, shape: ModelShape, host: Host) -> str | None:
    """``variables.LIMITS``, before any value sizes work."""
    given = {k: str(v) for k, v in config.variables().items() if v is not None and not isinstance(v, bool)}
    return limit_problem(given)


def lr_schedule(config: RunConfig, shape: ModelShape, host: Host) -> str | None:
    o = config.optimizer
    return schedule_problem(o.warmup_iters, o.decay_iters, config.batch.train_iters, names=VARIABLES)


def pipeline_split(config: RunConfig, shape: ModelShape, host: Host) -> str | None:
    """The split of the decoder over pipeline stages (megatron-core's rule, checked by name)."""
    lay = config.layout
    try:
        stage_layers(shape.text.num_layers, lay.pp, lay.vp, lay.pp_first or None, lay.pp_last or None, names=VARIABLES)
    except (KeyError, ValueError) as err:
        return err.args[0]
    return None


def parallel_sizes(config: RunConfig, shape: ModelShape, host: Host) -> str | None:
    """Sequence parallelism, CP's chunks, the model's own splits (heads, Gated DeltaNet heads,
    experts), then the process counts."""
    lay, t = config.layout, shape.text
    tp, cp, ep, etp, pp, lang = lay.tp, lay.cp, lay.ep, lay.expert_tp, lay.pp, lay.language_ranks
    lang_name = f"({lay.world_name}-VISION_NPROC)" if lay.vision_nproc else lay.world_name
    seq_len = config.batch.seq_len
    first = (
        (not lay.sp or tp > 1, "SP=1 needs TP>1 (sequence parallelism splits the sequence over TP ranks)"),
        (
            seq_len % (2 * cp) == 0,
            f"SEQ_LEN={seq_len} must be a multiple of 2*CP={2 * cp} "
            "(context parallelism cuts every sample into 2*CP chunks)",
        ),
        (
            lay.sp or tp == 1 or not t.is_moe,
            f"SP=0 with TP={tp}: megatron-core requires sequence parallelism for MoE with TP>1",
        ),
    )
    variant = config.model.variant
    model = [
        f"{line} ({variant})"
        for line in model_of(shape).parallel_problems(shape, tp, cp, ep, names=VARIABLES, vision=False)
    ]
    world = f"{lay.world_name}={lay.processes}"
    ranks = (
        (lang > 0, f"VISION_NPROC={lay.vision_nproc} leaves no ranks for the language model ({world})"),
        (lang % (tp * cp * pp) == 0, f"{lang_name}={lang} is not divisible by TP*CP*PP={tp * cp * pp}"),
        ((lang // pp) % (ep * etp) == 0, f"EP={ep}: {lang_name}/PP={lang // pp} is not divisible by EP*ETP={ep * etp}"),
    )
    problems = [m for ok, m in first if not ok] + model + [m for ok, m in ranks if not ok]
    return problems[0] if problems else None


def nodes(config: RunConfig, shape: ModelShape, host: Host) -> str | None:
    """Where the nodes meet, and this node's place among them."""
    lay, launch = config.layout, config.launcher
    if launch.node_rank >= lay.nnodes:
        return f"NODE_RANK={launch.node_rank} must be below NNODES={lay.nnodes} (nodes count from 0)"
    if lay.nnodes > 1 and not launch.master_addr:
        return f"NNODES={lay.nnodes} needs MASTER_ADDR: the host of node 0, where the nodes meet"
    return None


def batch(config: RunConfig, shape: ModelShape, host: Host) -> str | None:
    b, dp = config.batch, config.layout.dp
    return f"GBS={b.gbs} is not a multiple of MBS*DP={b.mbs * dp}" if b.gbs % (b.mbs * dp) else None


def vision_layout(config: RunConfig, shape: ModelShape, host: Host) -> str | None:
    """The vision tower's own ranks and TP / DP, refused by name where megatron-core cannot run them."""
    try:
        vision_table(config, shape)
    except ValueError as err:
        return err.args[0]
    return None


def vision_table(config: RunConfig, shape: ModelShape) -> list[str]:
    lay = config.layout
    args = (lay.processes, lay.tp, lay.cp, lay.pp, lay.vp, lay.vision_tp, lay.vision_nproc, shape.vision.num_heads)
    return env_table(*args)


OWN_DATA = megatron_argv.OWN_DATA  # the user's-data variables


def data(config: RunConfig, shape: ModelShape, host: Host) -> str | None:
    """The files a dataset needs, and the user's-data variables where they apply."""
    d, given = config.data, config.variables()
    if d.dataset in MOCK_DATASETS:  # made in the run: a path given would be dropped without a word
        for name in ("DATA_PATH", "HF_PROCESSOR_PATH"):
            if given[name]:
                return f"{name}={given[name]} with DATASET={d.dataset}: the mock data reads no files (set DATASET)"
    if d.dataset in ("cord_v2", "jsonl", "energon"):
        for name in ("DATA_PATH", "HF_PROCESSOR_PATH"):
            if not given[name]:
                return f"DATASET={d.dataset} needs {name}"
    if d.dataset not in ("jsonl", "energon") and any(given[name] not in (None, False) for name in OWN_DATA):
        return (
            "VALID_DATA_PATH, VALID_FRACTION, MEDIA_ROOT, STRICT_DATA, REMOTE_MEDIA, MEDIA_ANYWHERE and "
            f"VIDEO_* apply to DATASET=jsonl (and energon) only (DATASET={d.dataset})"
        )
    if d.dataset == "energon":  # the shards hold the media; validation is the dataset's val split
        for name in ("VALID_DATA_PATH", "VALID_FRACTION", "MEDIA_ROOT", "REMOTE_MEDIA", "MEDIA_ANYWHERE"):
            if given[name] not in (None, False):
                return f"{name} applies to DATASET=jsonl; an energon dataset carries its media and its val split"
    return None


def lora(config: RunConfig, shape: ModelShape, host: Host) -> str | None:
    """LORA_ALPHA, LORA_TARGETS and LORA_BASE would be dropped without adapters, and every weight would train."""
    lora = config.lora
    for name, value in (("LORA_ALPHA", lora.alpha), ("LORA_TARGETS", lora.targets), ("LORA_BASE", lora.base)):
        if value and not config.lora.rank:
            return f"{name}={value} without LORA_RANK: there are no adapters (set LORA_RANK)"
    return None


GRPO_SETTINGS = ("samples", "max_new_tokens", "reward", "kl_weight", "clip")  # PostTraining's grpo_* fields


def post_training(config: RunConfig, shape: ModelShape, host: Host) -> str | None:
    """What DPO and GRPO read and what they do not run with yet, by name (docs/post_training.md)."""
    post, lay = config.post_training, config.layout
    if post.dpo_beta is not None and post.mode != "dpo":
        return f"DPO_BETA={post.dpo_beta} without TRAIN_MODE=dpo: there is no preference loss (set TRAIN_MODE=dpo)"
    for name in GRPO_SETTINGS:
        value = getattr(post, f"grpo_{name}")
        if value is not None and post.mode != "grpo":
            return f"GRPO_{name.upper()}={value} without TRAIN_MODE=grpo: no answers are drawn (set TRAIN_MODE=grpo)"
    if post.mode not in ("dpo", "grpo"):
        return None
    mode = post.mode
    records = "preference pairs" if mode == "dpo" else "prompts with reference answers"
    refused = (
        (config.data.dataset != "jsonl", f"DATASET={config.data.dataset}", f"{records} are JSONL records"),
        (
            not config.lora.rank,
            "LORA_RANK unset",
            "the reference is the base with the adapters off (set LORA_RANK; a reference checkpoint of its own "
            "is not supported yet)",
        ),
        (mode == "grpo" and lay.pp > 1, f"PP={lay.pp}", "the answers are drawn by the decoder, which runs at PP=1"),
        (mode == "grpo" and lay.cp > 1, f"CP={lay.cp}", "the answers are drawn by the decoder, which runs at CP=1"),
        (
            mode == "grpo" and lay.vision_nproc > 0,
            f"VISION_NPROC={lay.vision_nproc}",
            "the answers are drawn by the decoder, which runs the tower on the language model's ranks",
        ),
        (
            lay.vision_nproc > 0 and lora_in_vision(config),
            f"VISION_NPROC={lay.vision_nproc} and adapters in the vision tower (LORA_TARGETS)",
            "the tower on ranks of its own sends its features once a step, for the policy and the reference "
            "alike, which needs them equal (leave the tower's linears out of LORA_TARGETS)",
        ),
        (config.batch.packing == "tokens", "PACKING=tokens", "MBS records a micro-batch, each packed whole"),
        (bool(config.model.mtp), "MTP=1", f"the MTP head has no {mode.upper()} loss (MTP=0)"),
    )
    for bad, setting, why in refused:
        if bad:
            return f"TRAIN_MODE={mode} with {setting}: {why}"
    return _grpo_settings(post, config.batch.seq_len) if mode == "grpo" else None


def _grpo_settings(post, seq_len: int) -> str | None:
    reward = post.grpo_reward
    if reward is not None and reward not in REWARD_NAMES and not reward.startswith("python:"):
        return (
            f"GRPO_REWARD={reward}: expected one of {', '.join(REWARD_NAMES)}, or python:module.function "
            "for a function of yours"
        )
    if post.grpo_samples is not None and post.grpo_samples < 2:
        return f"GRPO_SAMPLES={post.grpo_samples}: at least 2, the advantages are taken within each prompt's group"
    if post.grpo_max_new_tokens is not None and post.grpo_max_new_tokens >= seq_len:
        return f"GRPO_MAX_NEW_TOKENS={post.grpo_max_new_tokens}: below SEQ_LEN={seq_len}, which holds prompt and answer"
    if post.grpo_clip is not None and not post.grpo_clip > 0:
        return f"GRPO_CLIP={post.grpo_clip}: above 0 (the ratio's allowed move)"
    return None


def fsdp(config: RunConfig, shape: ModelShape, host: Host) -> str | None:
    """What Megatron-FSDP does not run with here, by name (docs/parallelism.md#megatron-fsdp)."""
    lay, ckpt = config.layout, config.checkpoint
    if not lay.fsdp:
        return None
    refused = (
        (lay.pp > 1, f"PP={lay.pp}", FSDP_REFUSALS["pp"]),
        (lay.vision_nproc > 0, f"VISION_NPROC={lay.vision_nproc}", FSDP_REFUSALS["vision_nproc"]),
        (bool(config.lora.rank), f"LORA_RANK={config.lora.rank}", FSDP_REFUSALS["lora"]),
        (
            bool(config.backend.grouped_experts and lay.ep > 1 and (ckpt.save or ckpt.resume)),
            f"EP={lay.ep}, grouped experts and {'CKPT_RESUME' if ckpt.resume else 'CKPT_SAVE'}",
            FSDP_REFUSALS["grouped_ep"],
        ),
    )
    for bad, setting, why in refused:
        if bad:
            return f"FSDP=1 with {setting}: {why}"
    return None


def experts(config: RunConfig, shape: ModelShape, host: Host) -> str | None:
    te = config.backend.transformer_impl == "transformer_engine"
    if config.backend.grouped_experts and te and lora_on_experts(config):
        return (
            "GROUPED_EXPERTS=1 with TRANSFORMER_IMPL=transformer_engine and LoRA on linear_fc1/linear_fc2: TE's "
            "grouped experts take no adapters (TRANSFORMER_IMPL=local, GROUPED_EXPERTS=0, or LORA_TARGETS without them)"
        )
    if config.backend.dispatcher == "alltoall" and not host.gpu:
        return "MOE_DISPATCHER=alltoall needs GPUs: gloo has no uneven all-to-all (use allgather)"
    return None


def backend(config: RunConfig, shape: ModelShape, host: Host) -> str | None:
    if config.backend.transformer_impl != "transformer_engine":
        return None
    if not host.gpu:
        return "TRANSFORMER_IMPL=transformer_engine needs a GPU; this host has none (use local)"
    if not host.transformer_engine():
        import sys

        return (
            f"TRANSFORMER_IMPL=transformer_engine: transformer_engine does not import with "
            f"{sys.executable} (use local, or INSTALL_GPU_EXTRAS=1)"
        )
    return None


# In the order a user meets the settings: sizes, the layout, the data, the adapters, the backend
CHECKS: tuple[Check, ...] = (
    within_limits,
    lr_schedule,
    pipeline_split,
    nodes,
    parallel_sizes,
    batch,
    vision_layout,
    data,
    lora,
    post_training,
    fsdp,
    experts,
    backend,
)


def validate(config: RunConfig, shape: ModelShape, host: Host) -> None:
    for check in CHECKS:
        if line := check(config, shape, host):
            raise LaunchError(line)
