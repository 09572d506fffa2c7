"""The launcher behind ``run_qwen35_vl.sh``: it reads the variables of ``run_variables.py``, checks
every setting before any rank starts (one line naming the variable and its value), prints the
DRY_RUN view, and starts torchrun (``torchrun_launcher.py``).

    python -m examples.multimodal_dev.training.launch [extra megatron flags]   (what the script runs)

The model is named (``--model-variant``, ``--hf-config-path``); its numbers come from the one variant
table (``models/qwen35_vl/configuration.py``) or the Hugging Face config, and the training script
makes them the defaults of megatron's model flags (``models/megatron_args.py``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from ..lora.targets import DEFAULT_TARGETS
from ..models import DEFAULT_ARCH, get_model_entry, model_of
from ..models.setting_names import VARIABLES, schedule_problem
from ..planner.pipeline_layout import stage_layers
from ..vision_ranks.layout import env_table
from .run_variables import NAMES, limit_problem

PROG = "run_qwen35_vl.sh"
# Extra flags come last and win in megatron's parser, but the launcher sizes the processes, the LR
# schedule and its tables from these variables: a flag that replaced one would run a layout other
# than the one checked and printed (--vision-nproc 1 left no rank for the language model).
VARIABLE_OF_FLAG = {
    "--tensor-model-parallel-size": "TP",
    "--context-parallel-size": "CP",
    "--expert-model-parallel-size": "EP",
    "--expert-tensor-parallel-size": "ETP",
    "--pipeline-model-parallel-size": "PP",
    "--num-virtual-stages-per-pipeline-rank": "VP",
    "--decoder-first-pipeline-num-layers": "PP_FIRST",
    "--decoder-last-pipeline-num-layers": "PP_LAST",
    "--sequence-parallel": "SP",
    "--vision-tensor-parallel-size": "VISION_TP",
    "--vision-nproc": "VISION_NPROC",
    "--micro-batch-size": "MBS",
    "--global-batch-size": "GBS",
    "--seq-length": "SEQ_LEN",
    "--train-iters": "TRAIN_ITERS",
    "--lr": "LR",
    "--packing": "PACKING",
    "--packed-seq-length": "PACKED_SEQ_LENGTH",
    "--dataset-provider": "DATASET",
    "--transformer-impl": "TRANSFORMER_IMPL",
    "--lora-rank": "LORA_RANK",
    "--lora-alpha": "LORA_ALPHA",
    "--lora-targets": "LORA_TARGETS",
    "--moe-grouped-gemm": "GROUPED_EXPERTS",
    "--moe-token-dispatcher-type": "MOE_DISPATCHER",
}
DATASETS = ("mock", "mock_mix", "mock_video", "cord_v2", "jsonl", "energon")
OWN_DATA = (
    ("VALID_DATA_PATH", "--eval-data-path"),
    ("VALID_FRACTION", "--valid-fraction"),
    ("MEDIA_ROOT", "--media-root"),
    ("STRICT_DATA", "--strict-data"),
    ("REMOTE_MEDIA", "--allow-remote-media"),
    ("MEDIA_ANYWHERE", "--allow-media-anywhere"),
    ("VIDEO_FPS", "--video-fps"),
    ("VIDEO_MAX_FRAMES", "--video-max-frames"),
    ("VIDEO_MAX_PIXELS", "--video-max-pixels"),
)
SWITCHES = ("STRICT_DATA", "REMOTE_MEDIA", "MEDIA_ANYWHERE")  # 0 or 1; 1 adds the flag alone
CPU_DEFAULTS = dict(TRAIN_ITERS="30", MBS="2", GBS="4", SEQ_LEN="1024", LR="2e-3")
GPU_DEFAULTS = dict(TRAIN_ITERS="20", MBS="1", GBS="8", SEQ_LEN="4096", LR="1e-4")


class LaunchError(ValueError):
    """A setting that cannot run: printed as one line, exit status 2."""


@dataclass
class Launch:
    said: list[str] = field(default_factory=list)  # lines for the user before the run starts
    torchrun: list[str] = field(default_factory=list)  # torchrun's arguments (its own, then the script's)
    dry_run: bool = False
    read: set[str] = field(default_factory=set)  # the variables this launch read


class Settings:
    """The environment, read only through the names of ``run_variables.py``."""

    def __init__(self, environ):
        self.environ, self.values = environ, {}

    def var(self, name: str, default: str | None = None) -> str | None:
        assert name in NAMES, f"{name} is not in run_variables.py's table"
        value = self.environ.get(name) or None  # set but empty reads as unset, as ${NAME:-default} does
        return self.values.setdefault(name, value if value is not None else default)

    def set(self, name: str, value) -> None:
        self.values[name] = str(value)

    def int(self, name: str) -> int:
        return int(self.values[name])

    def positive(self, *names: str) -> None:
        for name in names:
            if not re.fullmatch(r"[1-9][0-9]*", self.values[name] or ""):
                raise LaunchError(f"{name}={self.values[name] or ''} must be a positive integer")

    def within_limits(self) -> None:
        """The values read so far against ``run_variables.LIMITS``, before any is used to size work."""
        if problem := limit_problem(self.values):
            raise LaunchError(problem)

    def switch(self, name: str, meaning: str = "") -> bool:
        value = self.var(name, "0")
        if value not in ("0", "1"):
            raise LaunchError(f"{name}={value}: expected 0 or 1{meaning}")
        return value == "1"


def has_gpu() -> bool:
    """A GPU this host's driver sees (``nvidia-smi -L``), asked without importing torch."""
    if not shutil.which("nvidia-smi"):
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def _te_imports() -> bool:
    probe = [sys.executable, "-c", "import transformer_engine.pytorch"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def refuse_variable_flags(argv: list[str]) -> None:
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in VARIABLE_OF_FLAG:
            raise LaunchError(f"{flag}: set {VARIABLE_OF_FLAG[flag]} instead (the script sizes the run from it)")


def model_shape(s: Settings, gpu: bool, launch: Launch):
    """The shape and the flags that name it, from HF_CONFIG, MOE or MODEL_VARIANT."""
    model = get_model_entry(DEFAULT_ARCH)  # the script trains the registry's default architecture
    hf_config, ckpt_load = s.var("HF_CONFIG"), s.var("CKPT_LOAD")
    if not hf_config and ckpt_load and os.path.isfile(os.path.join(ckpt_load, "hf_config.json")):
        hf_config = os.path.join(ckpt_load, "hf_config.json")
        s.set("HF_CONFIG", hf_config)
        launch.said.append(f"model shape from {hf_config} (written by convert_checkpoint.py import)")
    if hf_config:
        if not os.path.isfile(hf_config):
            raise LaunchError(f"HF_CONFIG={hf_config}: no such file")
        s.set("MODEL_VARIANT", "hf_config")
    elif not s.var("MODEL_VARIANT"):
        s.set("MODEL_VARIANT", "proxy" if gpu else "tiny")
        launch.said.append(
            f"MODEL_VARIANT not set; using '{s.values['MODEL_VARIANT']}' ({'GPU found' if gpu else 'no GPU'})"
        )
    variant, moe = s.values["MODEL_VARIANT"], s.var("MOE", "0")
    try:
        if hf_config:
            what = f"HF_CONFIG={hf_config}"
            return model.shape_from_hf(hf_config), ["--hf-config-path", hf_config]
        if moe == "1":  # tiny with 4 experts (top-2), for expert-parallel runs on CPU
            if variant != "tiny":
                raise LaunchError(f"MOE=1 applies to MODEL_VARIANT=tiny only ({variant} is fixed)")
            what = "MOE=1"
            return model.shape_fn("tiny", moe=True), ["--variant-moe", "on"]
        what = f"MODEL_VARIANT={variant}"
        return model.shape_fn(variant), []
    except LaunchError:
        raise
    except (KeyError, ValueError, OSError) as err:
        reason = err.args[0] if isinstance(err, (KeyError, ValueError)) and err.args else err
        raise LaunchError(f"{what}: {reason}") from None


def sizes(s: Settings, shape, gpu: bool) -> None:
    """The parallel sizes, batch and schedule, each checked as a number first."""
    t = shape.text
    for name in ("TP", "CP", "EP", "PP"):
        s.var(name, "1")
    s.positive("TP", "CP", "EP", "PP")
    s.var("ETP", s.values["TP"])
    s.var("VP", "1")
    s.var("VISION_TP")  # unset: vision_ranks/layout.py's default
    vision_nproc = s.var("VISION_NPROC", "0")
    if not re.fullmatch(r"0|[1-9][0-9]*", vision_nproc):
        raise LaunchError(f"VISION_NPROC={vision_nproc} must be a non-negative integer")
    if not re.fullmatch(r"0|[1-9][0-9]*", s.var("LORA_RANK", "0")):
        raise LaunchError(f"LORA_RANK={s.values['LORA_RANK']} must be 0 (off) or a positive rank")
    s.var("PP_FIRST", "0")
    s.var("PP_LAST", "0")
    s.var("SP", "1" if s.int("TP") > 1 and t.is_moe else "0")
    s.var("NPROC", str(s.int("TP") * s.int("CP") * s.int("PP") + int(vision_nproc)))
    s.var("DATASET", "mock")
    s.var("PACKED", "1")
    if s.var("PACKING", "samples") not in ("samples", "tokens"):
        raise LaunchError(f"PACKING={s.values['PACKING']}: expected samples or tokens")
    if s.values["PACKING"] == "tokens":
        s.var("MBS", "1")  # a micro-batch is one row
    for name, default in (GPU_DEFAULTS if gpu else CPU_DEFAULTS).items():
        s.var(name, default)
    s.var("PACKED_SEQ_LENGTH", s.values["SEQ_LEN"])
    s.positive("ETP", "VP", "NPROC", "TRAIN_ITERS", "MBS", "GBS", "SEQ_LEN", "PACKED_SEQ_LENGTH")
    if s.values["VISION_TP"] is not None:
        s.positive("VISION_TP")
    if s.var("SAVE_INTERVAL") is not None:
        s.positive("SAVE_INTERVAL")
    for name in ("PP_FIRST", "PP_LAST"):
        if not re.fullmatch(r"[0-9]+", s.values[name]):
            raise LaunchError(f"{name}={s.values[name]} must be a number of decoder layers")
    for name in ("LR_WARMUP_ITERS", "LR_DECAY_ITERS"):
        value = s.var(name)
        if value is not None and not re.fullmatch(r"[0-9]+", value):
            raise LaunchError(f"{name}={value} must be a number of iterations")
    s.within_limits()
    warmup, decay = (int(s.values[n]) if s.values[n] else None for n in ("LR_WARMUP_ITERS", "LR_DECAY_ITERS"))
    if problem := schedule_problem(warmup, decay, s.int("TRAIN_ITERS"), names=VARIABLES):
        raise LaunchError(problem)
    try:  # the split of the decoder over pipeline stages (megatron-core's rule, checked by name)
        stage_layers(
            t.num_layers,
            s.int("PP"),
            s.int("VP") or None,
            s.int("PP_FIRST") or None,
            s.int("PP_LAST") or None,
            names=VARIABLES,
        )
    except (KeyError, ValueError) as err:
        raise LaunchError(err.args[0]) from None


def _finite_lr(value: str) -> bool:
    if not re.fullmatch(r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?", value):
        raise LaunchError(f"LR={value}: expected a number such as 1e-4")
    # the pattern admits 1e999, which is inf in fp32 and in Python alike: the first step would turn every weight NaN
    return 0 <= float(value) < 1e38


def layout(s: Settings, shape) -> list[str]:
    """The layout checks, in the variables' terms; the vision tower's rank table."""
    t, variant = shape.text, s.values["MODEL_VARIANT"]
    tp, cp, ep, etp, pp = (s.int(n) for n in ("TP", "CP", "EP", "ETP", "PP"))
    nproc, vision_nproc, mbs, gbs = (s.int(n) for n in ("NPROC", "VISION_NPROC", "MBS", "GBS"))
    sp = s.switch("SP")
    if s.values["PACKED"] not in ("0", "1"):
        raise LaunchError(f"PACKED={s.values['PACKED']}: expected 0 (padded BSHD) or 1 (THD packing)")
    if not _finite_lr(s.values["LR"]):
        raise LaunchError(f"LR={s.values['LR']}: expected a finite learning rate")
    experts = t.num_experts if t.is_moe else 0
    lang = nproc - vision_nproc  # the language model's ranks: all but those of the vision tower
    lang_name = "(NPROC-VISION_NPROC)" if vision_nproc else "NPROC"
    checks = (
        (not sp or tp > 1, "SP=1 needs TP>1 (sequence parallelism splits the sequence over TP ranks)"),
        (
            s.int("SEQ_LEN") % (2 * cp) == 0,
            f"SEQ_LEN={s.values['SEQ_LEN']} must be a multiple of 2*CP={2 * cp} "
            "(context parallelism cuts every sample into 2*CP chunks)",
        ),
        (
            sp or tp == 1 or not experts,
            f"SP=0 with TP={tp}: megatron-core requires sequence parallelism for MoE with TP>1",
        ),
        (lang > 0, f"VISION_NPROC={vision_nproc} leaves no ranks for the language model (NPROC={nproc})"),
        (lang % (tp * cp * pp) == 0, f"{lang_name}={lang} is not divisible by TP*CP*PP={tp * cp * pp}"),
        ((lang // pp) % (ep * etp) == 0, f"EP={ep}: {lang_name}/PP={lang // pp} is not divisible by EP*ETP={ep * etp}"),
    )
    # the model's own checks (heads, Gated DeltaNet heads, experts), in the variables' names, after the
    # sequence-parallel ones and before the process counts
    model = [
        f"{line} ({variant})"
        for line in model_of(shape).parallel_problems(shape, tp, cp, ep, names=VARIABLES, vision=False)
    ]
    problems = [message for ok, message in checks[:3] if not ok] + model + [m for ok, m in checks[3:] if not ok]
    if problems:
        raise LaunchError(problems[0])
    dp = lang // (tp * cp * pp)
    if gbs % (mbs * dp):
        raise LaunchError(f"GBS={gbs} is not a multiple of MBS*DP={mbs * dp}")
    vision_tp = s.values["VISION_TP"]
    try:  # the vision tower's own ranks and TP / DP, refused by name where megatron-core cannot run them
        return env_table(
            nproc, tp, cp, pp, s.int("VP"), int(vision_tp) if vision_tp else None, vision_nproc, shape.vision.num_heads
        )
    except ValueError as err:
        raise LaunchError(err.args[0]) from None


def data_flags(s: Settings) -> list[str]:
    """DATASET and the user's-data variables (arguments.py, "your own data")."""
    dataset = s.values["DATASET"]
    if dataset in ("cord_v2", "jsonl", "energon"):
        for name in ("DATA_PATH", "HF_PROCESSOR_PATH"):
            if not s.var(name):
                raise LaunchError(f"DATASET={dataset} needs {name}")
    elif dataset not in DATASETS:
        raise LaunchError(f"DATASET={dataset} must be {', '.join(DATASETS[:-1])} or {DATASETS[-1]}")
    for name in SWITCHES:
        s.switch(name)
    fraction, fps = s.var("VALID_FRACTION"), s.var("VIDEO_FPS")
    if fraction is not None and not re.fullmatch(r"0?\.[0-9]+|0", fraction):
        raise LaunchError(f"VALID_FRACTION={fraction}: expected a fraction below 1, such as 0.02")
    if fps is not None and not (re.fullmatch(r"[0-9]*\.?[0-9]+", fps) and float(fps) > 0):
        raise LaunchError(f"VIDEO_FPS={fps}: expected a positive number such as 2")
    for name in ("VIDEO_MAX_FRAMES", "VIDEO_MAX_PIXELS"):
        if s.var(name) is not None:
            s.positive(name)
    flags = []
    for name, flag in OWN_DATA:
        value = s.var(name)
        if name in SWITCHES:
            flags += [flag] if value == "1" else []
        elif value is not None:
            flags += [flag, value]
    if flags and dataset not in ("jsonl", "energon"):
        raise LaunchError(
            "VALID_DATA_PATH, VALID_FRACTION, MEDIA_ROOT, STRICT_DATA, REMOTE_MEDIA, MEDIA_ANYWHERE and "
            f"VIDEO_* apply to DATASET=jsonl (and energon) only (DATASET={dataset})"
        )
    if dataset == "energon":  # the shards hold the media; validation is the dataset's val split
        for name in ("VALID_DATA_PATH", "VALID_FRACTION", "MEDIA_ROOT", "REMOTE_MEDIA", "MEDIA_ANYWHERE"):
            if s.values[name] not in (None, "0"):
                raise LaunchError(
                    f"{name} applies to DATASET=jsonl; an energon dataset carries its media and its val split"
                )
    return flags


def model_flags(s: Settings, shape, variant_flags: list[str], data: list[str], gpu: bool) -> list[str]:
    """megatron's flags of the layout, the schedule and the data, and the model's name: its numbers
    (layers, widths, heads, experts, vocabulary) are the training script's defaults for megatron's
    model flags, read from the same shape (``models/megatron_args.py``'s ``with_model_shape``)."""
    v = s.values
    train_iters, lr = s.int("TRAIN_ITERS"), v["LR"]
    args = [
        "--model-arch",
        DEFAULT_ARCH,
        "--model-variant",
        v["MODEL_VARIANT"],
        "--seq-length",
        v["SEQ_LEN"],
        "--tensor-model-parallel-size",
        v["TP"],
        "--context-parallel-size",
        v["CP"],
        "--expert-model-parallel-size",
        v["EP"],
        "--expert-tensor-parallel-size",
        v["ETP"],
        "--pipeline-model-parallel-size",
        v["PP"],
        "--micro-batch-size",
        v["MBS"],
        "--global-batch-size",
        v["GBS"],
        "--train-iters",
        v["TRAIN_ITERS"],
        "--lr",
        lr,
        "--min-lr",
        f"{float(lr) / 10:.6g}",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        v["LR_WARMUP_ITERS"] or str(train_iters // 10),
        "--lr-decay-iters",
        v["LR_DECAY_ITERS"] or str(train_iters),
        "--weight-decay",
        "0.01",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--clip-grad",
        "1.0",
        "--calculate-per-token-loss",
        "--log-interval",
        "1",
        "--eval-interval",
        str(train_iters),
        "--eval-iters",
        "2",
        "--dataset-provider",
        v["DATASET"],
        "--seed",
        "1234",
        *variant_flags,
        *data,
    ]
    args += [] if v["PACKED"] == "1" else ["--no-packed-sequence"]
    args += [] if v["PACKING"] == "samples" else ["--packing", "tokens", "--packed-seq-length", v["PACKED_SEQ_LENGTH"]]
    args += ["--num-virtual-stages-per-pipeline-rank", v["VP"]] if s.int("VP") > 1 else []
    if v["VISION_TP"] and own_vision_layout(s):
        args += ["--vision-tensor-parallel-size", v["VISION_TP"]]
    # the tower on ranks of its own sums its grad norm over the world's distributed-optimizer shards
    args += ["--vision-nproc", v["VISION_NPROC"], "--use-distributed-optimizer"] if s.int("VISION_NPROC") else []
    args += ["--decoder-first-pipeline-num-layers", v["PP_FIRST"]] if s.int("PP_FIRST") else []
    args += ["--decoder-last-pipeline-num-layers", v["PP_LAST"]] if s.int("PP_LAST") else []
    args += ["--sequence-parallel"] if v["SP"] == "1" else []
    hf_mtp = shape.text.mtp_num_layers if s.values["HF_CONFIG"] else 0  # never read from the environment
    mtp = s.var("MTP", "1" if hf_mtp > 0 else "0")
    if mtp not in ("0", "1"):
        raise LaunchError(f"MTP={mtp}: expected 0 or 1 (Qwen3.5 has one MTP layer)")
    # megatron's argument check admits MTP only with rotary positions; the model's interleaved MRoPE is
    # built from the variant, so this flag only satisfies that check
    args += ["--mtp-num-layers", "1", "--position-embedding-type", "rope"] if mtp == "1" else []
    for name, flag in (("DATA_PATH", "--data-path"), ("HF_PROCESSOR_PATH", "--hf-processor-path")):
        args += [flag, s.var(name)] if s.var(name) else []
    for name, flag in (("LORA_ALPHA", "--lora-alpha"), ("LORA_TARGETS", "--lora-targets")):
        if s.var(name) and not s.int("LORA_RANK"):  # dropped, every weight would train
            raise LaunchError(f"{name}={s.values[name]} without LORA_RANK: there are no adapters (set LORA_RANK)")
    if s.int("LORA_RANK"):  # the training script checks the values (lora/targets.py)
        args += ["--lora-rank", v["LORA_RANK"]]
        for name, flag in (("LORA_ALPHA", "--lora-alpha"), ("LORA_TARGETS", "--lora-targets")):
            args += [flag, s.var(name)] if s.var(name) else []
    return args


def moe_flags(s: Settings, shape, gpu: bool, launch: Launch) -> list[str]:
    """How an MoE model's experts run: grouped GEMMs unless LoRA adapts the experts' linears (its
    adapters sit on SequentialMLP's per-expert linears), and the token dispatcher that fits the layout:
    all-to-all only where experts are split over EP ranks on GPUs (at EP=1 it splits and joins the
    tokens once per expert for nothing; gloo has no uneven all-to-all)."""
    if not shape.text.is_moe:
        return []
    targets = (s.var("LORA_TARGETS") or ",".join(DEFAULT_TARGETS)).split(",")
    lora_on_experts = s.int("LORA_RANK") > 0 and bool({"linear_fc1", "linear_fc2"} & set(targets))
    if s.var("GROUPED_EXPERTS") is None:
        s.set("GROUPED_EXPERTS", int(not lora_on_experts))
    grouped = s.switch("GROUPED_EXPERTS", " (1: grouped GEMM experts, 0: SequentialMLP)")
    if grouped and lora_on_experts:
        raise LaunchError(
            "GROUPED_EXPERTS=1 with LoRA on linear_fc1/linear_fc2: the adapters need SequentialMLP's per-expert "
            "linears (GROUPED_EXPERTS=0, or LORA_TARGETS without them)"
        )
    ep = s.int("EP")
    dispatcher = s.var("MOE_DISPATCHER", "alltoall" if gpu and ep > 1 else "allgather")
    if dispatcher not in ("allgather", "alltoall"):
        raise LaunchError(f"MOE_DISPATCHER={dispatcher}: expected allgather or alltoall")
    if dispatcher == "alltoall" and not gpu:
        raise LaunchError("MOE_DISPATCHER=alltoall needs GPUs: gloo has no uneven all-to-all (use allgather)")
    experts = (
        "grouped GEMM experts"
        if grouped
        else "SequentialMLP experts" + (" (LoRA adapts them)" if lora_on_experts else "")
    )
    unsynced = " (dropless: no host syncs)" if grouped and ep == 1 and dispatcher == "allgather" else ""
    launch.said.append(
        f"MoE: {experts}, {dispatcher} token dispatcher at EP={ep}{unsynced} (GROUPED_EXPERTS, MOE_DISPATCHER override)"
    )
    return ["--moe-token-dispatcher-type", dispatcher] + (["--moe-grouped-gemm"] if grouped else [])


def own_vision_layout(s: Settings) -> bool:
    """The tower has a layout of its own: its rank table is printed, and a VISION_TP set is passed on."""
    return s.int("VISION_NPROC") > 0 or int(s.values["VISION_TP"] or s.values["TP"]) != s.int("TP")


def backend_flags(s: Settings, gpu: bool, launch: Launch) -> list[str]:
    """Transformer Engine where a GPU has it, else megatron-core's local modules (the same checkpoint
    keys either way); the host decides precision and the collective backend."""
    impl = s.var("TRANSFORMER_IMPL")
    if not impl and s.int("LORA_RANK"):  # the adapters' checked backend (docs/lora.md, Transformer Engine)
        impl = "local"
        s.set("TRANSFORMER_IMPL", impl)
        launch.said.append("backend local (LoRA's default; TRANSFORMER_IMPL=transformer_engine puts adapters on TE)")
    elif not impl:
        impl = "transformer_engine" if gpu and _te_imports() else "local"
        s.set("TRANSFORMER_IMPL", impl)
        launch.said.append(f"backend {impl} ({'GPU' if gpu else 'CPU'} host; TRANSFORMER_IMPL overrides)")
    elif impl == "transformer_engine":
        if not gpu:
            raise LaunchError("TRANSFORMER_IMPL=transformer_engine needs a GPU; this host has none (use local)")
        if not _te_imports():
            raise LaunchError(
                f"TRANSFORMER_IMPL=transformer_engine: transformer_engine does not import with "
                f"{sys.executable} (use local, or INSTALL_GPU_EXTRAS=1)"
            )
    elif impl != "local":
        raise LaunchError(f"TRANSFORMER_IMPL={impl}: expected transformer_engine or local")
    # --log-throughput: model TFLOP/s from models/qwen35_vl/flops.py (megatron's GPT formula is replaced)
    return ["--transformer-impl", impl, "--log-throughput", *(["--bf16"] if gpu else ["--distributed-backend", "gloo"])]


def checkpoint_flags(s: Settings, launch: Launch) -> list[str]:
    resume, load, save = s.var("CKPT_RESUME"), s.values["CKPT_LOAD"], s.var("CKPT_SAVE")
    interval = s.values["SAVE_INTERVAL"] or s.values["TRAIN_ITERS"]
    if not resume:
        return (["--load", load, "--finetune"] if load else []) + (
            ["--save", save, "--save-interval", interval] if save else []
        )
    # CKPT_LOAD with CKPT_RESUME: the first run starts from CKPT_LOAD's weights (megatron loads
    # --pretrained-checkpoint, as --finetune, while the resume directory holds no checkpoint); later runs resume
    flags = ["--load", resume, "--save", resume, "--save-interval", interval]
    flags += ["--pretrained-checkpoint", load] if load else []
    if os.path.isfile(os.path.join(resume, "latest_checkpointed_iteration.txt")):
        # megatron refuses a schedule that differs from the checkpoint's: keep the saved one (a longer
        # TRAIN_ITERS then extends the run at its final LR) unless the user sets one explicitly
        if s.values["LR_WARMUP_ITERS"] or s.values["LR_DECAY_ITERS"]:
            flags.append("--override-opt_param-scheduler")
            launch.said.append("resuming with the LR schedule of LR_WARMUP_ITERS / LR_DECAY_ITERS")
        else:
            flags.append("--use-checkpoint-opt_param-scheduler")
            launch.said.append(
                "resuming with the checkpoint's LR schedule (LR_WARMUP_ITERS / LR_DECAY_ITERS replace it)"
            )
    return flags


def prepare(environ, argv: list[str], gpu: bool, launch: Launch) -> Launch:
    """Every setting checked, in the order a user meets them; ``launch`` filled in (what to say, and
    torchrun's arguments). LaunchError names the first setting that cannot run."""
    refuse_variable_flags(argv)
    s = Settings(environ)
    launch.read = s.values.keys()  # a live view: what is read from here on
    shape, variant_flags = model_shape(s, gpu, launch)
    if s.values["MOE"] not in ("0", "1"):
        raise LaunchError(f"MOE={s.values['MOE']}: expected 0 or 1")
    sizes(s, shape, gpu)
    vision_table = layout(s, shape)
    args = model_flags(s, shape, variant_flags, data_flags(s), gpu)
    args += moe_flags(s, shape, gpu, launch)
    args += backend_flags(s, gpu, launch) + checkpoint_flags(s, launch)
    # several runs may share a host: without MASTER_PORT, torchrun --standalone picks a free port
    port = s.var("MASTER_PORT")
    if port is not None:
        s.positive("MASTER_PORT")
    if s.var("GPUS") is not None:
        s.positive("GPUS")
    s.within_limits()
    rdzv = ["--master-port", port] if port else ["--standalone"]
    # the training script runs as a module of the package examples.multimodal_dev (PYTHONPATH holds the
    # repository root), so no folder of the example shadows an installed package
    launch.torchrun = [
        "--nproc-per-node",
        s.values["NPROC"],
        *rdzv,
        "--module",
        "examples.multimodal_dev.pretrain_multimodal",
        *args,
        *argv,
    ]
    launch.dry_run = s.var("DRY_RUN", "0") == "1"
    own = own_vision_layout(s)
    if launch.dry_run:
        launch.said += ([f"# {line}" for line in vision_table] if own else []) + plan_lines(s)
        return launch
    v = s.values
    launch.said.append(
        f"{v['MODEL_VARIANT']}, TP={v['TP']} CP={v['CP']} EP={v['EP']} PP={v['PP']} VP={v['VP']} "
        f"SP={v['SP']} NPROC={v['NPROC']}, dataset {v['DATASET']}, packing {v['PACKING']}, "
        f"{v['TRAIN_ITERS']} iterations"
    )
    launch.said += vision_table if own else []
    return launch


def plan_lines(s: Settings) -> list[str]:
    """DRY_RUN: the layout planner's choice for a cluster of GPUS H100s (docs/planner.md); without
    GPUS, only for the variants with a default count."""
    gpus, hf_config = s.var("GPUS"), s.values["HF_CONFIG"]
    model = ["--hf-config", hf_config] if hf_config else [s.values["MODEL_VARIANT"]]
    if not gpus and hf_config:
        return []
    if gpus:
        s.positive("GPUS")
    command = [sys.executable, "-m", "examples.multimodal_dev.tools.plan_layout", *model, "--brief"]
    done = subprocess.run(command + (["--gpus", gpus] if gpus else []), capture_output=True, text=True)
    if done.returncode == 0:
        return [f"# planned cluster layout: {done.stdout.strip()}"]
    if gpus:
        said = (done.stderr or done.stdout).strip()
        raise LaunchError(f"GPUS={gpus}: {said.rsplit('plan_layout: ', 1)[-1]}")
    return []


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    launch = Launch()
    try:
        prepare(os.environ, argv, has_gpu(), launch)
    except LaunchError as err:
        for line in launch.said:
            print(f"{PROG}: {line}", flush=True)
        print(f"{PROG}: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    for line in launch.said:
        print(line if line.startswith("# ") else f"{PROG}: {line}", flush=True)
    if launch.dry_run:  # the command stays the last line
        print(shlex.join(["torchrun", *launch.torchrun]), flush=True)
        return
    # torchrun_launcher.py: torchrun without its own traceback when a rank fails (the rank has said why)
    os.execv(
        sys.executable, [sys.executable, "-m", "examples.multimodal_dev.training.torchrun_launcher", *launch.torchrun]
    )


if __name__ == "__main__":
    main()
