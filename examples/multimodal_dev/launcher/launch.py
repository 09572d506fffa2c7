"""The launcher behind ``run_qwen35_vl.sh``: the run as one ``RunConfig`` (a recipe with the
environment's variables over it, ``from_env.py``), checked once (``checks.py``), said, and started as
torchrun with the training script's flags (``megatron_argv.py``, ``torchrun.py``).

    python -m examples.multimodal_dev.launcher.launch [extra megatron flags]   (what the script runs)

A setting that cannot run is one line naming the variable and its value, exit status 2, before any
rank starts.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from .checks import validate, vision_table
from .from_env import Host, from_env, resolve, shape_of
from .megatron_argv import said_after_checks, to_megatron_argv, torchrun_argv
from .run_config import LaunchError, RunConfig
from .variables import SETTINGS

PROG = "run_qwen35_vl.sh"
# Extra flags come last and win in megatron's parser, but the launcher sizes the processes, the LR
# schedule and its tables from these variables: a flag that replaced one would run a layout other
# than the one checked and printed (--vision-nproc 1 left no rank for the language model).
VARIABLE_OF_FLAG = {setting.flag: setting.name for setting in SETTINGS if setting.flag}


@dataclass
class Launch:
    said: list[str] = field(default_factory=list)  # lines for the user before the run starts
    torchrun: list[str] = field(default_factory=list)  # torchrun's arguments (its own, then the script's)
    config: RunConfig | None = None


def has_gpu() -> bool:
    """A GPU this host's driver sees (``nvidia-smi -L``), asked without importing torch."""
    if not shutil.which("nvidia-smi"):
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


@functools.cache
def te_imports() -> bool:
    probe = [sys.executable, "-c", "import transformer_engine.pytorch"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def refuse_variable_flags(argv: list[str]) -> None:
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in VARIABLE_OF_FLAG:
            raise LaunchError(f"{flag}: set {VARIABLE_OF_FLAG[flag]} instead (the script sizes the run from it)")


def prepare(environ: Mapping[str, str], argv: list[str], host: Host, launch: Launch) -> Launch:
    """The run read, checked and said; ``launch`` filled in. LaunchError names the first setting that
    cannot run (``launch.said`` holds what was said before it)."""
    refuse_variable_flags(argv)
    config, shape, after = from_env(environ, host, launch.said)
    validate(config, shape, host)
    moe, resume = said_after_checks(config)
    launch.said += moe + after + resume
    launch.config, launch.torchrun = config, torchrun_argv(config, host, argv)
    lay, own = config.layout, config.layout.own_vision_layout()
    table = vision_table(config, shape) if own else []
    if config.launcher.dry_run:
        launch.said += [f"# {line}" for line in table] + plan_lines(config)
        return launch
    b, d = config.batch, config.data
    launch.said.append(
        f"{config.model.variant}, TP={lay.tp} CP={lay.cp} EP={lay.ep} PP={lay.pp} VP={lay.vp} "
        f"SP={int(bool(lay.sp))} NPROC={lay.per_node}"
        + (f" NNODES={lay.nnodes} NODE_RANK={config.launcher.node_rank}" if lay.nnodes > 1 else "")
        + f", dataset {d.dataset}, packing {b.packing}, "
        f"{b.train_iters} iterations"
    )
    launch.said += table
    return launch


def argv_of(config: RunConfig, host: Host) -> list[str]:
    """The training script's flags for a run built in Python (a recipe, changed with
    ``dataclasses.replace``): resolved for ``host`` and checked as the script checks its variables."""
    shape = shape_of(config.model)
    config = resolve(config, shape, host, [])
    validate(config, shape, host)
    return to_megatron_argv(config, host)


def plan_lines(config: RunConfig) -> list[str]:
    """DRY_RUN: the layout planner's choice for a cluster of GPUS H100s (docs/planner.md); without
    GPUS, only for the variants with a default count."""
    gpus, hf_config = config.launcher.gpus, config.model.hf_config
    model = ["--hf-config", hf_config] if hf_config else [config.model.variant]
    if not gpus and hf_config:
        return []
    command = [sys.executable, "-m", "examples.multimodal_dev.tools.plan_layout", *model, "--brief"]
    command += ["--fsdp"] if config.layout.fsdp else []  # FSDP=1: its layouts among the candidates
    done = subprocess.run(command + (["--gpus", str(gpus)] if gpus else []), capture_output=True, text=True)
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
        prepare(os.environ, argv, Host(gpu=has_gpu(), transformer_engine=te_imports), launch)
    except LaunchError as err:
        for line in launch.said:
            print(f"{PROG}: {line}", flush=True)
        print(f"{PROG}: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    for line in launch.said:
        print(line if line.startswith("# ") else f"{PROG}: {line}", flush=True)
    assert launch.config is not None
    if launch.config.launcher.dry_run:  # the command stays the last line
        print(shlex.join(["torchrun", *launch.torchrun]), flush=True)
        return
    from .roll_call import SETTINGS_VARIABLE, settings_of

    # what every node's roll call compares with node 0's at the join (roll_call.py)
    os.environ[SETTINGS_VARIABLE] = settings_of(launch.config.variables(), launch.torchrun)
    # torchrun.py: torchrun without its own traceback when a rank fails (the rank has said why)
    module = "examples.multimodal_dev.launcher.torchrun"
    os.execv(sys.executable, [sys.executable, "-m", module, *launch.torchrun])


if __name__ == "__main__":
    main()
